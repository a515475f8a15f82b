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
   starvation_s``) are still admitted first, as in 2. ``admission="auto"``: as ``priority`` while
   every pending job's minimum fits, as ``joint`` when they do not.

3. What remains is maximised: the value of job j on k GPUs is ``scale_j * T_j(k, b*(k)) / T_j(ref)``
   with ``ref`` its smallest allowed count, ``scale_j`` its weight (times its SRPT rank under the
   ``completion`` objective, :func:`_scale`); for a running job, any count other than its current
   one is multiplied by ``1 - share``, the share of the new size's expected life a restart costs
   (:func:`_restart_share`: restart_s / min(horizon, remaining time), times a margin, over the time
   it has held its size with ``tenure``). With ``round_trip`` a grow also pays that share of the
   job's value at its minimum: the restart back when its GPUs are reclaimed (see make_candidates).
   Keeping the current count (and batch) costs nothing; re-batching on the same count pays the
   restart too.
"""

from __future__ import annotations

import gc
import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from slurm_elastic.policies._tables import JobTable, current_samples_per_s, job_table, pct, restart_s
from slurm_elastic.policies.base import Allocation, AllocationProblem, JobAllocation

ADMITTED, NOT_ADMITTED, OPTIONAL = 1, 0, 2
_ZERO_I = np.zeros(1, np.int64)
_ZERO_F = np.zeros(1, np.float64)


@dataclass
class Candidates:
    """Admission (what a policy decided before optimising) and the choice arrays it optimises over.

    Not to be confused with :class:`slurm_elastic.planner.Plan` (the Slurm actions of a cycle)."""

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
    cols: np.ndarray  # (7, n) per flat choice: counts, nodes, batch, local, accum, sps, value (0 = no GPUs)
    keep: np.ndarray  # per flat choice: keeps the running count and batch (no restart)
    current: dict[int, float | None]  # current samples/s of running jobs
    factor: np.ndarray  # per optimised job: the value kept by a rescale (1 - restart share)
    gross: np.ndarray  # per flat choice: its value before any restart charge
    goodput: dict[int, float | None] = field(default_factory=dict)  # current goodput, where values are goodput
    # the rescale rule's parameters (realloc, margin, tenure, backoff, thrash cap): what reasons quote
    rule: tuple = ("share", 1.0, False, 0.0, 0.5)
    # ``completion``: job index -> how many optimised jobs rank ahead of it by work left (shorter first),
    # among ``ranked_among`` jobs (all optimised here; a pool's sub-plan in policies/_multipool keeps the
    # pool's ranks, among jobs some of which it assigned to other pools)
    ahead: dict[int, int] = field(default_factory=dict)
    ranked_among: int = 0
    # what a waiting job's reason adds about how jobs were valued (DPPolicy's p-norm fallback says why)
    valuation: str = ""
    # per optimised job: the value kept by a grow or a move (``factor`` with the life capped at the
    # grow's expected hold, ``grow_hold``); None: as ``factor``
    factor_up: np.ndarray | None = None
    hold: dict[int, float] = field(default_factory=dict)  # job index -> a grow's expected hold, s (where finite)


_ZERO7 = np.zeros((7, 1))


def _tables(problem, fixed_batch: bool, effs):
    flex, chosen = [], []
    ns, cap = problem.node_size, problem.total_gpus
    for req, (eff, key) in zip(problem.jobs, effs, strict=True):
        f = job_table(req.model, req.spec, ns, cap, None, eff, key)
        flex.append(f)
        if fixed_batch:  # a running job's batch is whatever it runs; a pending job's is its request
            fb = req.running_batch if req.running_gpus > 0 and req.running_batch else req.spec.requested_batch
            chosen.append(job_table(req.model, req.spec, ns, cap, fb, eff, key))
    return flex, (chosen if fixed_batch else flex)


def make_candidates(
    problem: AllocationProblem,
    *,
    fixed_batch: bool = False,
    admission: str = "priority",
    starvation_s: float = 3600.0,
    efficiency=None,
    objective: str = "speedup",
    p: float = -1.0,
    fair_ref: bool = False,
    restart_margin: float = 1.0,
    tenure: bool = False,
    backoff: float = 0.0,
    round_trip: bool = False,
    realloc: str = "share",
    thrash_cap: float = 0.5,
    rank_cap: float = float("inf"),
    age_credit: float = 0.0,
    credit_cap: float = float("inf"),
    inferred: dict | None = None,
    grow_hold=None,
    regrow: bool = False,
) -> Candidates:
    """Admission and the knapsack's arrays. ``efficiency``: ``req -> (fn, key) | (None, None)``, a
    per-job statistical-efficiency function (goodput), or None for throughput. ``objective``: how a
    choice is valued (see :func:`choice_values`). ``fair_ref``: speedups relative to the job's fair share
    (its largest allowed count <= GPUs / jobs, as Pollux defines them) instead of its minimum.
    ``restart_margin``, ``tenure``: how a rescale must pay for itself (:func:`_restart_share`).
    ``realloc="life"``: the rule that scales with the gain (:func:`_rescale_factor`): the restart against
    the job's expected remaining life, times an anti-thrash charge of at most ``thrash_cap``, so any gain
    above ``1 / (1 - thrash_cap)`` that the restart pays back over the job's life is made.
    ``age_credit``: under ``completion``, a job is ranked as if it had ``age_credit`` seconds less work left
    per second it has been in the system (its age), so a newer, shorter job outranks an older one only
    while their remaining times differ by more than ``age_credit`` x the older one's extra age: what
    short jobs may take from long ones is bounded (issue 23 item 7, tails); ``credit_cap``: the credit is at
    most that share of the job's remaining time, so a job at least ``1 / (1 - credit_cap)`` times shorter
    still outranks it, however old (inf: uncapped). ``grow_hold`` (``completion``, ``life``):
    ``(job id, share of the jobs that outrank it) -> seconds`` (:meth:`~slurm_elastic.policies._hold.GrowHold.hold_s`):
    a grow or a move of a running job pays its restart back over at most its restart and the longer of
    that and the time it has held its size, how long the GPUs it takes are expected to stay its own. ``inferred``: job index -> GPU-seconds left, inferred for
    jobs that report no work left (policies/_sizes), used for their remaining time over their minimum.
    ``realloc="pollux"``: instead, Pollux's re-allocation factor (OSDI'21 section 4.2),
    ``max(0, (T - S d) / (T + d))`` with T the job's age, S its rescales so far and d its restart time
    (:func:`_pollux_factor`; the share rule where the age is unknown).
    ``round_trip``: a grow pays for its way back too. The GPUs a grow takes are the ones the next
    admission or grow of a higher-value job reclaims, and a reclaimed job goes back to its minimum
    (measured on the Pollux traces under ``completion``: 80-90% of shrinks end at the job's minimum);
    that second restart costs the restart share of the job's value at its minimum, charged to the
    grow that causes it, as its own restart is (docs/ALGORITHM.md). ``regrow`` (``completion``,
    ``life``): a shrink also pays for growing back (:func:`_regrow_charge`)."""
    if admission not in ADMISSIONS:
        raise ValueError(f"admission must be one of {ADMISSIONS}, not {admission!r}")
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, not {objective!r}")
    jobs = problem.jobs
    n = len(jobs)
    _none = (None, None)
    effs = [efficiency(r) for r in jobs] if efficiency is not None else [_none] * n
    flex, tabs = _tables(problem, fixed_batch, effs)
    for j, r in enumerate(jobs):  # nothing measured: admitted at what it asked for, up to the free GPUs
        if r.running_gpus <= 0 and unmeasured(r) and len(tabs[j]):
            tabs[j] = as_asked(tabs[j], r.spec)
    refs = np.array([float(f.value[0]) if len(f) else 0.0 for f in flex])
    if fair_ref and n:
        share = problem.total_gpus / n
        for j, f in enumerate(flex):
            if len(f):
                i = max(0, int(np.searchsorted(f.counts, share, side="right")) - 1)
                refs[j] = float(f.value[i])
    mins = [int(t.counts[0]) if len(t) and refs[j] > 0 else 0 for j, t in enumerate(tabs)]  # 0 = cannot run
    running = [r.running_gpus for r in jobs]
    # A frozen running job (in its rescale cooldown) can only keep its count: its minimum is that count.
    frozen = [bool(r.frozen and r.running_gpus > 0 and mins[j]) for j, r in enumerate(jobs)]
    frozen_at = [_frozen_count(tabs[j], running[j]) if frozen[j] else 0 for j in range(n)]
    for j in range(n):
        if frozen[j]:
            mins[j] = frozen_at[j]
    status = [NOT_ADMITTED] * n
    reasons: dict[int, str] = {}
    free = int(problem.total_gpus)
    what = "the requested batch" if fixed_batch else "a batch in range"
    preempt = problem.allow_preemption
    joint = admission == "joint"

    if not preempt:
        for j in range(n):
            if running[j] <= 0:
                continue
            need = mins[j]
            if need == 0:
                reasons[j] = f"stopped: no allowed GPU count <= {problem.total_gpus} runs {what}"
            elif need <= free:
                status[j] = ADMITTED
                free -= need
            else:
                reasons[j] = f"stopped: running minimums exceed the {problem.total_gpus} GPUs available"
    if admission == "auto":  # joint only when the pending minimums do not all fit: then the value decides
        pending_need = sum(mins[j] for j in range(n) if running[j] <= 0)
        joint = pending_need > free
    holder = None
    for j in range(n):
        is_running = running[j] > 0
        if status[j] == ADMITTED or (is_running and not preempt):
            continue
        verb = "preempted" if is_running else "pending"
        need = mins[j]
        if need == 0:
            reasons[j] = f"{verb}: no allowed GPU count <= {problem.total_gpus} runs {what}"
            continue
        if holder is not None:
            reasons[j] = f"{verb}: held for starving job {jobs[holder].job_id} (waited {jobs[holder].wait_s:.0f}s)"
            continue
        starving = jobs[j].wait_s >= starvation_s
        if joint and not starving and not is_running:
            status[j] = OPTIONAL
            continue
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

    dp_list = [j for j in range(n) if status[j] != NOT_ADMITTED]
    dp_jobs = np.array(dp_list, dtype=np.int64)
    pieces = []
    lens = []
    base = []
    for j in dp_list:
        t = tabs[j]
        mat = t.mat
        if frozen[j]:
            i = t.index(frozen_at[j])
            mat = mat[:, i:i + 1]
        if status[j] == OPTIONAL:
            pieces.append(_ZERO7)
            lens.append(mat.shape[1] + 1)
            base.append(0)
        else:
            lens.append(mat.shape[1])
            base.append(mins[j])
        pieces.append(mat)
    cols = np.concatenate(pieces, axis=1) if pieces else np.zeros((7, 0))
    lens_a = np.array(lens, dtype=np.int64)
    offsets = np.zeros(dp_jobs.size + 1, np.int64)
    np.cumsum(lens_a, out=offsets[1:])
    counts = cols[0].astype(np.int64)
    wt = np.array([jobs[j].weight for j in dp_list], dtype=np.float64)
    run_a = np.array([running[j] for j in dp_list], dtype=np.int64)
    ns = problem.node_size
    cur_rate = {j: _current_value(jobs[j], ns, effs[j][0]) for j in dp_list if running[j] > 0}
    inferred = inferred or {}
    remaining = np.array([_remaining_s(jobs[j], refs[j], problem.horizon_s, inferred.get(j)) for j in dp_list])
    if objective == "completion" and age_credit > 0:  # the tail bound: ranked as if shorter with age (_scale)
        credit = age_credit * np.array([max(0.0, jobs[j].age_s or 0.0) for j in dp_list])
        remaining = remaining - np.minimum(credit, credit_cap * remaining)
    if realloc not in REALLOCS:
        raise ValueError(f"realloc must be one of {REALLOCS}, not {realloc!r}")

    def rescale_factor(j: int) -> float:
        if realloc == "pollux" and jobs[j].age_s is not None:
            return _pollux_factor(jobs[j])
        if realloc == "life":
            return _rescale_factor(jobs[j], problem, cur_rate.get(j), restart_margin, tenure, backoff, thrash_cap)
        return 1.0 - _restart_share(jobs[j], problem, cur_rate.get(j), restart_margin, tenure, backoff)

    factor = np.array([rescale_factor(j) if running[j] > 0 else 1.0 for j in dp_list])
    # ``completion``: how many optimised jobs rank ahead of each (by work left, shorter first)
    n_ahead = (len(dp_list) - _ranks(remaining)).astype(np.int64) if objective == "completion" and dp_list else None
    factor_up = None
    holds: dict[int, float] = {}
    if grow_hold is not None and n_ahead is not None and realloc == "life":
        for q, (j, a) in enumerate(zip(dp_list, n_ahead.tolist(), strict=True)):
            if running[j] <= 0:
                continue
            h = grow_hold(jobs[j].job_id, a / len(dp_list))
            if jobs[j].held_s is not None:  # what its size has lasted is evidence too (tenure's premise)
                h = max(h, float(jobs[j].held_s))
            if math.isfinite(h):
                holds[j] = h
                if factor_up is None:
                    factor_up = factor.copy()
                factor_up[q] = _rescale_factor(jobs[j], problem, cur_rate.get(j), restart_margin, tenure, backoff,
                                               thrash_cap, hold_s=h)
    r_rep = np.repeat(run_a, lens_a)
    pen = np.where((r_rep > 0) & (counts != r_rep), np.repeat(factor, lens_a), 1.0)
    if factor_up is not None:
        pen = np.where((r_rep > 0) & (counts > r_rep), np.repeat(factor_up, lens_a), pen)
    ref_rep = np.repeat(refs[dp_jobs], lens_a) if dp_list else np.empty(0)
    speedup = cols[6] / np.where(ref_rep > 0, ref_rep, 1.0)
    scale = np.repeat(_scale(objective, wt, remaining, rank_cap), lens_a)
    ahead = dict(zip(dp_list, n_ahead.tolist(), strict=True)) if n_ahead is not None else {}
    net = speedup * pen
    if round_trip and dp_list:
        at_min = np.array([float(tabs[j].value[0]) / refs[j] if len(tabs[j]) and refs[j] > 0 else 0.0
                           for j in dp_list])
        back = np.repeat((1.0 - factor) * at_min, lens_a)
        net = np.where((r_rep > 0) & (counts > r_rep), np.maximum(net - back, 0.0), net)
    if regrow and realloc == "life" and objective == "completion" and dp_list:
        back = np.repeat(np.array([_regrow_charge(jobs[j], problem, cur_rate.get(j), refs[j], tenure)
                                   if running[j] > 0 else 0.0 for j in dp_list]), lens_a)
        net = np.where((r_rep > 0) & (counts > 0) & (counts < r_rep), np.maximum(net - back, 0.0), net)
    values = choice_values(objective, net, scale, counts > 0, p)
    gross = choice_values(objective, speedup, scale, counts > 0, p)
    weights = np.where(counts > 0, counts - np.repeat(np.array(base, dtype=np.int64), lens_a), 0)
    keep = np.zeros(values.size, dtype=bool)
    current: dict[int, float | None] = {}
    for q, j in enumerate(dp_list):  # q, not p: p is the p-norm's exponent
        if running[j] <= 0:
            continue
        req = jobs[j]
        cur = current_samples_per_s(req, ns)
        current[j] = cur
        ti = (0 if frozen_at[j] == running[j] else -1) if frozen[j] else tabs[j].index(req.running_gpus)
        if ti < 0:
            continue
        flat = int(offsets[q]) + ti + (1 if status[j] == OPTIONAL else 0)
        if req.running_batch is None or req.running_batch == int(cols[2, flat]):
            keep[flat] = True  # its best batch is what it runs: keeping costs nothing
            continue
        # re-batching on the same count is a restart too: its speedup pays the factor (for pnorm's
        # negative values, scaling the value itself would make the restart a gain)
        values[flat] = choice_values(objective, speedup[flat:flat + 1] * factor[q], scale[flat:flat + 1],
                                     np.array([True]), p)[0]
        if cur is None or req.spec.split_batch(req.running_gpus, req.running_batch) is None:
            continue  # cannot keep what it runs now (out of range): any start is a restart
        # The planner carries out no batch-only change (planner.py rule 2): at its running count the job
        # keeps its batch, valued at what it does now, so the policy plans only what can be enacted.
        values[flat] = float(choice_values(objective, np.array([(cur_rate.get(j) or cur) / refs[j]]),
                                           np.array([scale[flat]]), np.array([True]), p)[0])
        keep[flat] = True
    for j in range(n):
        if running[j] > 0 and j not in current:
            current[j] = current_samples_per_s(jobs[j], ns)
    goodput = {j: v for j, v in cur_rate.items() if effs[j][0] is not None}
    return Candidates(problem, tabs, refs, status, reasons, free, dp_jobs, offsets, weights, values, cols, keep,
                      current, factor, gross, goodput, (realloc, restart_margin, tenure, backoff, thrash_cap), ahead,
                      ranked_among=len(dp_list), factor_up=factor_up, hold=holds)


@contextmanager
def gc_paused():
    """The cyclic garbage collector off while one allocation runs (restored after, even on error).

    An allocation makes ~10^5 short-lived containers that reference counting frees; on the 10,000-job
    multi-pool benchmark the collector's passes over the heap they trigger took 80-170 ms of ~500."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


OBJECTIVES = ("speedup", "pnorm", "completion")
REALLOCS = ("share", "life", "pollux")
ADMISSIONS = ("priority", "joint", "auto")


def _scale(objective: str, wt: np.ndarray, remaining_s: np.ndarray, rank_cap: float = float("inf")) -> np.ndarray:
    """Per-job factor of the value: the weight, and for ``completion`` the job's SRPT rank.

    The rank of a job is the number of optimised jobs expected to finish no earlier than it (itself
    included; by remaining time; of equal ones the later in queue order ranks higher): in a
    shortest-remaining-first schedule a delay of that job delays every one of them, so a second of its
    progress is worth that many seconds of total completion time (heSRPT's rank weighting; Berg et
    al., 2020). Shortest job: rank n; longest: 1."""
    if objective == "completion" and remaining_s.size:
        return wt * np.minimum(_ranks(remaining_s), rank_cap)
    return wt


def _ranks(remaining_s: np.ndarray) -> np.ndarray:
    """SRPT rank per job: how many jobs (itself included) are expected to finish no earlier (longest: 1)."""
    order = np.argsort(-remaining_s, kind="stable")
    rank = np.empty(remaining_s.size)
    rank[order] = np.arange(1, remaining_s.size + 1)
    return rank


def choice_values(objective: str, speedup: np.ndarray, scale: np.ndarray, runs: np.ndarray, p: float) -> np.ndarray:
    """The knapsack value of each choice (a sum of per-job terms, so the DP is exact for all three).

    * ``speedup``: ``weight x speedup`` (the paper's total weighted speedup; with goodput tables,
      total weighted goodput speedup);
    * ``pnorm``: ``weight x (1 - speedup^p)``, p < 0 (Pollux's fairness: maximising the power mean of
      speedups with p < 0 is minimising the sum of ``speedup^p``); 0 GPUs is worth ``-inf``-like 0 - 1e6;
    * ``completion``: ``weight x rank x speedup``, ``rank`` the job's SRPT rank from :func:`_scale`
      (heSRPT's weighting: a second of a job's progress is worth as many seconds of total completion
      time as jobs finish no earlier, so short jobs finish first while every admitted job keeps its
      minimum: no starvation).
    ``speedup`` is already net of the restart penalty.
    """
    s = np.maximum(speedup, 0.0)
    if objective == "pnorm":
        with np.errstate(divide="ignore"):
            v = scale * (1.0 - np.where(s > 0, s, 1e-6) ** p)
        return np.where(runs, v, -1e6 * scale)
    return scale * s


def _current_value(req, node_size: int, eff) -> float | None:
    """What a running job's current (GPUs, batch) is worth in the table's unit (goodput or samples/s)."""
    cur = current_samples_per_s(req, node_size)
    if cur is None or eff is None or req.running_batch is None:
        return cur
    return cur * float(eff(np.array([req.running_batch], dtype=np.float64))[0])


def _remaining_s(req, ref_value: float, horizon_s: float, inferred_gpu_s: float | None = None) -> float:
    """Remaining time of a job at its reference count: its reported remaining work / reference rate;
    unknown work: what jobs of its model that ended had left at its attained service (``inferred_gpu_s``,
    policies/_sizes), over its minimum; else as long as it has already run at its minimum (least attained
    service, as Tiresias), at least one horizon."""
    if req.remaining_samples is not None and ref_value > 0:
        return max(1.0, float(req.remaining_samples) / ref_value)
    kmin = max(1, req.spec.min_gpus)
    if inferred_gpu_s is not None:
        return max(1.0, inferred_gpu_s / kmin)
    return max(horizon_s, req.attained_gpu_s / kmin)


def unmeasured(req) -> bool:
    """Nothing measured: no named profile, no declared points, no report yet (the conservative default
    prior, ``profiles.learned``): its predicted speedups are a guess, not the job's."""
    return getattr(req.model, "provenance", None) == "prior"


def as_asked(t: JobTable, spec) -> JobTable:
    """A pending job's table when nothing is measured: its counts up to what it asked for (``gpus=``, else
    its ``max_gpus``), each valued as if it scaled linearly from its minimum, so that the knapsack admits
    it at the largest of those the free GPUs allow (work-conserving: two jobs allowed 1-16 GPUs on an
    empty 16-GPU cluster share all 16, not 1 each). Once it reports, its own measurements decide."""
    want = spec.gpus if spec.gpus is not None else spec.max_gpus
    keep = t.counts <= max(want, int(t.counts[0]))
    k0, v0 = float(t.counts[0]), float(t.value[0])
    value = np.maximum(t.value[keep], v0 * t.counts[keep] / k0)
    return JobTable(t.counts[keep], t.nodes[keep], t.batch[keep], t.local[keep], t.accum[keep], t.sps[keep], value)


def _pollux_factor(req) -> float:
    """Pollux's re-allocation factor: ``max(0, (T - S d) / (T + d))``, T the job's age (since submission),
    S the re-allocations it has had, d its restart time. A young or often re-allocated job keeps little
    of a rescale's value; an old one nearly all of it."""
    d = restart_s(req)
    t = float(req.age_s)
    return max(0.0, (t - int(req.rescales) * d) / (t + d)) if t + d > 0 else 0.0


def life_s(req, problem, cur_value: float | None) -> float:
    """The job's expected remaining life at its current size: the work it reports left over its current
    rate; when it reports none, as long as it has already run at that size (least attained service: a
    job that has run long is expected to run long), at least the planning horizon. Not capped by the
    horizon: a job with days left gains for days from a rescale."""
    if req.remaining_samples is not None and cur_value:
        return max(0.0, float(req.remaining_samples) / cur_value)
    return max(float(problem.horizon_s), float(req.attained_gpu_s) / max(1, req.running_gpus))


def thrash_share(req, problem, margin: float, tenure: bool, backoff: float, cap: float) -> float:
    """The anti-thrash charge: ``margin x (1 + backoff x rescales) x restart_s / held``, ``held`` the time
    the job has held its size (with ``tenure``; else the horizon), capped at ``cap`` < 1, so that it slows
    a job that keeps being resized but never makes a large gain unpayable; and, as ``held`` grows without
    bound, any gain the progress rule says pays is made within a bounded time."""
    held = float(problem.horizon_s)
    if tenure and req.held_s is not None:
        held = float(req.held_s)
    m = margin * (1.0 + backoff * max(0, int(req.rescales)))
    if held <= 0:
        return cap
    return min(cap, max(0.0, m * restart_s(req) / held))


def _rescale_factor(req, problem, cur_value: float | None, margin: float = 4.0, tenure: bool = True,
                    backoff: float = 0.0, cap: float = 0.5, hold_s: float = math.inf) -> float:
    """The share of a new size's value a rescale keeps: ``(1 - restart_s / life) x (1 - thrash)``.

    The first factor is the progress rule: a rescale from rate c to n pays when the job, restarted, ends
    sooner than if kept (``restart + W / n < W / c``, W the work left, ``life = W / c``), that is when
    ``n x (1 - restart / life) > c``. The second is :func:`thrash_share`, at most ``cap``: a gain of more
    than ``1 / ((1 - cap) x (1 - restart / life))`` always pays, for any restart cost and any history
    (a job on 1 GPU that 24 would speed up 15 times is grown, however often it was resized). ``hold_s``:
    how long the new size is expected to train before it is changed again (a grow's,
    :class:`~slurm_elastic.policies._hold.GrowHold`): the life is at most its restart and that."""
    r = restart_s(req)
    life = min(life_s(req, problem, cur_value), r + hold_s)
    if life <= r:
        return 0.0
    return (1.0 - r / life) * (1.0 - thrash_share(req, problem, margin, tenure, backoff, cap))


def _regrow_charge(req, problem, cur_value: float | None, ref: float, tenure: bool = True) -> float:
    """What a shrink costs beyond its own restart, in speedup units: the restart of growing back. The
    progress rule prices a shrink as if the smaller size lasted the job's whole life, but the GPUs it
    gives up go to jobs that end sooner, and then it grows back: one more restart at its current rate,
    ``current x restart_s / d``, paid over ``d``, how long the smaller size is expected to last: as long
    as the job has held its current size (tenure's premise, as the anti-thrash share; unknown or 0: the
    horizon), at least one restart, at most its life. A job just grown is not shrunk back for a small
    gain; one that has held its size for hours pays almost nothing more (issue 23, tails)."""
    if not cur_value or ref <= 0:
        return 0.0
    r = restart_s(req)
    held = float(req.held_s) if tenure and req.held_s else float(problem.horizon_s)
    d = min(max(r, held), life_s(req, problem, cur_value))
    return (cur_value / ref) * r / max(d, 1.0)


def _restart_share(req, problem, cur_value: float | None, margin: float = 1.0, tenure: bool = False,
                   backoff: float = 0.0) -> float:
    """Share of a new size's expected life that a rescale costs: ``margin x restart_s / life``, clipped
    to [0, 1] (1: the rescale never pays). ``life`` is the least of the planning horizon, the time the
    job still needs at its current size (a job about to finish is not resized) and, with ``tenure``,
    the time it has held its current size (what the last size lasted is the best guess of what the
    next one will: a job whose size keeps changing must gain more before it changes again). ``backoff``:
    the margin grows by that share per rescale the job has had (``JobRequest.rescales``)."""
    r = restart_s(req)
    h = problem.horizon_s
    if req.remaining_samples is not None and cur_value:
        h = min(h, float(req.remaining_samples) / cur_value)
    if tenure and req.held_s is not None:
        h = min(h, float(req.held_s))
    if h <= 0:
        return 1.0
    margin *= 1.0 + backoff * max(0, int(req.rescales))
    return min(1.0, max(0.0, margin * float(r) / h))


def build_allocation(plan: Candidates, chosen_flat: np.ndarray, policy: str, solve_s: float,
                     only=None) -> Allocation:
    """Turn one chosen flat choice per optimised job into the per-job answer, with reasons. ``only``:
    the job indices to answer for (default: every job of the problem)."""
    problem = plan.problem
    jobs = problem.jobs
    chosen_flat = np.asarray(chosen_flat, dtype=np.int64)
    objective = float(plan.values[chosen_flat].sum()) if chosen_flat.size else 0.0
    used = int(plan.weights[chosen_flat].sum()) if chosen_flat.size else 0
    spare = plan.capacity - used
    sel = plan.cols[:, chosen_flat]
    k_l = sel[0].astype(np.int64).tolist()
    n_l = sel[1].astype(np.int64).tolist()
    b_l = sel[2].astype(np.int64).tolist()
    lb_l = sel[3].astype(np.int64).tolist()
    a_l = sel[4].astype(np.int64).tolist()
    s_l = sel[5].tolist()
    v_l = sel[6].tolist()
    keep_l = plan.keep[chosen_flat].tolist()
    picked = {j: p for p, j in enumerate(plan.dp_jobs.tolist())}
    better, better_at = _better_elsewhere(plan, chosen_flat, spare)
    gainers = _gainers(plan, chosen_flat)
    out: dict = {}
    for j in (range(len(jobs)) if only is None else only):
        req = jobs[j]
        p = picked.get(j)
        r = req.running_gpus
        if p is None or k_l[p] == 0:
            reason = plan.reasons.get(j)
            if reason is None:
                reason = ("preempted: its GPUs are worth more elsewhere" if r > 0
                          else _waiting_reason(plan, j, gainers, spare))
            out[req.job_id] = JobAllocation(req.job_id, 0, reason=reason)
            continue
        k, batch, local, accum, sps = k_l[p], b_l[p], lb_l[p], a_l[p], s_l[p]
        keep = keep_l[p]
        cur = plan.current.get(j)
        if keep and req.running_batch is not None:
            split = req.spec.split_batch(k, req.running_batch)
            if split is not None:
                batch, (local, accum) = req.running_batch, split
                sps = cur or sps
        if r <= 0:
            reason = _admitted_reason(plan, j, k, v_l[p])
        elif keep:
            reason = _kept_reason(plan, p, int(chosen_flat[p]), better_at) if better[p] and not req.frozen \
                else _kept_plain(plan, j, k)
        elif k > r:
            reason = f"grown {r}->{k}: {_gain(sps, cur, v_l[p], plan.goodput.get(j))}".rstrip(": ")
        elif k < r:
            reason = (f"shrunk {r}->{k}: {_gain(sps, cur, v_l[p], plan.goodput.get(j))}".rstrip(": ")
                      + "; GPUs to higher-value jobs")
        else:
            reason = f"rebatched {req.running_batch}->{batch}: {_gain(sps, cur, v_l[p], plan.goodput.get(j))}"
            reason = reason.rstrip(": ")
        out[req.job_id] = JobAllocation(req.job_id, k, n_l[p], batch, local, accum, sps, reason)
    return Allocation(out, objective, solve_s, policy)


def _gain(sps: float, cur: float | None, value: float, cur_value: float | None) -> str:
    """What a change buys, in the unit the policy chose by: goodput first where the table is goodput (a
    grow to a smaller, more efficient batch can lower samples/s and still gain), then samples/s."""
    if cur_value is None or cur_value <= 0 or not np.isfinite(value):
        return pct(sps, cur)
    rate = pct(sps, cur)
    return f"{100.0 * (value / cur_value - 1.0):+.0f}% goodput" + (f" ({rate})" if rate else "")


def _better_elsewhere(plan: Candidates, chosen_flat: np.ndarray, spare: int) -> tuple[np.ndarray, np.ndarray]:
    """Would a reachable other count be better but for the restart cost (what a kept job's reason says)?
    One pass over every choice, on the values before any restart charge: per optimised job whether so,
    and per choice whether it is such a count."""
    n = plan.dp_jobs.size
    if not n or not chosen_flat.size:
        return np.zeros(n, bool), np.zeros(plan.values.size, bool)
    pos = np.repeat(np.arange(n), np.diff(plan.offsets))
    c = chosen_flat[pos]
    better = ((np.arange(pos.size) != c) & (plan.weights <= plan.weights[c] + spare) & (plan.cols[0] > 0)
              & (plan.gross > plan.values[c] + 1e-12))
    return (np.bincount(pos[better], minlength=n) > 0) | (plan.factor <= 0), better


def _frozen_count(t, running: int) -> int:
    """The one count a frozen running job is given: the one it runs at; where its table no longer has it
    (a batch limit learned from an out-of-memory failure, daemon/oom.py, rules it out) the fewest above
    it, else the most below. Never a free choice: a report the daemon cannot verify would otherwise buy
    a grow past the cooldown that holds its twin."""
    if t.index(running) >= 0:
        return running
    counts = [int(k) for k in t.counts]
    above = [k for k in counts if k > running]
    return min(above) if above else max(counts)


def _plural(k: int) -> str:
    return f"{k} GPU{'s' if k != 1 else ''}"


def _source(req) -> str:
    """Where a job's speeds come from, in a reason: its reports, its profile, its declared points."""
    prov = getattr(req.model, "provenance", None)
    if prov:
        return "measured" if prov.startswith("fitted") else {"profile": "profiled", "declared": "declared",
                                                              "prior": "default (nothing measured)"}.get(prov, prov)
    return "profiled"


def _admitted_reason(plan: Candidates, j: int, k: int, value: float) -> str:
    """Why a pending job starts at ``k``: what it asked for when nothing is measured, else its scaling."""
    req = plan.problem.jobs[j]
    t = plan.tables[j]
    kmin = int(t.counts[0])
    head = f"admitted: {_plural(k)}"
    if unmeasured(req):
        want = req.spec.gpus if req.spec.gpus is not None else req.spec.max_gpus
        if k >= want:
            return f"{head}, what it asked for (nothing measured yet)"
        return f"{head} of the {want} it asked for: the GPUs free now (nothing measured yet)"
    if k <= kmin:
        return head + (" (its minimum: more GPUs are worth more to other jobs)" if len(t) > 1 else "")
    ref = float(plan.refs[j])
    x = f"{value / ref:.1f}x" if ref > 0 and np.isfinite(value) else "more than"
    return f"{head} (minimum {kmin}; {x} its minimum's {'goodput' if plan.goodput is not None else 'speed'} " \
           f"by its {_source(req)} scaling)"


def _kept_plain(plan: Candidates, j: int, k: int) -> str:
    """Why a running job keeps its size when no other reachable size would be better even before the
    restart: frozen (cooldown, in flight), or its scaling says so."""
    req = plan.problem.jobs[j]
    if req.frozen:
        since = f" {req.held_s:.0f} s ago" if req.held_s is not None else ""
        return f"kept: started or resized{since} (cooldown or in flight): not resized until it settles"
    return f"kept: no reachable size is worth more by its {_source(req)} scaling"


def _gainers(plan: Candidates, chosen_flat: np.ndarray) -> list:
    """``(GPUs above its minimum, job id)`` of the jobs given the most above their minimum (at most 3,
    largest first), and how many got any: whom a waiting job's GPUs went to."""
    if not chosen_flat.size:
        return [[], 0]
    w = plan.weights[chosen_flat]
    got = np.nonzero(w > 0)[0]
    top = got[np.argsort(-w[got], kind="stable")[:3]]
    jobs = plan.problem.jobs
    return [[(int(w[q]), jobs[int(plan.dp_jobs[q])].job_id) for q in top], int(got.size)]


def _waiting_reason(plan: Candidates, j: int, gainers: list, spare: int) -> str:
    """Why a pending job does not start: no count fits what running jobs' minimums leave, or the GPUs it
    would need are worth more to named other jobs (the ones given the most above their minimum)."""
    req = plan.problem.jobs[j]
    t = plan.tables[j]
    kmin = int(t.counts[0]) if len(t) else req.spec.min_gpus
    if kmin > plan.capacity:
        return (f"pending: its minimum of {_plural(kmin)} is more than the {plan.capacity} left after running "
                f"jobs' minimums")
    top, count = gainers
    top = [(w, jid) for w, jid in top if jid != req.job_id][:2]
    if not top:
        return f"pending: its minimum of {_plural(kmin)} does not fit the {spare} GPUs free on the nodes"
    who = ", ".join(f"job {jid} (+{w})" for w, jid in top) + (f" and {count - len(top)} more" if count > len(top)
                                                             else "")
    why = ""
    if j in plan.ahead:
        n = plan.ranked_among
        why = f"; shorter jobs first: {plan.ahead[j]} of {n} rank ahead of it by work left"
    return (f"pending: its {_plural(kmin)} minimum is worth more to other jobs now: {who}"
            + (f"; {spare} spare do not place it" if spare >= kmin else "") + why + plan.valuation)


def _kept_reason(plan: Candidates, p: int, c: int, better: np.ndarray) -> str:
    """Why a kept job whose other sizes would be better but for the restart keeps its size: which size and
    its gain before the restart charge, and what the charge is made of (``status`` shows it). Only for the
    jobs _better_elsewhere picks; ``better``: its per-choice answer."""
    lo, hi = int(plan.offsets[p]), int(plan.offsets[p + 1])
    j = int(plan.dp_jobs[p])
    req = plan.problem.jobs[j]
    r = restart_s(req)
    cost = _charge(plan, j, r)
    if not better[lo:hi].any() or plan.values[c] <= 0:
        if plan.factor[p] <= 0:
            return f"kept: gain below restart cost (a {r:.0f} s restart would cost all of a rescale's value{cost})"
        return f"kept: gain below restart cost ({cost.lstrip('; ')})" if cost else "kept: gain below restart cost"
    raw = np.where(better[lo:hi], plan.gross[lo:hi], -np.inf)
    best = int(np.argmax(raw))
    k = int(plan.cols[0, lo + best])
    gain = float(raw[best]) / float(plan.values[c]) - 1.0
    return (f"kept: gain below restart cost ({_plural(k)} would gain {gain:+.0%}, less than "
            f"its {r:.0f} s restart costs{cost or ' over its expected life'})")


def _charge(plan: Candidates, j: int, r: float) -> str:
    """The rescale charge in figures (the ``life`` rule): the job's expected life and the anti-thrash share."""
    realloc, margin, tenure, backoff, cap = plan.rule
    if realloc != "life":
        return ""
    req = plan.problem.jobs[j]
    cur = plan.goodput.get(j) if plan.goodput.get(j) is not None else plan.current.get(j)
    life = life_s(req, plan.problem, cur)
    thr = thrash_share(req, plan.problem, margin, tenure, backoff, cap)
    held = f", held {req.held_s / 60:.0f} min" if tenure and req.held_s is not None else ""
    hold = plan.hold.get(j)
    kept = (f"; a grow would keep its GPUs about {hold / 60:.0f} min (how soon this job's grows were undone "
            f"lately)" if hold is not None and r + hold < life else "")
    return (f" over its expected {life / 3600:.1f} h life; anti-thrash {thr:.0%} after {req.rescales} "
            f"rescale{'s' if req.rescales != 1 else ''}{held}{kept}")
