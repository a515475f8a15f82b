"""Issue 24: a daemon cycle's time and peak RSS with 1,000 ordinary jobs, then 1,000 jobs at the widest
ranges the plugin accepts (printed, not asserted).

Each measurement runs in a fresh child process (its peak RSS is its own): the daemon itself over the
simulated backend (``SimulatedSlurm``), 1,000 elastic jobs from 10 users on 64 nodes of 8 GPUs, per-user
cap 16, policy dp; the cycles are timed one by one (the first one builds every job's table).

    python benchmarks/hostile_ranges.py [--jobs 1000] [--cycles 3] [--policy dp]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import tempfile
import time

from slurm_elastic.spec import MAX_ACCUM_LIMIT as A
from slurm_elastic.spec import MAX_BATCH_LIMIT as B
from slurm_elastic.spec import MAX_GPUS_LIMIT as G

ORDINARY = "elastic:min_gpus=1,max_gpus=8,min_batch=128,max_batch=4096,max_local_batch=512,max_accum=4,profile=cifar10"
WIDEST = [  # every one accepted by parse_spec and the Lua plugin; the shapes vary, so tables are not shared
    f"elastic:min_gpus=1,max_gpus={G},min_batch=1,max_batch={B},max_local_batch={B},max_accum={A}",
    f"elastic:min_gpus=1,max_gpus={G},min_batch=1,max_batch={B},max_local_batch=7,min_local_batch=7,max_accum={A}",
    f"elastic:min_gpus=1,max_gpus={G},min_batch={B - 4096},max_batch={B},max_local_batch=4093,max_accum={A}",
]


def run(kind: str, jobs: int, cycles: int, policy: str, q) -> None:
    from slurm_elastic.backends.simulated import SimulatedSlurm
    from slurm_elastic.daemon.config import config_from_dict
    from slurm_elastic.daemon.loop import Daemon
    from slurm_elastic.profiles import load_profile

    sim = SimulatedSlurm(nodes=64, gpus_per_node=8)
    model = load_profile("cifar10")
    for i in range(jobs):
        comment = ORDINARY if kind == "ordinary" else WIDEST[i % len(WIDEST)] + f",weight={1 + i % 7}"
        sim.submit(name=f"j{i}", gpus_per_node=1, comment=comment, user=f"u{i % 10}", total_samples=1e12, model=model)
    with tempfile.TemporaryDirectory() as state:
        cfg = config_from_dict({"state_dir": state, "metrics_address": "", "cooldown_s": 0, "policy": policy,
                                "max_gpus_per_user": 16})
        d = Daemon(cfg, backend=sim, ack=sim, clock=lambda: sim.now)
        d.open()
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        times = []
        for _ in range(cycles):
            t = time.perf_counter()
            d.cycle()
            times.append(time.perf_counter() - t)
            sim.advance_to(sim.now + 30)
        d.close()
    running = sum(1 for j in sim.active.values() if j.state == "RUNNING")
    q.put({"kind": kind, "jobs": jobs, "policy": policy, "cycle_s": [round(x, 2) for x in times],
           "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
           "rss_before_cycles_mib": round(rss0, 1), "running_after": running})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--policy", default="dp")
    a = ap.parse_args()
    ctx = mp.get_context("spawn")
    for kind in ("ordinary", "widest"):
        q = ctx.Queue()
        p = ctx.Process(target=run, args=(kind, a.jobs, a.cycles, a.policy, q))
        p.start()
        print(json.dumps(q.get()), flush=True)
        p.join()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
