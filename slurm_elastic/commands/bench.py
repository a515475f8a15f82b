"""``slurm-elastic bench allocator``: time and size the allocator on random measured-profile instances.

Every solver runs in its own Python process on the same seeded instance, so that each one's peak
resident memory (``ru_maxrss``) is its own: ``dp`` (the numba kernel on the knapsack the dp policy
builds), ``dp_policy`` (the whole ``dp`` policy end to end: admission, cached batch tables, kernel,
answer with reasons), ``reference`` (the same knapsack by a plain-Python DP) and ``milp``
(``scipy.optimize.milp``/HiGHS on the same knapsack). Times are medians over ``--repeats`` runs after
one warm-up run; slow baselines run fewer times (the count is reported). The numba compile (or
cache load) time is reported apart from the solve times.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import replace

import click
import numpy as np

SOLVERS = ("dp", "dp_policy", "reference", "milp")
GAVEL_MIX = {"gavel.v100.lm": (5, 80), "gavel.v100.resnet18": (16, 256), "gavel.v100.transformer": (16, 256),
             "gavel.v100.resnet50": (16, 128)}


def random_problem(jobs: int, gpus: int, seed: int, node_size: int = 4, gavel_share: float = 0.2):
    """A seeded random problem: Pollux apps (their ranges) and some non-concave Gavel families.

    About half the jobs are running (at a random allowed count and batch, while they fit), the rest
    pending with random waits below the starvation threshold; weights 1 or 2; GPU ranges from
    {1,2,4} to {4..64} (Gavel: up to 8); accumulation up to 1 or 4.
    """
    from slurm_elastic.policies import AllocationProblem, JobRequest
    from slurm_elastic.profiles import load_profile
    from slurm_elastic.profiles.measured import POLLUX_RANGES
    from slurm_elastic.spec import ElasticSpec

    rng = np.random.default_rng(seed)
    apps = ["cifar10", "bert", "deepspeech2", "imagenet", "yolov3", "ncf"]
    app_p = np.array([0.3, 0.15, 0.15, 0.15, 0.15, 0.1])
    out = []
    running_total = 0
    feasible_cache: dict = {}
    for i in range(jobs):
        if rng.random() < gavel_share:
            prof = list(GAVEL_MIX)[int(rng.integers(len(GAVEL_MIX)))]
            lo, hi = GAVEL_MIX[prof]
            ranges = dict(min_batch=lo, max_batch=hi * 8, min_local_batch=lo, max_local_batch=hi)
            gmax = 8
        else:
            prof = apps[int(rng.choice(len(apps), p=app_p))]
            r = POLLUX_RANGES[prof]
            ranges = {k: r[k] for k in ("min_batch", "max_batch", "min_local_batch", "max_local_batch")}
            gmax = r["max_gpus"]
        min_g = min(gmax, int(rng.choice([1, 1, 1, 2, 4])))
        max_g = max(min_g, min(gmax, int(rng.choice([4, 8, 16, 32, 64]))))
        spec = ElasticSpec(min_gpus=min_g, max_gpus=max_g, max_accum=int(rng.choice([1, 4])), profile=prof,
                           weight=float(rng.choice([1.0, 1.0, 2.0])), **ranges)
        model = load_profile(prof)
        running, rb = 0, None
        if rng.random() < 0.5:
            key = (spec, node_size)
            if key not in feasible_cache:
                counts = [k for k in spec.allowed_gpu_counts(node_size) if k <= (model.max_gpus or k)]
                feasible_cache[key] = [(k, spec.feasible_batches(k)) for k in counts]
            opts = [(k, bs) for k, bs in feasible_cache[key] if bs]
            if opts:
                k, bs = opts[int(rng.integers(len(opts)))]
                if running_total + k <= gpus:
                    running, rb = k, int(bs[int(rng.integers(len(bs)))])
                    running_total += k
        out.append(JobRequest(i, spec, model, running, rb, restart_s=float(rng.choice([30.0, 60.0, 300.0])),
                              wait_s=0.0 if running else float(rng.uniform(0, 1800)),
                              remaining_samples=float(rng.uniform(1e4, 1e8)),
                              attained_gpu_s=float(rng.uniform(0, 1e5)) if running else 0.0))
    # Running jobs on nodes (best fit, as Slurm places them), so the placement step (replay, repair) runs too.
    names = [f"n{i}" for i in range(-(-gpus // node_size))]
    free = {n: node_size for n in names}
    placed = []
    for r in out:
        if r.running_gpus:
            n_nodes, gpn = r.spec.placement(r.running_gpus, node_size)
            cands = sorted((f, n) for n, f in free.items() if f >= gpn)[:n_nodes]
            if len(cands) == n_nodes:
                for _, n in cands:
                    free[n] -= gpn
                r = replace(r, nodes=tuple(n for _, n in cands), gpus_per_node=gpn)
        placed.append(r)
    return AllocationProblem(gpus, node_size, tuple(placed), horizon_s=3600.0,
                             node_capacity=tuple((n, node_size) for n in names))


def _rss_mib() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _time(fn, repeats: int, budget_s: float, warm: bool = True):
    """Up to ``repeats`` timed runs within ``budget_s``; returns (times, result, first run's time).

    With ``warm`` the first run is a warm-up and not counted (numba dispatch, caches); without it
    (the reference DP and HiGHS have nothing to warm) the first run counts too.
    """
    t = time.perf_counter()
    result = fn()
    first = time.perf_counter() - t
    times = [] if warm else [first]
    n = repeats - len(times)
    if first * n > budget_s:
        n = max(0, int(budget_s / max(first, 1e-9)) - len(times))
    for _ in range(n):
        t = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t)
    if not times:
        times = [first]
    return times, result, first


def run_worker(solver, jobs, gpus, seed, node_size, admission, repeats, timeout_s, max_ref_ops) -> dict:
    from slurm_elastic.policies._mckp import dp_stats, mckp, mckp_reference, warm_up
    from slurm_elastic.policies.dp import DPPolicy

    out: dict = {"solver": solver}
    compile_s = warm_up() if solver in ("dp", "dp_policy") else None
    problem = random_problem(jobs, gpus, seed, node_size)
    policy = DPPolicy(admission=admission)
    t = time.perf_counter()
    plan = policy.candidates(problem)  # cold: builds every job's batch table
    out["plan_cold_s"] = time.perf_counter() - t
    args = (plan.offsets, plan.weights, plan.values, plan.capacity)
    out["dp_size"] = dp_stats(*args)
    base = _rss_mib()
    if solver == "dp":
        from slurm_elastic.policies._mckp import _dp

        out["compile_s"] = compile_s
        out["compile_cached"] = bool(sum(_dp.stats.cache_hits.values()))
        times, (obj, _), _ = _time(lambda: mckp(*args), repeats, timeout_s)
    elif solver == "dp_policy":
        out["compile_s"] = compile_s
        times, alloc, _ = _time(lambda: policy.allocate(problem), repeats, timeout_s)
        # the timed policy makes its answer placeable (repaired jobs lower the objective); the equality check
        # is on the same policy without the node map
        obj = DPPolicy(admission=admission, placement=False).allocate(problem).objective
        out["objective_placed"] = alloc.objective
        from slurm_elastic.policies import get_policy

        out["baselines"] = {}
        for name in ("fixed-batch", "static"):
            bt, ba, _ = _time(lambda name=name: get_policy(name).allocate(problem), max(1, repeats // 2), timeout_s)
            out["baselines"][name] = {"objective": ba.objective, "median_s": float(np.median(bt)),
                                      "gpus_used": ba.gpus_used()}
        out["gpus_used"] = alloc.gpus_used()
        from slurm_elastic.policies._placement import placement_report

        out["placement"] = placement_report(plan)
    elif solver == "reference":
        ops = int(np.diff(plan.offsets).sum()) * (plan.capacity + 1) if plan.offsets.size > 1 else 0
        out["ops"] = ops
        if ops > max_ref_ops:
            out.update(status=f"skipped: {ops:.3g} cell updates > --max-ref-ops {max_ref_ops:.3g}", median_s=None,
                       objective=None, peak_rss_mib=None, runs=0)
            return out
        times, (obj, _), _ = _time(lambda: mckp_reference(*args), repeats, timeout_s, warm=False)
    elif solver == "milp":
        try:
            from slurm_elastic.policies._milp import mckp_milp
        except ImportError:  # pragma: no cover - scipy missing
            out.update(status="skipped: scipy not installed", median_s=None, objective=None, peak_rss_mib=None)
            return out
        times, (obj, _), first = _time(lambda: mckp_milp(*args, time_limit=timeout_s), repeats, timeout_s,
                                       warm=False)
        if obj is None:
            out.update(status=f"did not finish in {timeout_s:g}s", median_s=None, objective=None,
                       peak_rss_mib=_peak_mib(), runs=0)
            return out
    else:
        raise click.UsageError(f"unknown solver {solver}")
    out.update(status="ok", median_s=float(np.median(times)), min_s=float(np.min(times)), runs=len(times),
               objective=float(obj), peak_rss_mib=_peak_mib(), rss_before_solve_mib=base)
    return out


def _spawn(solver, opts, timeout_s) -> dict:
    cmd = [sys.executable, "-m", "slurm_elastic.cli", "bench", "worker", solver]
    for k, v in opts.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"solver": solver, "status": f"did not finish in {timeout_s:g}s", "median_s": None,
                "objective": None, "peak_rss_mib": None}
    if p.returncode != 0:
        return {"solver": solver, "status": f"failed: {p.stderr.strip()[-400:]}", "median_s": None,
                "objective": None, "peak_rss_mib": None}
    return json.loads(p.stdout.strip().splitlines()[-1])


def compile_uncached_s() -> float | None:
    """Seconds to compile every kernel from scratch (a fresh process with an empty numba cache dir)."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, NUMBA_CACHE_DIR=d)
        code = "from slurm_elastic.policies._mckp import warm_up; print(warm_up())"
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    try:
        return float(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def _equal(a, b):
    if a is None or b is None:
        return None
    return bool(abs(a - b) <= 1e-6 * max(1.0, abs(a)))


def bench_once(jobs, gpus, seed, node_size, admission, repeats, timeout_s, max_ref_ops, solvers) -> dict:
    opts = dict(jobs=jobs, gpus=gpus, seed=seed, node_size=node_size, admission=admission, repeats=repeats,
                timeout_s=timeout_s, max_ref_ops=max_ref_ops)
    res = {name: _spawn(name, opts, timeout_s * (repeats + 2) + 120) for name in solvers}
    dp = res.get("dp", {})
    doc = {
        "jobs": jobs,
        "gpus": gpus,
        "seed": seed,
        "node_size": node_size,
        "admission": admission,
        "repeats": repeats,
        "dp_size": next((r["dp_size"] for r in res.values() if "dp_size" in r), None),
        "compile_s": dp.get("compile_s"),
        "compile_cached": dp.get("compile_cached"),
        "compile_uncached_s": compile_uncached_s() if "dp" in solvers else None,
        "plan_cold_s": next((r["plan_cold_s"] for r in res.values() if "plan_cold_s" in r), None),
        "solvers": {
            name: {k: r.get(k) for k in ("status", "median_s", "min_s", "runs", "objective", "peak_rss_mib",
                                         "rss_before_solve_mib")}
            for name, r in res.items()
        },
    }
    if "dp_policy" in res and "baselines" in res["dp_policy"]:
        doc["baselines"] = res["dp_policy"]["baselines"]
    if "dp_policy" in res and "placement" in res["dp_policy"]:
        doc["placement"] = res["dp_policy"]["placement"]
    dp_obj = dp.get("objective")
    doc["objectives_equal"] = _equal(dp_obj, res.get("milp", {}).get("objective"))
    doc["reference_equal"] = _equal(dp_obj, res.get("reference", {}).get("objective"))
    doc["policy_equal"] = _equal(dp_obj, res.get("dp_policy", {}).get("objective"))
    dpt = dp.get("median_s")
    doc["ratios"] = {
        f"{name}_over_dp": (res[name]["median_s"] / dpt if dpt and res.get(name, {}).get("median_s") else None)
        for name in ("reference", "milp") if name in res
    }
    return doc


def _fmt_s(x):
    if x is None:
        return "-"
    return f"{x * 1e3:.2f} ms" if x < 1 else f"{x:.3f} s"


def _print_human(doc):
    d = doc["dp_size"] or {}
    click.echo(f"instance: {doc['jobs']} jobs, {doc['gpus']} GPUs ({doc['node_size']}/node), seed {doc['seed']}, "
               f"admission {doc['admission']}")
    click.echo(f"knapsack: {d.get('jobs')} jobs, {d.get('choices')} choices, capacity {d.get('capacity')}, "
               f"table {d.get('table_cells')} cells ({(d.get('table_bytes') or 0) / 2**20:.1f} MiB)")
    click.echo(f"numba kernels: load from cache {_fmt_s(doc['compile_s'])} (cached: {doc['compile_cached']}), "
               f"compile from scratch {_fmt_s(doc['compile_uncached_s'])}; "
               f"cold batch tables: {_fmt_s(doc['plan_cold_s'])}")
    click.echo(f"{'solver':<10} {'median':>12} {'runs':>5} {'peak RSS':>10} {'objective':>16}  status")
    for name, r in doc["solvers"].items():
        peak = f"{r['peak_rss_mib']:.0f} MiB" if r.get("peak_rss_mib") else "-"
        obj = f"{r['objective']:.6f}" if r.get("objective") is not None else "-"
        click.echo(f"{name:<10} {_fmt_s(r.get('median_s')):>12} {r.get('runs') or 0:>5} {peak:>10} {obj:>16}  "
                   f"{r.get('status')}")
    for name, b in (doc.get("baselines") or {}).items():
        click.echo(f"baseline {name}: objective {b['objective']:.4f} in {_fmt_s(b['median_s'])}")
    pr = doc.get("placement")
    if pr:
        click.echo(f"placement (dp_policy): {pr['unplaceable_after_solve']} jobs do not fit the nodes after the "
                   f"pool solve, {pr['unplaceable_after_resolve']} after the capped re-solve, {pr['repaired']} "
                   f"lowered by the repair, {pr['unplaceable_after']} left; "
                   f"{100 * pr['value_kept']:.3f}% of the pool optimum's value kept")
    click.echo(f"objectives equal: milp {doc['objectives_equal']}, reference {doc['reference_equal']}, "
               f"policy {doc['policy_equal']}")
    for k, v in doc["ratios"].items():
        if v is not None:
            click.echo(f"{k}: {v:.1f}x")


@click.group("bench")
def bench():
    """Benchmarks (allocator speed and memory; profile fit error)."""


_COMMON = [
    click.option("--seed", type=int, default=0, show_default=True),
    click.option("--node-size", type=click.IntRange(1), default=4, show_default=True),
    click.option("--admission", type=click.Choice(["joint", "priority"]), default="joint", show_default=True,
                 help="joint: every pending job competes in the knapsack (the full jobs x GPUs problem); "
                      "priority: the dp policy's default, pending minimums admitted first."),
    click.option("--repeats", type=click.IntRange(1), default=7, show_default=True),
    click.option("--timeout-s", type=float, default=60.0, show_default=True,
                 help="Time limit per baseline run (HiGHS time_limit; reference/MILP repeat budget)."),
    click.option("--max-ref-ops", type=float, default=3e7, show_default=True,
                 help="Skip the plain-Python DP above this many (choice x capacity) cell updates."),
]


def _common(f):
    for opt in reversed(_COMMON):
        f = opt(f)
    return f


@bench.command("allocator")
@click.option("--jobs", type=click.IntRange(0), default=1000, show_default=True)
@click.option("--gpus", type=click.IntRange(0), default=1024, show_default=True)
@_common
@click.option("--solvers", default=",".join(SOLVERS), show_default=True, help="Comma-separated subset.")
@click.option("--grid", is_flag=True, help="Also print a table of dp time against jobs and GPUs.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--pools", type=click.IntRange(1), default=1, show_default=True,
              help="Split the instance into this many pools: time the multi-pool optimizer (bench_pools.py).")
def allocator(jobs, gpus, seed, node_size, admission, repeats, timeout_s, max_ref_ops, solvers, grid, as_json, pools):
    """Time the allocator's solvers on one random instance from the measured profiles."""
    if pools > 1:
        from slurm_elastic.commands import bench_pools

        bench_pools.echo(bench_pools.run(jobs, gpus, seed, node_size, pools, admission, repeats), as_json)
        return
    names = [s.strip() for s in solvers.split(",") if s.strip()]
    bad = [s for s in names if s not in SOLVERS]
    if bad:
        raise click.UsageError(f"unknown solvers {bad} (known: {', '.join(SOLVERS)})")
    doc = bench_once(jobs, gpus, seed, node_size, admission, repeats, timeout_s, max_ref_ops, names)
    if grid:
        rows = []
        for j in (100, 1000, 10000):
            for g in (256, 1024, 4096, 16384):
                d = bench_once(j, g, seed, node_size, admission, max(3, repeats // 2), timeout_s, max_ref_ops,
                               ["dp", "dp_policy"])
                rows.append({"jobs": j, "gpus": g, "dp_size": d["dp_size"],
                             "dp_median_s": d["solvers"]["dp"]["median_s"],
                             "dp_policy_median_s": d["solvers"]["dp_policy"]["median_s"],
                             "dp_peak_rss_mib": d["solvers"]["dp"]["peak_rss_mib"]})
        doc["grid"] = rows
    if as_json:
        click.echo(json.dumps(doc))
        return
    _print_human(doc)
    if grid:
        click.echo(f"\n{'jobs':>6} {'gpus':>6} {'dp jobs':>8} {'capacity':>9} {'cells':>12} {'dp kernel':>12} "
                   f"{'dp policy':>12} {'peak RSS':>9}")
        for r in doc["grid"]:
            d = r["dp_size"]
            click.echo(f"{r['jobs']:>6} {r['gpus']:>6} {d['jobs']:>8} {d['capacity']:>9} {d['table_cells']:>12} "
                       f"{_fmt_s(r['dp_median_s']):>12} {_fmt_s(r['dp_policy_median_s']):>12} "
                       f"{r['dp_peak_rss_mib']:>6.0f} MiB")


@bench.command("worker", hidden=True)
@click.argument("solver", type=click.Choice(SOLVERS))
@click.option("--jobs", type=int, required=True)
@click.option("--gpus", type=int, required=True)
@_common
def worker(solver, jobs, gpus, seed, node_size, admission, repeats, timeout_s, max_ref_ops):
    """(internal) Run one solver in this process and print its figures as JSON."""
    click.echo(json.dumps(run_worker(solver, jobs, gpus, seed, node_size, admission, repeats, timeout_s,
                                     max_ref_ops)))


@bench.command("profiles")
@click.option("--points", type=click.IntRange(1), default=8, show_default=True,
              help="How many observed points the online fit gets (drawn at random from the table).")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def profiles(points, seed, as_json):
    """Fit error of the parametric model against the Pollux tables (relative error of samples/s)."""
    from slurm_elastic.profiles.measured import POLLUX_APPS, pollux_observations
    from slurm_elastic.profiles.parametric import ParametricModel, fit_error

    rng = np.random.default_rng(seed)
    doc = {}
    for app in POLLUX_APPS:
        rows = pollux_observations(app)
        uniform = [r for r in rows if r.gpus % r.nodes == 0 and r.gpus // r.nodes <= 4]
        full = ParametricModel.fit(rows)
        few_rows = [rows[i] for i in rng.choice(len(rows), min(points, len(rows)), replace=False)]
        few = ParametricModel.fit(few_rows)
        doc[app] = {"rows": len(rows), "full_fit": fit_error(full, rows), "full_fit_uniform": fit_error(full, uniform),
                    f"fit_on_{points}_points": fit_error(few, rows), "coeffs": full.coeffs.tolist()}
    if as_json:
        click.echo(json.dumps(doc))
        return
    click.echo(f"{'app':<12} {'rows':>5}  {'full fit: median / p90 / max':>30}  {'uniform placements':>20}  "
               f"{f'fit on {points} points':>22}")
    for app, d in doc.items():
        f, u, p = d["full_fit"], d["full_fit_uniform"], d[f"fit_on_{points}_points"]
        click.echo(f"{app:<12} {d['rows']:>5}  {f['median']:>9.1%} / {f['p90']:>6.1%} / {f['max']:>6.1%}  "
                   f"{u['median']:>9.1%} / {u['p90']:>6.1%}  {p['median']:>9.1%} / {p['p90']:>6.1%}")
