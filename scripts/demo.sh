#!/usr/bin/env bash
# The main job: a local Slurm with 4 nodes x 4 fake GPUs, emulated as T4s (the jobs' steps are paced to
# Pollux's cifar10 measurements); elastic torch DDP jobs and a non-elastic job share the 16 GPUs under the
# slurm-elastic daemon, which admits, shrinks, grows and re-batches them. Ends with a timeline picture.
set -euo pipefail
cd "$(dirname "$0")/.."
SE=.venv/bin/slurm-elastic
STATE=${SLURM_ELASTIC_CLUSTER_DIR:-$HOME/.local/state/slurm-elastic/cluster}
# The cluster's port: the running demo cluster's own, else 16817 when free, else the next free block (a
# machine where another local cluster already listens there must not fail the demo).
PORT=$(.venv/bin/python -c '
import sys
from slurm_elastic.cluster import LocalCluster, find_free_port_block
c = LocalCluster(sys.argv[1])
print(c.config.ctld_port if c.is_up() else find_free_port_block(5, start=16817))' "$STATE")
$SE cluster up --nodes 4 --gpus-per-node 4 --port "$PORT"
export SLURM_CONF="$STATE/etc/slurm.conf"
echo; echo "== sinfo"; sinfo -N -o "%N %t %G"
echo; echo "== the demo: elastic jobs A (2-4 GPUs), D (1-4), B (2) and C (1-4) on emulated T4s, and a non-elastic job (8 GPUs)"
WORK=$(mktemp -d /tmp/slurm-elastic-demo-XXXXXX)
.venv/bin/python -m slurm_elastic.demo --state-dir "$STATE" --work-dir "$WORK" --png "$PWD/demo-timeline.png" \
  --json "$WORK/summary.json"
echo
echo "The timeline: $PWD/demo-timeline.png (again, from the daemon's state: $SE report --state-dir $WORK/daemon-state)"
echo "The cluster stays up: export SLURM_CONF=$SLURM_CONF to use it; 'make down' stops it."
