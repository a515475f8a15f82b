#!/usr/bin/env python3
"""Measure one resize on the local cluster, step by step, the way the daemon does it.

A template job (the spiral example, torch DDP on CPU) trains on 1 node x 2 GPUs; then, timed from the
decision: ``scancel --signal=USR2`` -> checkpoint acknowledged -> ``requeue_hold`` settled ->
``update_job`` + ``release`` -> Slurm runs it again -> the first training step at the new size
(2 nodes x 2 GPUs). Repeated ``--runs`` times; prints each phase's median, which is the simulator's
restart-cost figure for this machine.

Usage: python benchmarks/resize_latency.py [--state-dir DIR] [--runs 3] [--json OUT]
(starts its own 4x4 cluster on free ports unless --state-dir names one that is up).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from slurm_elastic.cluster import LocalCluster, cluster_for  # noqa: E402
from slurm_elastic.spec import Decision  # noqa: E402
from slurm_elastic.train.protocol import read_ack  # noqa: E402

TEMPLATE = REPO / "sbatch_templates" / "elastic_ddp.sbatch"
EXAMPLE = REPO / "examples" / "train_elastic_spiral.py"
SPEC = "elastic:min_gpus=1,max_gpus=8,min_batch=32,max_batch=256,max_local_batch=32,batch=64"


def wait(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise TimeoutError(what)


def lines(path: Path) -> int:
    try:
        return len(path.read_text().splitlines())
    except FileNotFoundError:
        return 0


def one_resize(cluster: LocalCluster, work: Path) -> dict:
    b = cluster.backend
    work.mkdir(parents=True, exist_ok=True)
    os.chmod(work, 0o755)
    ckpt, rec = work / "ckpt", work / "rec"
    export = ",".join(["ALL", f"ELASTIC_PYTHON={sys.executable}", f"ELASTIC_TRAIN_SCRIPT={EXAMPLE}",
                       f"ELASTIC_CKPT_DIR={ckpt}", "ELASTIC_REQUEUE_WAIT=300", "ELASTIC_SELF_REQUEUE=0",
                       "OMP_NUM_THREADS=1"])
    jid = cluster.sbatch([f"--export={export}", "-o", str(work / "job.out"), f"--comment={SPEC}", "--nodes=1",
                          "--gres=gpu:2", str(TEMPLATE), "--epochs", "200", "--n-per-class", "400",
                          "--step-delay", "0.05", "--record-samples", str(rec)], cwd=work)
    try:
        first = rec / f"samples.{jid}.s0.r0.txt"
        wait(lambda: lines(first) >= 5, 180, "first start never trained")
        t0 = time.monotonic()
        b.signal(jid, "USR2")
        wait(lambda: read_ack(ckpt, jid, 0), 120, "no checkpoint ack")
        t_ack = time.monotonic()
        b.requeue_hold(jid)
        t_requeued = time.monotonic()
        d = Decision(gpus=4, nodes=2, batch=64, local_batch=16, seq=1)
        b.update_job(jid, gpus_per_node=2, num_nodes=2, num_tasks=4, start_now=True, admin_comment=d.to_admin_comment())
        b.release(jid)
        t_released = time.monotonic()
        wait(lambda: (j := b.get_job(jid)) is not None and j.is_running, 120, "not running again")
        t_running = time.monotonic()
        wait(lambda: lines(rec / f"samples.{jid}.s1.r0.txt") >= 1, 180, "no training step after the restart")
        t_training = time.monotonic()
    finally:
        subprocess.run(["/usr/bin/scancel", str(jid)], env=cluster.env, capture_output=True, timeout=30, check=False)
    return {
        "signal_to_ack_s": t_ack - t0,
        "requeue_hold_s": t_requeued - t_ack,
        "update_release_s": t_released - t_requeued,
        "release_to_running_s": t_running - t_released,
        "running_to_training_s": t_training - t_running,
        "decision_to_training_s": t_training - t0,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state-dir")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    with cluster_for(args.state_dir, prefix="se-bench-", start_port=24000) as cluster:
        runs = [one_resize(cluster, Path(tempfile.mkdtemp(prefix="se-resize-"))) for _ in range(args.runs)]
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    print(f"resize 1x2 -> 2x2 GPUs on the local cluster (Slurm {cluster.backend.version()}), "
          f"median of {len(runs)} runs:")
    for k, v in med.items():
        print(f"  {k:<24} {v:6.2f} s   (runs: {', '.join(f'{r[k]:.2f}' for r in runs)})")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "median": med}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
