#!/usr/bin/env python3
"""Daemon cycle time and RSS against a real slurmctld holding many pending elastic jobs, per backend.

Brings the queue of a local cluster up to each ``--jobs`` size (held elastic jobs, ``sbatch --hold``,
submitted in parallel; the queue only grows, so sizes are measured in increasing order), then times
``--cycles`` full daemon cycles in dry-run mode (one job read and one node read, spec parsing, the DP
over every job, planning; nothing enacted, so the queue stays the same) with each ``--backends``
entry: ``cli`` (``squeue --json``) and ``pyslurm`` (libslurm in process). Each (backend, size) runs in
a fresh child process, so its peak RSS is its own. Prints one line per measurement and a table.

The cluster's MaxJobCount is raised to hold the largest size (Slurm's default is 10,000).

Usage: python benchmarks/daemon_cycle.py [--jobs 1000,5000,20000] [--backends cli,pyslurm] [--cycles 5]
       [--state-dir DIR (a cluster that is up, reused; its jobs are kept)] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from slurm_elastic.cluster import ClusterConfig, LocalCluster, cluster_for  # noqa: E402

PROFILES = ["cifar10", "bert", "imagenet", "deepspeech2", "yolov3"]


def held_jobs(cluster: LocalCluster) -> int:
    out = cluster.run_tool("squeue", "-h", "-t", "PD", "-o", "%i", timeout=300).stdout
    return sum(1 for line in out.splitlines() if line.strip())


def top_up(cluster: LocalCluster, n: int, work: Path, threads: int = 4) -> float:
    """Submit held elastic jobs until ``n`` are pending; returns the seconds it took."""
    script = work / "job.sh"
    script.write_text("#!/bin/bash\nsleep 600\n")
    missing = n - held_jobs(cluster)
    t = time.monotonic()

    def one(i: int) -> int:
        p = PROFILES[i % len(PROFILES)]
        spec = f"elastic:min_gpus=1,max_gpus=8,min_batch=64,max_batch=2048,max_local_batch=256,batch=256,profile={p}"
        return cluster.sbatch(["--hold", "--requeue", "-o", "/dev/null", "--gres=gpu:1", f"--comment={spec}",
                               str(script)], cwd=work)

    if missing > 0:
        with ThreadPoolExecutor(threads) as pool:
            for k, _ in enumerate(pool.map(one, range(missing))):
                if k and k % 1000 == 0:
                    print(f"  submitted {k}/{missing}", file=sys.stderr, flush=True)
    return time.monotonic() - t


def measure_here(state_dir: str, backend_name: str, cycles: int) -> dict:
    """In this (child) process: ``cycles`` dry-run daemon cycles with one backend; peak RSS after."""
    cluster = LocalCluster(state_dir)
    os.environ["SLURM_CONF"] = str(cluster.conf_path)  # before pyslurm initialises libslurm
    from slurm_elastic.daemon.config import config_from_dict
    from slurm_elastic.daemon.loop import Daemon

    if backend_name == "pyslurm":
        from slurm_elastic.backends.pyslurm_backend import PyslurmBackend

        backend = PyslurmBackend(cli=cluster.backend)
    else:
        backend = cluster.backend
    work = Path(tempfile.mkdtemp(prefix="se-cycle-state-"))
    cfg = config_from_dict({"state_dir": str(work / "state"), "metrics_address": ""})
    d = Daemon(cfg, backend=backend, dry_run=True)
    d.enactor = None
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    times, reads, solves = [], [], []
    jobs = []
    for _ in range(cycles):
        t0 = time.perf_counter()
        jobs = backend.list_jobs()
        reads.append(time.perf_counter() - t0)
        t1 = time.perf_counter()
        r = d.cycle()
        times.append(time.perf_counter() - t1)
        solves.append(r.allocation.solve_s)
    return {
        "backend": backend_name, "jobs_pending": sum(1 for j in jobs if j.is_pending),
        "cycle_median_s": statistics.median(times), "cycle_first_s": times[0],
        "read_median_s": statistics.median(reads), "solve_median_s": statistics.median(solves),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "rss_before_mib": rss0,
        "slurm": cluster.backend.version(),
        "pyslurm": getattr(backend, "pyslurm_version", lambda: "")(),
    }


def measure(state_dir: str, backend_name: str, cycles: int) -> dict:
    r = subprocess.run([sys.executable, __file__, "--child", backend_name, "--state-dir", state_dir,
                        "--cycles", str(cycles)], capture_output=True, text=True, timeout=3600, check=False)
    if r.returncode != 0:
        return {"backend": backend_name, "error": (r.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", default="1000,5000,20000", help="comma-separated queue sizes")
    ap.add_argument("--backends", default="cli,pyslurm")
    ap.add_argument("--cycles", type=int, default=5)
    ap.add_argument("--state-dir")
    ap.add_argument("--json")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure_here(args.state_dir, args.child, args.cycles)))
        return 0
    sizes = sorted(int(x) for x in args.jobs.split(",") if x)
    cfg = ClusterConfig(extra_conf=[f"MaxJobCount={max(sizes) + 1000}"])
    rows = []
    work = Path(tempfile.mkdtemp(prefix="se-cycle-jobs-"))
    os.chmod(work, 0o755)
    with cluster_for(args.state_dir, prefix="se-cycle-", start_port=25000, config=cfg) as cluster:
        for n in sizes:
            submit_s = top_up(cluster, n, work)
            for b in args.backends.split(","):
                out = {**measure(str(cluster.state_dir), b, args.cycles), "jobs": n, "submit_s": submit_s}
                rows.append(out)
                if "error" in out:
                    print(f"{b:8s} {n:6d} jobs: failed: {out['error']}", flush=True)
                    continue
                print(f"{b:8s} {out['jobs_pending']:6d} pending elastic jobs (Slurm {out['slurm']}"
                      f"{', pyslurm ' + out['pyslurm'] if out['pyslurm'] else ''}, dry run): cycle median "
                      f"{out['cycle_median_s']:.3f} s (first {out['cycle_first_s']:.3f} s); job read "
                      f"{out['read_median_s']:.3f} s; DP solve {out['solve_median_s']:.3f} s; peak RSS "
                      f"{out['peak_rss_mib']:.0f} MiB", flush=True)
    print("\n| backend | pending jobs | cycle median | first cycle | job read | DP solve | peak RSS |")
    print("|---|---|---|---|---|---|---|")
    for o in rows:
        if "error" not in o:
            print(f"| {o['backend']} | {o['jobs_pending']:,} | {o['cycle_median_s']:.3f} s | {o['cycle_first_s']:.3f} s "
                  f"| {o['read_median_s']:.3f} s | {o['solve_median_s']:.3f} s | {o['peak_rss_mib']:.0f} MiB |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
