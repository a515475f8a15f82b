#!/usr/bin/env bash
# The main job: a local Slurm with 4 nodes x 4 fake GPUs, an elastic job on it, and what it looks like.
set -euo pipefail
cd "$(dirname "$0")/.."
SE=.venv/bin/slurm-elastic
$SE cluster up --nodes 4 --gpus-per-node 4
export SLURM_CONF="${SLURM_ELASTIC_CLUSTER_DIR:-$HOME/.local/state/slurm-elastic/cluster}/etc/slurm.conf"
echo; echo "== sinfo"; sinfo -N -o "%N %t %G"
echo; echo "== slurm-elastic cluster status"; $SE cluster status
work=$(mktemp -d /tmp/slurm-elastic-demo.XXXXXX); chmod 755 "$work"
printf '#!/bin/bash\nsleep 30\n' > "$work/job.sh"
jid=$(sbatch --parsable --hold --requeue -o /dev/null -D "$work" --gres=gpu:2 \
  --comment="elastic:min_gpus=1,max_gpus=8,min_batch=128,max_batch=4096,max_local_batch=512,batch=256" "$work/job.sh")
echo; echo "== an elastic job (held, as the submit plugin will hold it): slurm-elastic status"
$SE status
scancel "$jid"
echo; echo "The cluster stays up: export SLURM_CONF=$SLURM_CONF to use it; 'make down' stops it."
