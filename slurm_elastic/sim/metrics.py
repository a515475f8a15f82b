"""Metrics of one simulation run (pure functions of a :class:`SimResult`).

- ``jobs_total``: jobs in the workload; ``jobs_completed``: those finished by the end of the run
  (the horizon, when one is set).
- ``avg_jct_s``, ``median_jct_s``, ``p95_jct_s``: job completion time (finish - arrival) over the
  completed jobs (``null`` when none completed). Percentiles by linear interpolation (numpy's default).
- ``avg_queue_s``: first start - arrival over the jobs that started; jobs never started by the end
  count with (end - arrival), so an overloaded run is not flattered by leaving jobs out.
- ``gpu_utilization`` (0-1): GPU-seconds allocated to jobs / (cluster GPUs x span), span = first
  arrival to the end of the run (last completion, or the horizon).
- ``rescales``: resizes carried out (requeues); ``rescales_per_job`` over elastic jobs;
  ``gpu_s_lost_to_rescales``: GPU-seconds held while checkpointing or restarting after a resize.
- ``makespan_s``: first arrival to last completion (to the end of the run if jobs remain).
- ``placed_over_planned``: GPU-seconds the planner carried out / GPU-seconds the policy allocated.
- Stability: ``shrunk_soon_after_start`` counts jobs whose first size change is a shrink within
  ``soon_s`` (default 2 scheduling intervals) of their start (an admission at a size the next cycle
  undoes); ``reversals`` counts size changes opposite to the job's previous change (grow then shrink or
  shrink then grow) within ``soon_s`` x 10 of it (oscillation).
- ``idle_wait_cycles``, ``held_wrong_jobs``, ``held_wrong_max_s``: :mod:`slurm_elastic.sim.checks`
  (cycles with a GPU idle while a pending job that fits waited; jobs held at a size their measured gain
  says is wrong for longer than its bound).
"""

from __future__ import annotations

import numpy as np

from slurm_elastic.sim.engine import SimResult


def _stability(res: SimResult, soon_s: float) -> tuple[int, int]:
    shrunk_soon = reversals = 0
    for j in res.jobs:
        sizes = [(t, k) for t, k, _ in j.sizes]
        if len(sizes) < 2:
            continue
        t0, k0 = sizes[0]
        nxt = next(((t, k) for t, k in sizes[1:] if k != k0), None)
        if nxt is not None and nxt[1] < k0 and nxt[0] - t0 <= soon_s:
            shrunk_soon += 1
        last_dir, last_t, prev = 0, None, k0
        for t, k in sizes[1:]:
            if k == prev:
                continue
            d = 1 if k > prev else -1
            if last_dir and d != last_dir and t - last_t <= 10 * soon_s:
                reversals += 1
            last_dir, last_t, prev = d, t, k
    return shrunk_soon, reversals


def summarize(res: SimResult) -> dict:
    jobs = res.jobs
    n = len(jobs)
    done = [j for j in jobs if j.end_s is not None]
    jct = np.array([j.jct_s for j in done], dtype=np.float64)
    first = min((j.arrival_s for j in jobs), default=0.0)
    end = res.end_s
    queue = [((j.start_s if j.start_s is not None else end) - j.arrival_s) for j in jobs if j.arrival_s <= end]
    span = max(0.0, end - first)
    total_gpus = res.config.total_gpus
    elastic = [j for j in jobs if j.elastic]
    rescales = sum(j.rescales for j in jobs)
    shrunk_soon, reversals = _stability(res, 2 * res.config.interval_s)
    return {
        "policy": res.policy,
        "jobs_total": n,
        "jobs_completed": len(done),
        "avg_jct_s": float(jct.mean()) if len(jct) else None,
        "median_jct_s": float(np.median(jct)) if len(jct) else None,
        "p95_jct_s": float(np.percentile(jct, 95)) if len(jct) else None,
        "avg_queue_s": float(np.mean(queue)) if queue else None,
        "gpu_utilization": float(res.busy_gpu_s / (total_gpus * span)) if span > 0 and total_gpus else 0.0,
        "rescales": rescales,
        "rescales_per_job": rescales / len(elastic) if elastic else 0.0,
        "gpu_s_lost_to_rescales": float(sum(j.lost_gpu_s for j in jobs)),
        "makespan_s": float(span),
        "cluster_gpus": total_gpus,
        "peak_gpus_in_use": res.peak_gpus_in_use,
        "cycles": res.cycles,
        "policy_solve_s": res.solve_s,
        "sim_wall_s": res.wall_s,
        "stopped": res.stopped,
        "shrunk_soon_after_start": shrunk_soon,
        "reversals": reversals,
        "placed_over_planned": (res.placed_gpu_s / res.planned_gpu_s) if res.planned_gpu_s > 0 else 1.0,
        **res.checks,
    }
