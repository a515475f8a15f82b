"""Shared machinery of the elastic policies: admission, the value of each choice, the answer.

Admission (the first two objectives, lexicographic, before any optimisation):

1. Running jobs keep their minimum: in priority order each running job reserves the smallest GPU
   count its table allows. If the capacity no longer holds every running minimum (nodes drained),
   the lowest-priority running jobs that do not fit are stopped. With ``allow_preemption`` this
   step is skipped and running jobs are admitted with the pending ones in step 2, by priority.
2. Pending jobs are admitted in priority order while their minimum fits in what the minimums of
   higher-priority (and all running) jobs leave. A job whose minimum does not fit is skipped and a
   later, smaller job may pass it (backfill) -- unless the blocked job has waited ``starvation_s``
   or longer: then admission stops at it, no later job starts, and the GPUs it needs accumulate as
   running jobs finish (running jobs only ever hold their minimum against it, so the next cycle
   with enough free minimum capacity admits it). This bounds the wait of a large job by the
   starvation threshold plus the time for enough GPUs to drain.
   With ``admission="joint"`` pending jobs are not admitted up front: each may get 0 GPUs or any
   allowed count, and the optimiser (step 3) decides; starving pending jobs (``wait_s >=
   starvation_s``) are still admitted first, as in 2.

3. What remains is maximised: the value of job j on k GPUs is ``weight_j * T_j(k, b*(k)) / T_j(ref)``
   with ``ref`` its smallest allowed count (so every admitted job is worth about its weight at its
   minimum); for a running job, any count other than its current one is multiplied by
   ``1 - restart_s / horizon_s`` (the horizon fraction lost to checkpoint + requeue + restart).
   Keeping the current count (and batch) costs nothing; re-batching on the same count pays the
   restart too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slurm_elastic.policies._tables import JobTable, current_samples_per_s, job_table, pct, restart_fraction
from slurm_elastic.policies.base import Allocation, AllocationProblem, JobAllocation

ADMITTED, NOT_ADMITTED, OPTIONAL = 1, 0, 2
_ZERO_I = np.zeros(1, np.int64)
_ZERO_F = np.zeros(1, np.float64)


@dataclass
class Plan:
    """Everything a policy decided before optimising, and the choice arrays it optimises over."""

    problem: AllocationProblem
    tables: list[JobTable]  # the tables the policy chooses from (flexible or fixed batch)
    refs: np.ndarray  # T_j(ref) per job (from the flexible table; 0 when the job cannot run)
    status: list[int]
    reasons: dict[int, str]  # reasons for jobs that get nothing
    capacity: int  # GPUs left for step 3
    dp_jobs: np.ndarray  # job indices in the optimisation, in order
    offsets: np.ndarray
    weights: np.ndarray
    values: np.ndarray
    tindex: np.ndarray  # per flat choice: the table row, or -1 for "0 GPUs"
    keep: np.ndarray  # per flat choice: keeps the running count and batch (no restart)
    current: dict[int, float | None]  # current samples/s of running jobs


def _tables(problem, fixed_batch: bool, efficiency=None, efficiency_key=None):
    flex, chosen = [], []
    for req in problem.jobs:
        f = job_table(req.model, req.spec, problem.node_size, problem.total_gpus, None, efficiency, efficiency_key)
        flex.append(f)
        if fixed_batch:
            chosen.append(job_table(req.model, req.spec, problem.node_size, problem.total_gpus,
                                    req.spec.requested_batch, efficiency, efficiency_key))
        else:
            chosen.append(f)
    return flex, chosen


def make_plan(
    problem: AllocationProblem,
    *,
    fixed_batch: bool = False,
    admission: str = "priority",
    starvation_s: float = 3600.0,
    efficiency=None,
    efficiency_key=None,
) -> Plan:
    if admission not in ("priority", "joint"):
        raise ValueError(f"admission must be 'priority' or 'joint', not {admission!r}")
    jobs = problem.jobs
    flex, tabs = _tables(problem, fixed_batch, efficiency, efficiency_key)
    refs = np.array([float(f.value[0]) if len(f) else 0.0 for f in flex])
    n = len(jobs)
    status = [NOT_ADMITTED] * n
    reasons: dict[int, str] = {}
    free = int(problem.total_gpus)
    what = "the requested batch" if fixed_batch else "a batch in range"

    def unrunnable(j):
        return (len(tabs[j]) == 0) or refs[j] <= 0

    if not problem.allow_preemption:
        for j, req in enumerate(jobs):
            if not req.is_running:
                continue
            if unrunnable(j):
                reasons[j] = f"stopped: no allowed GPU count <= {problem.total_gpus} runs {what}"
                continue
            need = int(tabs[j].counts[0])
            if need <= free:
                status[j] = ADMITTED
                free -= need
            else:
                reasons[j] = f"stopped: running minimums exceed the {problem.total_gpus} GPUs available"
    holder = None
    for j, req in enumerate(jobs):
        if status[j] == ADMITTED or (req.is_running and not problem.allow_preemption):
            continue
        verb = "preempted" if req.is_running else "pending"
        if unrunnable(j):
            reasons[j] = f"{verb}: no allowed GPU count <= {problem.total_gpus} runs {what}"
            continue
        if holder is not None:
            reasons[j] = f"{verb}: held for starving job {jobs[holder].job_id} (waited {jobs[holder].wait_s:.0f}s)"
            continue
        starving = req.wait_s >= starvation_s
        if admission == "joint" and not starving and not req.is_running:
            status[j] = OPTIONAL
            continue
        need = int(tabs[j].counts[0])
        if need <= free:
            status[j] = ADMITTED
            free -= need
        else:
            reasons[j] = f"{verb}: needs {need} GPUs, {free} left after higher-priority minimums"
            if starving:
                holder = j
    if holder is not None:  # a starving job holds the line: joint-mode jobs behind it wait too
        for j in range(holder + 1, n):
            if status[j] == OPTIONAL:
                status[j] = NOT_ADMITTED
                reasons[j] = (f"pending: held for starving job {jobs[holder].job_id} "
                              f"(waited {jobs[holder].wait_s:.0f}s)")

    dp_jobs = np.array([j for j in range(n) if status[j] != NOT_ADMITTED], dtype=np.int64)
    pieces_c, pieces_v, pieces_t = [], [], []
    lens = np.empty(dp_jobs.size, np.int64)
    base = np.zeros(dp_jobs.size, np.int64)
    for p, j in enumerate(dp_jobs):
        t = tabs[j]
        if status[j] == OPTIONAL:
            pieces_c += [_ZERO_I, t.counts]
            pieces_v += [_ZERO_F, t.value]
            pieces_t += [np.array([-1], np.int64), np.arange(len(t))]
            lens[p] = len(t) + 1
        else:
            pieces_c.append(t.counts)
            pieces_v.append(t.value)
            pieces_t.append(np.arange(len(t)))
            lens[p] = len(t)
            base[p] = t.counts[0]
    if dp_jobs.size:
        counts = np.concatenate(pieces_c)
        raw = np.concatenate(pieces_v)
        tindex = np.concatenate(pieces_t)
    else:
        counts = raw = tindex = np.empty(0, np.int64)
    offsets = np.zeros(dp_jobs.size + 1, np.int64)
    np.cumsum(lens, out=offsets[1:])
    wt = np.array([jobs[j].weight for j in dp_jobs], dtype=np.float64)
    running = np.array([jobs[j].running_gpus for j in dp_jobs], dtype=np.int64)
    factor = np.array(
        [1.0 - restart_fraction(jobs[j], problem) if jobs[j].is_running else 1.0 for j in dp_jobs], dtype=np.float64
    )
    rep = lambda x: np.repeat(x, lens)  # noqa: E731
    r_rep = rep(running)
    pen = np.where((r_rep > 0) & (counts != r_rep), rep(factor), 1.0)
    ref_rep = rep(refs[dp_jobs]) if dp_jobs.size else np.empty(0)
    values = rep(wt) * (raw / np.where(ref_rep > 0, ref_rep, 1.0)) * pen
    weights = counts - rep(base)
    keep = np.zeros(values.size, dtype=bool)
    current: dict[int, float | None] = {}
    for p, j in enumerate(dp_jobs):
        req = jobs[j]
        if not req.is_running:
            continue
        cur = current_samples_per_s(req, problem.node_size)
        current[int(j)] = cur
        ti = tabs[j].index(req.running_gpus)
        if ti < 0:
            continue
        flat = int(offsets[p] + ti + (1 if status[j] == OPTIONAL else 0))
        if req.running_batch is None or req.running_batch == int(tabs[j].batch[ti]):
            keep[flat] = True  # its best batch is what it runs: keeping costs nothing
            continue
        values[flat] *= factor[p]  # re-batching on the same count is a restart too
        if req.spec.split_batch(req.running_gpus, req.running_batch) is None or cur is None:
            continue  # cannot keep what it runs now (out of range): any start is a restart
        cur_v = cur
        if efficiency is not None:
            cur_v = cur * float(efficiency(np.array([req.running_batch], dtype=np.float64))[0])
        keep_value = req.weight * cur_v / refs[j]
        if keep_value >= values[flat]:
            values[flat] = keep_value
            keep[flat] = True
    for j, req in enumerate(jobs):
        if req.is_running and int(j) not in current:
            current[j] = current_samples_per_s(req, problem.node_size)
    return Plan(problem, tabs, refs, status, reasons, free, dp_jobs, offsets, weights, values, tindex, keep, current)


def build_allocation(plan: Plan, chosen_flat: np.ndarray, policy: str, solve_s: float) -> Allocation:
    """Turn one chosen flat choice per optimised job into the per-job answer, with reasons."""
    problem = plan.problem
    jobs = problem.jobs
    out: dict = {}
    objective = float(plan.values[chosen_flat].sum()) if chosen_flat.size else 0.0
    used = int(plan.weights[chosen_flat].sum()) if chosen_flat.size else 0
    spare = plan.capacity - used
    picked = {int(j): int(c) for j, c in zip(plan.dp_jobs, chosen_flat, strict=True)}
    for j, req in enumerate(jobs):
        c = picked.get(j)
        if c is None or plan.tindex[c] < 0:
            reason = plan.reasons.get(j)
            if reason is None:
                reason = ("preempted: its GPUs are worth more elsewhere" if req.is_running
                          else "pending: not started, its GPUs are worth more to running jobs")
            out[req.job_id] = JobAllocation(req.job_id, 0, reason=reason)
            continue
        t = plan.tables[j]
        ti = int(plan.tindex[c])
        k = int(t.counts[ti])
        keep = bool(plan.keep[c])
        batch, local, accum, sps = int(t.batch[ti]), int(t.local[ti]), int(t.accum[ti]), float(t.sps[ti])
        if keep and req.running_batch is not None:
            split = req.spec.split_batch(k, req.running_batch)
            if split is not None:
                batch, (local, accum) = req.running_batch, split
                sps = plan.current.get(j) or sps
        cur = plan.current.get(j)
        r = req.running_gpus
        if not req.is_running:
            reason = f"admitted: {k} GPU{'s' if k != 1 else ''}" + (f" (minimum {int(t.counts[0])})" if k > t.counts[0] else "")
        elif keep:
            reason = "kept"
            if _better_elsewhere(plan, j, c, spare):
                reason = "kept: gain below restart cost"
        elif k > r:
            reason = f"grown {r}->{k}: {pct(sps, cur)}".rstrip(": ")
        elif k < r:
            reason = f"shrunk {r}->{k}: {pct(sps, cur)}".rstrip(": ") + "; GPUs to higher-value jobs"
        else:
            reason = f"rebatched {req.running_batch}->{batch}: {pct(sps, cur)}".rstrip(": ")
        out[req.job_id] = JobAllocation(
            req.job_id, k, int(t.nodes[ti]), batch, local, accum, sps, reason
        )
    return Allocation(out, objective, solve_s, policy)


def _better_elsewhere(plan: Plan, j: int, c: int, spare: int) -> bool:
    """Would a reachable other count of this kept job be better but for the restart cost?"""
    p = int(np.searchsorted(plan.dp_jobs, j))
    lo, hi = int(plan.offsets[p]), int(plan.offsets[p + 1])
    req = plan.problem.jobs[j]
    f = 1.0 - restart_fraction(req, plan.problem)
    if f <= 0:
        return True
    w = plan.weights[lo:hi]
    v = plan.values[lo:hi].copy()
    others = (np.arange(lo, hi) != c) & (w <= plan.weights[c] + spare) & (plan.tindex[lo:hi] >= 0)
    return bool((others & (v / f > plan.values[c] + 1e-12)).any())
