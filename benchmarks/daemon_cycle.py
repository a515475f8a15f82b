#!/usr/bin/env python3
"""Daemon cycle time against a real slurmctld holding many pending elastic jobs.

Submits ``--jobs`` held elastic jobs (``sbatch --hold``, in bulk) to a local cluster, then times
``--cycles`` full daemon cycles in dry-run mode (one ``squeue --json`` and one node read, spec parsing,
the DP over every job, planning; nothing enacted, so the queue stays the same for every cycle).
Prints the median cycle time, its parts, and the daemon's peak RSS.

Usage: python benchmarks/daemon_cycle.py [--jobs 1000] [--cycles 5] [--state-dir DIR] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from slurm_elastic.cluster import LocalCluster, cluster_for  # noqa: E402
from slurm_elastic.daemon.config import config_from_dict  # noqa: E402
from slurm_elastic.daemon.loop import Daemon  # noqa: E402

PROFILES = ["cifar10", "bert", "imagenet", "deepspeech2", "yolov3"]


def submit_many(cluster: LocalCluster, n: int, work: Path) -> list[int]:
    script = work / "job.sh"
    script.write_text("#!/bin/bash\nsleep 600\n")
    ids = []
    for i in range(n):
        p = PROFILES[i % len(PROFILES)]
        spec = f"elastic:min_gpus=1,max_gpus=8,min_batch=64,max_batch=2048,max_local_batch=256,batch=256,profile={p}"
        ids.append(cluster.sbatch(["--hold", "--requeue", "-o", "/dev/null", "--gres=gpu:1", f"--comment={spec}",
                                   str(script)], cwd=work))
    return ids


def measure(cluster: LocalCluster, n_jobs: int, cycles: int) -> dict:
    work = Path(tempfile.mkdtemp(prefix="se-cycle-jobs-"))
    ids: list[int] = []
    try:
        t = time.monotonic()
        ids = submit_many(cluster, n_jobs, work)
        submit_s = time.monotonic() - t
        cfg = config_from_dict({"state_dir": str(work / "state"), "metrics_address": ""})
        d = Daemon(cfg, backend=cluster.backend, dry_run=True)
        d.enactor = None
        times, reads, solves = [], [], []
        for _ in range(cycles):
            t0 = time.perf_counter()
            jobs = cluster.backend.list_jobs()
            reads.append(time.perf_counter() - t0)
            t1 = time.perf_counter()
            r = d.cycle()
            times.append(time.perf_counter() - t1)
            solves.append(r.allocation.solve_s)
        rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        out = {
            "jobs_pending": sum(1 for j in jobs if j.is_pending), "submit_s": submit_s,
            "cycle_median_s": statistics.median(times), "cycle_first_s": times[0],
            "squeue_read_parse_median_s": statistics.median(reads), "solve_median_s": statistics.median(solves),
            "peak_rss_mib": rss_mib, "slurm": cluster.backend.version(),
        }
    finally:
        for k in range(0, len(ids), 500):
            subprocess.run(["/usr/bin/scancel", *map(str, ids[k:k + 500])], env=cluster.env, capture_output=True,
                           timeout=120, check=False)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--state-dir")
    ap.add_argument("--json")
    args = ap.parse_args()
    with cluster_for(args.state_dir, prefix="se-cycle-", start_port=25000) as cluster:
        out = measure(cluster, args.jobs, args.cycles)
    print(f"daemon cycle with {out['jobs_pending']} pending elastic jobs (Slurm {out['slurm']}, dry run): "
          f"median {out['cycle_median_s']:.3f} s (first {out['cycle_first_s']:.3f} s); "
          f"squeue --json read+parse {out['squeue_read_parse_median_s']:.3f} s; DP solve {out['solve_median_s']:.3f} s; "
          f"peak RSS {out['peak_rss_mib']:.0f} MiB; submitting them took {out['submit_s']:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
