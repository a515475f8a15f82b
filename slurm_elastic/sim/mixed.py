"""Issue 13's studies: rigid and elastic jobs in one queue, and two GPU types in two partitions.

**Mixed workload** (:func:`mixed_study`): the Philly-derived synthetic trace (``workloads.synthetic``:
Philly run times and GPU counts, Pollux apps) with a fraction of its jobs elastic (0, 25, 50, 100%);
the others are rigid jobs that ask for the same GPUs and run the same time as the job would at its
requested size. Each mix runs through the daemon's cycle (``dp``), and the same trace runs under plain
Slurm (every job rigid at its requested size: FIFO + backfill in the simulated Slurm, no daemon).
Reported per class: rigid jobs' wait and JCT, elastic jobs' JCT (against the same jobs under plain
Slurm), and the distribution of each rigid job's extra wait over plain Slurm, against the bound of
one cycle plus one rescale (pools.py).

**Heterogeneous** (:func:`hetero_study`): two partitions with two GPU types (Gavel's k80 and v100
tables), every job allowed in both; the allocator with per-type throughputs against a type-blind
one (the same jobs, each pool valued with the job's own model).

``python -m slurm_elastic.sim.mixed`` prints both tables as the markdown of docs/EVALUATION.md's
issue-13 section (``--quick`` for a smaller run).
"""

from __future__ import annotations

import argparse
import re
from dataclasses import replace

import numpy as np

from slurm_elastic.sim.engine import SimConfig, Simulation
from slurm_elastic.sim.workloads import WorkloadJob, profile_model, samples_in, synthetic


def as_rigid(w: WorkloadJob, node_size: int) -> WorkloadJob:
    """The same job as a rigid one: its requested GPUs for the time it runs at its requested size."""
    if w.spec is None:
        return w
    rate = samples_in(w.spec, profile_model(w.spec.profile), 1.0, node_size)
    return WorkloadJob(w.name, w.arrival_s, None, gpus=w.spec.requested_gpus,
                       duration_s=w.total_samples / rate, user=w.user)


def mix(jobs: list[WorkloadJob], fraction: float, seed: int, node_size: int) -> list[WorkloadJob]:
    rng = np.random.Generator(np.random.PCG64(seed + 7))
    n = len(jobs)
    el = set(rng.choice(n, size=int(round(fraction * n)), replace=False).tolist()) if n else set()
    return [w if i in el else as_rigid(w, node_size) for i, w in enumerate(jobs)]


def _pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else float("nan")


def _run(workload, policy_name: str, cfg: SimConfig):
    from slurm_elastic.policies import get_policy

    return Simulation(workload, get_policy(policy_name), cfg).run()


def mixed_study(*, jobs: int = 200, rate_per_h: float = 60.0, nodes: int = 8, gpus_per_node: int = 4,
                seed: int = 0, fractions=(0.0, 0.25, 0.5, 1.0), policy: str = "dp",
                interval_s: float = 60.0) -> dict:
    cfg = SimConfig(nodes=nodes, gpus_per_node=gpus_per_node, interval_s=interval_s)
    base = synthetic(rate_per_h=rate_per_h, seed=seed, jobs=jobs, node_size=gpus_per_node,
                     max_gpus=nodes * gpus_per_node)
    plain = _run([as_rigid(w, gpus_per_node) for w in base], policy, cfg)
    p_out = {o.name: o for o in plain.jobs}
    bound = interval_s + cfg.rescale_cost_s
    rows = []
    for f in fractions:
        wl = mix(base, f, seed, gpus_per_node)
        res = _run(wl, policy, cfg) if f > 0 else plain
        rigid = [o for o in res.jobs if not o.elastic and o.start_s is not None]
        elastic = [o for o in res.jobs if o.elastic and o.end_s is not None]
        wait = [o.start_s - o.arrival_s for o in rigid]
        jct = [o.jct_s for o in rigid if o.jct_s is not None]
        delay = [(o.start_s - o.arrival_s) - (p_out[o.name].start_s - p_out[o.name].arrival_s)
                 for o in rigid if p_out[o.name].start_s is not None]
        e_jct = [o.jct_s for o in elastic]
        e_plain = [p_out[o.name].jct_s for o in elastic if p_out[o.name].jct_s is not None]
        rows.append({
            "elastic_share": f, "jobs": len(res.jobs), "rigid": len(rigid), "elastic": len(elastic),
            "unfinished": sum(1 for o in res.jobs if o.end_s is None), "stopped": res.stopped,
            "rigid_wait_mean_s": float(np.mean(wait)) if wait else float("nan"),
            "rigid_wait_p95_s": _pct(wait, 95),
            "rigid_wait_plain_mean_s": float(np.mean([p_out[o.name].start_s - p_out[o.name].arrival_s
                                                      for o in rigid])) if rigid else float("nan"),
            "rigid_jct_mean_s": float(np.mean(jct)) if jct else float("nan"),
            "rigid_jct_plain_mean_s": float(np.mean([p_out[o.name].jct_s for o in rigid]))
            if rigid else float("nan"),
            "elastic_jct_mean_s": float(np.mean(e_jct)) if e_jct else float("nan"),
            "elastic_jct_plain_mean_s": float(np.mean(e_plain)) if e_plain else float("nan"),
            "delay_p50_s": _pct(delay, 50), "delay_p95_s": _pct(delay, 95),
            "delay_max_s": float(max(delay)) if delay else float("nan"),
            "delay_over_bound": sum(1 for d in delay if d > bound), "delay_n": len(delay),
        })
    return {"bound_s": bound, "config": {"jobs": jobs, "rate_per_h": rate_per_h, "nodes": nodes,
                                         "gpus_per_node": gpus_per_node, "seed": seed, "policy": policy,
                                         "interval_s": interval_s}, "rows": rows}


