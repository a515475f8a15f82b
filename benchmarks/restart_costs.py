"""The one-type simulator under restart costs other than the flat 30 s (issue 23 item 5).

    python benchmarks/restart_costs.py [--policy dp] [--costs 10,30,250,600,model] [--workloads 1,2,3,4,5]
        [--noprogress] [--jobs 2] [--json OUT]

Runs the Pollux workloads (``../shared/data/pollux/workloads``) in the goodput setting of
``sim.evaluate`` with every rescale costing the given seconds, or ``model``: the Sia artifact's
per-model costs (cifar10 50, deepspeech2 25, bert 120, yolov3 80, imagenet 250, ncf 15 s). Prints per
workload: average and p95 JCT, the longest job, rescales per job, finish-time fairness max, cycles with
an idle GPU while a fitting job waited, and jobs held at a size their measured gain says is wrong for
more than the bound (``sim.metrics``). Figures only: no assert.
"""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIA_RESTART_S = {"cifar10": 50.0, "deepspeech2": 25.0, "bert": 120.0, "yolov3": 80.0, "imagenet": 250.0,
                 "ncf": 15.0}


def run(task):
    from slurm_elastic.sim.engine import SimConfig, Simulation
    from slurm_elastic.sim.evaluate import _alone_s, _policy
    from slurm_elastic.sim.metrics import summarize
    from slurm_elastic.sim.workloads import read_pollux

    policy, cost, n, progress, folder = task
    jobs = read_pollux(REPO.parent / "shared" / "data" / "pollux" / folder / f"workload-{n}.csv")
    if cost == "model":
        jobs = [replace(w, spec=replace(w.spec, restart_s=SIA_RESTART_S[w.spec.profile])) for w in jobs]
        flat = 30.0
    else:
        flat = float(cost)
    cfg = SimConfig(work_model="goodput", checkpoint_s=0.0, restart_s=flat, report_progress=progress)
    res = Simulation(jobs, _policy(policy), cfg).run()
    m = summarize(res)
    alone = {w.name: _alone_s(w, cfg) for w in jobs}
    rho = [o.jct_s / alone[o.name] for o in res.jobs if o.jct_s is not None]
    m["ftf_max"] = max(rho) if rho else None
    m["longest_jct_s"] = max((o.jct_s for o in res.jobs if o.jct_s is not None), default=None)
    return task, m


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policy", action="append", default=None)
    ap.add_argument("--costs", default="10,30,250,600,model")
    ap.add_argument("--workloads", default="1,2,3,4,5")
    ap.add_argument("--folder", default="workloads")
    ap.add_argument("--noprogress", action="store_true")
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    tasks = [(p, c, int(n), not a.noprogress, a.folder) for p in (a.policy or ["dp"])
             for c in a.costs.split(",") for n in a.workloads.split(",")]
    out = []
    print("policy | cost | workload | avg JCT h | p95 h | longest h | rescales/job | ftf max | idle-wait cycles "
          "| held wrong | cycles", flush=True)
    with ProcessPoolExecutor(a.jobs) as ex:
        for (p, c, n, prog, _), m in ex.map(run, tasks):
            out.append({"policy": p, "cost": c, "workload": n, "progress": prog, **m})
            print(f"{p} | {c} | {n} | {m['avg_jct_s'] / 3600:.3f} | {m['p95_jct_s'] / 3600:.2f} | "
                  f"{m['longest_jct_s'] / 3600:.2f} | {m['rescales_per_job']:.2f} | {m['ftf_max']:.1f} | "
                  f"{m.get('idle_wait_cycles', '-')} | {m.get('held_wrong_jobs', '-')} | {m['cycles']}", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
