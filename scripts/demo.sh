#!/usr/bin/env bash
# The main job: a local Slurm with 4 nodes x 4 fake GPUs; elastic torch DDP jobs and a non-elastic job
# compete for the 16 GPUs under the slurm-elastic daemon, which admits, shrinks and grows them.
set -euo pipefail
cd "$(dirname "$0")/.."
SE=.venv/bin/slurm-elastic
$SE cluster up --nodes 4 --gpus-per-node 4
export SLURM_CONF="${SLURM_ELASTIC_CLUSTER_DIR:-$HOME/.local/state/slurm-elastic/cluster}/etc/slurm.conf"
echo; echo "== sinfo"; sinfo -N -o "%N %t %G"
echo; echo "== slurm-elastic cluster status"; $SE cluster status
echo; echo "== the demo: elastic jobs A (1-8 GPUs), B and C (2-4 GPUs) and one non-elastic job (8 GPUs)"
.venv/bin/python -m slurm_elastic.demo --state-dir "${SLURM_ELASTIC_CLUSTER_DIR:-$HOME/.local/state/slurm-elastic/cluster}"
echo; echo "The cluster stays up: export SLURM_CONF=$SLURM_CONF to use it; 'make down' stops it."