def mixed_markdown(doc: dict) -> str:
    c = doc["config"]
    out = [f"Trace: {c['jobs']} jobs of the Philly-derived synthetic trace (seed {c['seed']}, "
           f"{c['rate_per_h']} jobs/h) on {c['nodes']} x {c['gpus_per_node']} GPUs, policy `{c['policy']}`, "
           f"cycle {c['interval_s']:.0f} s. Plain Slurm: every job rigid at its requested size, no daemon. "
           f"Hours; 'plain' = the same jobs under plain Slurm.", "",
           "| elastic share | rigid wait (plain) | rigid wait p95 | rigid JCT (plain) | elastic JCT (plain) "
           "| extra rigid wait p50 / p95 / max (s) | over bound |",
           "|---|---|---|---|---|---|---|"]
    h = 3600.0
    for r in doc["rows"]:
        out.append(
            f"| {r['elastic_share']:.0%} | {r['rigid_wait_mean_s'] / h:.2f} ({r['rigid_wait_plain_mean_s'] / h:.2f}) "
            f"| {r['rigid_wait_p95_s'] / h:.2f} | {r['rigid_jct_mean_s'] / h:.2f} ({r['rigid_jct_plain_mean_s'] / h:.2f}) "
            f"| {r['elastic_jct_mean_s'] / h:.2f} ({r['elastic_jct_plain_mean_s'] / h:.2f}) "
            f"| {r['delay_p50_s']:.0f} / {r['delay_p95_s']:.0f} / {r['delay_max_s']:.0f} "
            f"| {r['delay_over_bound']} of {r['delay_n']} |")
    out.append("")
    out.append(f"Bound on a rigid job's extra wait: one cycle + one rescale = {doc['bound_s']:.0f} s.")
    return re.sub(r"\bnan\b", "-", "\n".join(out))  # no rigid (or no elastic) jobs in that row


GAVEL_FAMILIES = {"resnet18": (16, 256), "resnet50": (16, 128), "transformer": (16, 256), "lm": (5, 80)}


