"""``bench allocator --pools P``: the multi-pool optimizer (policies/_multipool.py) on a random instance.

The single-pool instance of ``bench allocator`` (same seed, jobs, GPUs, node size) is split into ``P``
pools of equal node count, GPU types cycling over Gavel's (k80, p100, v100) so that Gavel-profiled jobs
run at each type's table and every other job at its model scaled by the measured per-type prior
(profiles/types.py); each job may use one pool (half of them) or two to four: a running job its own
pool first, the others as moves (a restart there, issue 23); each pending job one or two to four
random pools. Prints the time (median of the runs after a warm-up),
the peak RSS, the objective, the bound and the optimality gap.
"""

from __future__ import annotations

import json
import resource
import statistics
import time
from dataclasses import replace

import click
import numpy as np


def pools_problem(jobs: int, gpus: int, seed: int, node_size: int, pools: int):
    from slurm_elastic.commands.bench import random_problem
    from slurm_elastic.policies.base import Pool
    from slurm_elastic.profiles.gavel import GAVEL_GPUS
    from slurm_elastic.profiles.types import model_on_type

    base = random_problem(jobs, gpus, seed, node_size)
    caps = list(base.node_capacity or ())
    per = -(-len(caps) // pools)
    out_pools, pool_of = [], {}
    for i in range(pools):
        part = tuple(caps[i * per:(i + 1) * per])
        t = GAVEL_GPUS[i % len(GAVEL_GPUS)]
        name = f"part{i}:{t}"
        out_pools.append(Pool(name, t, (f"part{i}",), part, node_size))
        for n, _ in part:
            pool_of[n] = name
    names = [p.name for p in out_pools]
    rng = np.random.default_rng(seed + 1)
    reqs = []
    by_name = {p.name: p for p in out_pools}
    on_type: dict = {}
    for r in base.jobs:
        k = 1 if rng.random() < 0.5 else int(rng.integers(2, min(4, pools) + 1))
        allowed = tuple(names[int(i)] for i in sorted(rng.choice(pools, size=k, replace=False)))
        if r.running_gpus:
            home = pool_of[r.nodes[0]] if r.nodes else names[int(rng.integers(pools))]
            allowed = (home,) + tuple(n for n in allowed if n != home)
        pm = []
        for name in allowed:
            key = (id(r.model), by_name[name].gpu_type)
            if key not in on_type:
                on_type[key] = model_on_type(r.model, by_name[name].gpu_type)
            if on_type[key] is not None and on_type[key] is not r.model:
                pm.append((name, on_type[key]))
        reqs.append(replace(r, pools=allowed, pool=allowed[0] if r.running_gpus else "", pool_models=tuple(pm)))
    return replace(base, jobs=tuple(reqs), pools=tuple(out_pools))


def run(jobs: int, gpus: int, seed: int, node_size: int, pools: int, admission: str, repeats: int) -> dict:
    from slurm_elastic.policies._mckp import warm_up
    from slurm_elastic.policies.dp import DPPolicy

    warm_up()
    t = time.perf_counter()
    prob = pools_problem(jobs, gpus, seed, node_size, pools)
    build_s = time.perf_counter() - t
    pol = DPPolicy(admission=admission)
    times, alloc = [], None
    for i in range(repeats + 1):
        t = time.perf_counter()
        alloc = pol.allocate(prob)
        if i:
            times.append(time.perf_counter() - t)
    gap = alloc.bound - alloc.objective if alloc.bound is not None else 0.0
    return {"jobs": jobs, "gpus": gpus, "pools": pools, "node_size": node_size, "seed": seed,
            "admission": admission, "instance_build_s": build_s, "median_s": statistics.median(times),
            "runs": len(times), "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
            "objective": alloc.objective, "bound": alloc.bound, "gap": gap,
            "relative_gap": gap / abs(alloc.bound) if alloc.bound else 0.0,
            "gpus_used": alloc.gpus_used(), "pool_gpus": [p.total_gpus for p in prob.pools]}


def echo(doc: dict, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(doc))
        return
    click.echo(f"instance: {doc['jobs']} jobs, {doc['gpus']} GPUs in {doc['pools']} pools "
               f"({doc['node_size']}/node), seed {doc['seed']}, admission {doc['admission']}")
    click.echo(f"multi-pool dp: median {doc['median_s']:.3f} s over {doc['runs']} runs, "
               f"peak RSS {doc['peak_rss_mib']:.0f} MiB, {doc['gpus_used']} GPUs allocated")
    click.echo(f"objective {doc['objective']:.4f}, bound {doc['bound']:.4f}, "
               f"gap {doc['gap']:.4f} ({doc['relative_gap']:.3%} of the bound)")