def hetero_workload(*, jobs: int, rate_per_h: float, seed: int, node_size: int = 4, base_type: str = "k80"):
    """Gavel-profiled elastic jobs (Philly run times and GPU counts up to 8, profiled on ``base_type``)."""
    from slurm_elastic.profiles.gavel import gavel_model
    from slurm_elastic.sim.workloads import philly_jobs
    from slurm_elastic.spec import ElasticSpec

    rng = np.random.Generator(np.random.PCG64(seed))
    dur, gpus = philly_jobs()
    fams = sorted(GAVEL_FAMILIES)
    out, t = [], 0.0
    for i in range(jobs):
        t += rng.exponential(3600.0 / rate_per_h)
        fam = fams[int(rng.integers(len(fams)))]
        lo, hi = GAVEL_FAMILIES[fam]
        x = int(rng.integers(len(dur)))
        k = int(min(max(1, gpus[x]), node_size))
        spec = ElasticSpec(min_gpus=1, max_gpus=8, min_batch=lo, max_batch=hi * 8, min_local_batch=lo,
                           max_local_batch=hi, batch=lo * k, gpus=k, profile=f"gavel.{base_type}.{fam}")
        d = float(min(max(dur[x], 300.0), 12 * 3600.0))
        total = samples_in(spec, gavel_model(base_type, fam), d, node_size)
        out.append(WorkloadJob(f"{fam}-{i}", round(t, 3), spec, total_samples=total))
    return out


class TypeBlind:
    """The same policy with every pool valued at the job's own model: the allocation a daemon makes
    that does not know GPU types apart (it still keeps jobs inside their pools)."""

    rigid = False
    preemptive = False

    def __init__(self, inner):
        self.inner = inner
        self.name = f"{inner.name}-type-blind"

    def allocate(self, problem):
        jobs = tuple(replace(j, pool_models=(), unscaled_pools=()) for j in problem.jobs)
        return self.inner.allocate(replace(problem, jobs=jobs))


def hetero_study(*, jobs: int = 80, rate_per_h: float = 12.0, nodes_per_type: int = 4, seed: int = 0,
                 interval_s: float = 60.0) -> dict:
    from slurm_elastic.policies import get_policy

    groups = ((nodes_per_type, 4, "k80", "k80"), (nodes_per_type, 4, "v100", "v100"))
    cfg = SimConfig(nodes=2 * nodes_per_type, gpus_per_node=4, interval_s=interval_s, groups=groups)
    wl = hetero_workload(jobs=jobs, rate_per_h=rate_per_h, seed=seed)
    rows = []
    for label, pol in (("per-type throughput", get_policy("dp")), ("type-blind", TypeBlind(get_policy("dp")))):
        res = Simulation(wl, pol, cfg).run()
        jct = [o.jct_s for o in res.jobs if o.jct_s is not None]
        rows.append({"allocator": label, "stopped": res.stopped, "finished": len(jct), "jobs": len(res.jobs),
                     "jct_mean_s": float(np.mean(jct)) if jct else float("nan"), "jct_p95_s": _pct(jct, 95),
                     "makespan_s": res.end_s, "rescales": sum(o.rescales for o in res.jobs)})
    return {"config": {"jobs": jobs, "rate_per_h": rate_per_h, "nodes_per_type": nodes_per_type, "seed": seed,
                       "interval_s": interval_s}, "rows": rows}


def hetero_markdown(doc: dict) -> str:
    c = doc["config"]
    out = [f"{c['jobs']} elastic jobs (Gavel families resnet18/resnet50/transformer/lm, profiled on k80; Philly "
           f"run times; {c['rate_per_h']} jobs/h, seed {c['seed']}) on two partitions: {c['nodes_per_type']} x 4 k80 "
           f"and {c['nodes_per_type']} x 4 v100, every job allowed in both. Simulated throughput: Gavel's table "
           "of the GPU type each job runs on. Hours.", "",
           "| allocator | mean JCT | p95 JCT | makespan | rescales | finished |", "|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        out.append(f"| {r['allocator']} | {r['jct_mean_s'] / 3600:.2f} | {r['jct_p95_s'] / 3600:.2f} "
                   f"| {r['makespan_s'] / 3600:.2f} | {r['rescales']} | {r['finished']} of {r['jobs']} |")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller run (tests, a first look)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    kw = dict(jobs=50, nodes=4, rate_per_h=40.0) if a.quick else {}
    hk = dict(jobs=30, nodes_per_type=2) if a.quick else {}
    doc, het = mixed_study(**kw), hetero_study(**hk)
    if a.json:
        import json

        print(json.dumps({"mixed": doc, "hetero": het}, indent=1))
        return
    print("### Rigid and elastic jobs in one queue\n")
    print(mixed_markdown(doc))
    print("\n### Two GPU types in two partitions\n")
    print(hetero_markdown(het))


if __name__ == "__main__":
    main()
