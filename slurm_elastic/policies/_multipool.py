"""Several pools (issue 13): choose each job's pool as well as its GPU count and batch.

The problem ``Q``: every job picks at most one (pool, choice) among the pools it may use (a running
job: only the pool it runs in; it is never moved while it runs); each pool's GPUs bound the counts
chosen there; jobs admitted in priority order must get at least their minimum somewhere. A choice's
value is the single-pool value (:mod:`._candidates`) built with the job's model for that pool's GPU
type, scaled by ``ref_p / ref_best`` (its throughput at its minimum in that pool over the best pool it
may use), so that a GPU type that runs the job faster is worth more. A job with no per-type data
runs its one model in every pool, and its reason says so.

Solution, in three steps:

1. **Admission** across pools, in priority order: a pending job is admitted if its minimum fits in
   what running minimums and higher-priority admitted jobs leave in one of its pools (that pool is a
   witness, so admission is always feasible). A blocked job that has waited ``starvation_s`` closes
   its pools to later jobs (jobs on other pools go on).
2. **Lagrangian prices on the pool capacities**: relaxing every pool's capacity with a price
   ``mu_p >= 0`` splits ``Q`` into one independent choice per job:
   ``L(mu) = sum_j max_(p,c) (v - mu_p w) + sum_p mu_p C_p`` is an upper bound on ``Q``'s optimum
   for every ``mu``. Two searches lower it, each keeping its best ``L`` (one numba pass over the
   items per evaluation, :func:`_price_picks`): projected subgradient steps from ``mu = 0``
   (:func:`subgradient_prices`), and a common price by bisection on the total demand followed by
   per-pool sign steps (:func:`lagrangian`). At each search's best prices every job that may use
   several pools is assigned the pool of its best choice; the admitted minimums are then fitted, else
   the admission witnesses are used, moved toward that choice (:func:`_assign`).
3. **Per-pool exact DP**: with the pools fixed, each pool is the single-pool problem, solved by the
   exact knapsack and the placement re-solve (:func:`._placement.solve_placeable`), for each search's
   assignment (a pool whose job set repeats is solved once); the better total is the answer. A running
   job sent to another pool is offered there only the choices the move rule (:data:`MOVE_MIN_GAIN`)
   lets the prices see, and its minimum there is the least of them.

When the jobs that may use several pools admit at most ``enumerate_limit`` assignments in all, step
2's assignment is replaced by trying every one (then the answer is ``Q``'s optimum up to placement).
The answer reports ``bound``: the lower of the two searches' best ``L`` (or the exact optimum when
enumerated); the optimality gap is ``bound - objective`` and includes anything lost to node placement.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
from numba import njit

from slurm_elastic.policies._candidates import (
    ADMITTED,
    NOT_ADMITTED,
    OPTIONAL,
    Candidates,
    _plural,
    build_allocation,
)
from slurm_elastic.policies._mckp import mckp
from slurm_elastic.policies._placement import _replay, _shape, solve_placeable, start_map
from slurm_elastic.policies._tables import current_samples_per_s, pct
from slurm_elastic.policies.base import Allocation, AllocationProblem, JobAllocation

REQUIRED, FREE = 1, 2  # a job's standing in Q: must get its minimum somewhere / may get nothing
# A running job moves only to a type that runs it at least this much faster per GPU (at its minimum, by its
# models): never to a slower one. Measured on Sia's workload 1 (first 100 jobs): with moves in every
# direction jobs were sent to one slow GPU and their rescale count then held them there (imagenet-11
# 111 h, mean JCT 1.37 -> 4.9 h); upward only, no job can go back and forth.
# Or to a choice on any type whose value, net of the move's restart, exceeds what it has at home by as much
# (a job squeezed onto a few fast GPUs while many slower ones are free: Sia's workload 4, four imagenet jobs
# sharing the 16 A100s at ~4 each for 9 h while the RTX pool had room); a move to fewer, slower GPUs is
# worth less than staying, so it is never made.
MOVE_MIN_GAIN = 0.1


@dataclass
class PoolQ:
    """``Q`` as flat arrays: one item per (job, pool, choice). Built once per allocation."""

    cands: list[Candidates]  # per pool: the single-pool candidates (joint admission, no starvation)
    local: list[dict[int, int]]  # per pool: problem job index -> index in that pool's sub-problem
    standing: list[int]  # per problem job: REQUIRED, FREE or 0 (nothing this cycle)
    reasons: dict[int, str]
    witness: dict[int, int]  # admitted pending job -> pool whose minimums admitted it
    job: np.ndarray  # per item: problem job index
    pool: np.ndarray  # per item: pool index
    flat: np.ndarray  # per item: index into that pool's candidate arrays
    weight: np.ndarray  # per item: GPUs (absolute count)
    value: np.ndarray  # per item: scaled value
    capacity: np.ndarray  # per pool: GPUs
    scale: dict[tuple[int, int], float]  # (job, pool) -> ref_p / ref_best
    minc: np.ndarray  # (job, pool) -> its minimum count there (0: no choice there)
    dp_job: list[np.ndarray] | None = None  # per pool: problem job index of each optimised position
    sc: np.ndarray | None = None  # (job, pool) -> ref_p / ref_best (the dense form of ``scale``)
    home: dict[int, int] | None = None  # running job that may move -> the pool it runs in
    move: np.ndarray | None = None  # per problem job: the value share a move keeps (1 - its restart share)
    # per pool: which of its candidate choices may be taken (False: a move's choice the move rule refuses,
    # MOVE_MIN_GAIN); the per-pool DP offers a job that moves in only these, as the prices saw it
    movable: list[np.ndarray] | None = None


def _with_model(req, model, spec=None):
    """``replace(req, model=model[, spec=spec])`` without the dataclass machinery (thousands per cycle)."""
    new = object.__new__(type(req))
    new.__dict__.update(req.__dict__)
    new.__dict__["model"] = model
    if spec is not None:
        new.__dict__["spec"] = spec
    return new


def _moved(req, model, spec=None):
    """A running job as a start in another pool: no GPUs there, no batch, no nodes (its restart is
    charged in build_q, as a rescale of the pool it runs in)."""
    new = _with_model(req, model, spec)
    new.__dict__.update(running_gpus=0, running_batch=None, nodes=(), gpus_per_node=0)
    return new


def _sub_problems(problem: AllocationProblem):
    names = {p.name: i for i, p in enumerate(problem.pools)}
    node_pool = {n: i for i, p in enumerate(problem.pools) for n, _ in p.node_capacity}
    allowed: list[tuple[int, ...]] = []
    for req in problem.jobs:
        if req.running_gpus > 0 and req.pool in names:
            # its pool first; the other pools it may use when it can move (issue 23: a move is a restart
            # in another pool, charged as a rescale, see build_q)
            cur = names[req.pool]
            away = () if req.frozen or not req.nodes else tuple(
                names[n] for n in req.pools if n in names and names[n] != cur)
            allowed.append((cur,) + away)
        elif req.running_gpus > 0 and req.nodes:
            where = Counter(node_pool[n] for n in req.nodes if n in node_pool)
            allowed.append((where.most_common(1)[0][0],) if where else ())
        else:
            ps = tuple(names[n] for n in req.pools if n in names) if req.pools else tuple(range(len(names)))
            allowed.append(ps)
    members: list[list[int]] = [[] for _ in problem.pools]
    for j, a in enumerate(allowed):
        for i in a:
            members[i].append(j)
    subs = []
    for i, pool in enumerate(problem.pools):
        jobs = []
        for j in members[i]:
            req = problem.jobs[j]
            model = req.model_in(pool.name)
            spec = req.spec_in(pool.name)  # its batch limit there
            if req.running_gpus > 0 and allowed[j][0] != i:
                jobs.append(_moved(req, model, spec))  # there, it would start anew
                continue
            jobs.append(req if model is req.model and spec is None else _with_model(req, model, spec))
        subs.append(AllocationProblem(
            total_gpus=pool.total_gpus, node_size=pool.node_size or problem.node_size, jobs=tuple(jobs),
            horizon_s=problem.horizon_s, allow_preemption=problem.allow_preemption,
            node_capacity=pool.node_capacity or None))
    return allowed, subs, members


def build_q(problem: AllocationProblem, candidates, *, admission: str = "priority",
            starvation_s: float = 3600.0, objective: str = "speedup") -> PoolQ:
    """``candidates(sub_problem)``: the policy's single-pool candidates with every pending job OPTIONAL
    (joint admission, no starvation); running jobs admitted at their minimum."""
    allowed, subs, members = _sub_problems(problem)
    cands = [candidates(s) for s in subs]
    n, P = len(problem.jobs), len(subs)
    local = [{j: k for k, j in enumerate(m)} for m in members]
    # per pool and optimised job: its problem index, flat range and minimum count (the first non-zero
    # choice: an OPTIONAL job's choices start with the zero choice)
    seg = []
    minc = np.zeros((n, P), np.int64)  # 0: the job has no choice in that pool
    refs = np.zeros((n, P))
    for i, c in enumerate(cands):
        gj = np.asarray(members[i], np.int64)[c.dp_jobs] if c.dp_jobs.size else np.zeros(0, np.int64)
        lo, hi = c.offsets[:-1], c.offsets[1:]
        counts = c.cols[0].astype(np.int64)
        first = counts[lo] if lo.size else np.zeros(0, np.int64)
        second = counts[np.minimum(lo + 1, max(counts.size - 1, 0))] if lo.size else first
        m = np.where(first > 0, first, np.where(hi - lo > 1, second, 0))
        minc[gj, i] = m
        refs[gj, i] = np.asarray(c.refs)[c.dp_jobs] if c.dp_jobs.size else 0.0
        seg.append((gj, lo, hi, counts))
    ref_best = np.where(minc > 0, refs, 0.0).max(axis=1) if P else np.zeros(n)
    # a running job's choices in another pool are a restart: they keep the share its own pool's candidates
    # keep for a rescale (their ``factor``), so a move pays exactly what a resize in place would
    home = np.full(n, -1, np.int64)
    move = np.ones(n)
    at_home = np.zeros(n)  # a movable running job's value at its current size at home (unscaled)
    for j, req in enumerate(problem.jobs):
        if req.running_gpus > 0 and len(allowed[j]) > 1:
            i = allowed[j][0]
            home[j] = i
            c = cands[i]
            k = local[i][j]
            pos = np.flatnonzero(c.dp_jobs == k)
            up = c.factor if c.factor_up is None else c.factor_up  # a move takes GPUs, as a grow does
            move[j] = float(up[pos[0]]) if pos.size else 0.0
            if pos.size:  # what it has at home: its current count and batch (no restart), else unknown (0)
                lo, hi = int(c.offsets[pos[0]]), int(c.offsets[pos[0] + 1])
                kept = np.flatnonzero(c.keep[lo:hi])
                if kept.size:
                    at_home[j] = float(c.values[lo + kept[0]])
    # Every objective's value is a speedup over the job's own reference count in that pool (completion:
    # weight x SRPT rank x speedup), so a faster type must be scaled in; p-norm values stay per pool.
    flat_scale = (objective == "pnorm") | (ref_best <= 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(flat_scale[:, None], 1.0, refs / np.where(ref_best > 0, ref_best, 1.0)[:, None])
    minc_l, sc_l = minc.tolist(), sc.tolist()
    scale = {(j, i): sc_l[j][i] for j in range(n) for i in allowed[j] if minc_l[j][i] > 0}
    at_home = at_home * sc[np.arange(n), np.maximum(home, 0)]
    # admission across pools
    standing = np.zeros(n, np.int64)
    reasons: dict[int, str] = {}
    witness: dict[int, int] = {}
    free = [int(c.capacity) for c in cands]
    closed: set[int] = set()
    for j, req in enumerate(problem.jobs):
        mj = minc_l[j]
        opts = [i for i in allowed[j] if mj[i] > 0]
        if req.running_gpus > 0:
            cur = allowed[j][0] if allowed[j] else None
            if cur is not None and mj[cur] > 0 and cands[cur].status[local[cur][j]] == ADMITTED:
                standing[j] = REQUIRED
            else:
                i = allowed[j][0] if allowed[j] else None
                reasons[j] = (cands[i].reasons.get(local[i][j]) if i is not None else None) or \
                    "stopped: its pool no longer holds its minimum"
            continue
        if not opts:
            why = [cands[i].reasons.get(local[i][j]) for i in allowed[j]]
            reasons[j] = next((w for w in why if w), "pending: no pool it may use can run it")
            continue
        starving = req.wait_s >= starvation_s
        if closed and set(opts) & closed:
            reasons[j] = "pending: held for a starving job in its pools"
            continue
        if admission == "joint" and not starving:
            standing[j] = FREE
            continue
        fits = [i for i in opts if mj[i] <= free[i]]
        if fits:
            i = max(fits, key=lambda i: (sc_l[j][i], free[i]))
            standing[j], witness[j] = REQUIRED, i
            free[i] -= mj[i]
        else:
            need = min(mj[i] for i in opts)
            reasons[j] = (f"pending: needs {need} GPUs, {max(free[i] for i in opts)} left after "
                          "higher-priority minimums in its pools")
            if starving:
                closed.update(opts)
    # items, vectorised per pool
    J, Pi, F, W, V = [], [], [], [], []
    movable = [np.ones(c.values.size, bool) for c in cands]
    for i, (gj, lo, hi, counts) in enumerate(seg):
        if not gj.size:
            continue
        lens = hi - lo
        jf = np.repeat(gj, lens)
        st = standing[jf]
        cnt = counts[:int(hi[-1])] if hi.size else counts
        keep = (st > 0) & ~((st == REQUIRED) & (cnt == 0))
        idx = np.flatnonzero(keep)
        jf = jf[idx]
        v = cands[i].values[idx] * np.where(cnt[idx] > 0, sc[jf, i], 1.0)
        away = (home[jf] >= 0) & (home[jf] != i)
        if away.any():
            v = np.where(away, v * move[jf], v)
            up = sc[jf, i] >= (1.0 + MOVE_MIN_GAIN) * sc[jf, np.maximum(home[jf], 0)]
            better = (at_home[jf] > 0) & (v >= (1.0 + MOVE_MIN_GAIN) * at_home[jf])
            ok = ~away | up | better
            if not ok.all():
                # a moved job's choice the rule refuses is not offered here at all (not only to the prices):
                # the per-pool DP took any count in the pool it was sent to, so a job on 1 A100 was moved to
                # 1 RTX (-41%) to free its A100, against the rule
                mov = np.zeros(cnt.size, bool)
                mov[idx[ok]] = True
                gone = np.zeros(cnt.size, bool)
                gone[idx[away]] = True
                movable[i] = ~gone | mov
                moved = np.unique(jf[away])
                jf, idx, v = jf[ok], idx[ok], v[ok]
                # a moved job's minimum there is the least count it may move to (0: none), so that what the
                # assignment reserves for it is what the pool's DP will give it at least
                minc[moved, i] = 0
                ka = away[ok]
                if ka.any():
                    least = np.full(n, np.iinfo(np.int64).max, np.int64)
                    np.minimum.at(least, jf[ka], cnt[idx[ka]])
                    has = least < np.iinfo(np.int64).max
                    minc[has, i] = least[has]
        J.append(jf)
        Pi.append(np.full(idx.size, i, np.int64))
        F.append(idx)
        W.append(cnt[idx])
        V.append(v)
    def cat(xs, dt):
        return np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)

    job_a = cat(J, np.int64)
    order = np.argsort(job_a, kind="stable")
    return PoolQ(cands, local, standing.tolist(), reasons, witness, job_a[order], cat(Pi, np.int64)[order],
                 cat(F, np.int64)[order], cat(W, np.int64)[order], cat(V, np.float64)[order],
                 np.array([s.total_gpus for s in subs], np.int64), scale, minc, [x[0] for x in seg], sc,
                 {j: int(i) for j, i in enumerate(home.tolist()) if i >= 0}, move, movable)


@njit(cache=True)
def _price_picks(starts, ends, value, weight, pool, mu, adj, top, first, used):
    """One evaluation of ``L`` at prices ``mu``, in one pass over the items: per job its best adjusted
    value ``top`` and the first item attaining it (within 1e-12) ``first``; per pool the GPUs those
    picks use. The same float operations, in the same order, as the numpy formulation it replaces."""
    used[:] = 0.0
    for x in range(value.size):
        adj[x] = value[x] - mu[pool[x]] * weight[x]
    for j in range(starts.size):
        s, e = starts[j], ends[j]
        m = adj[s]
        for x in range(s + 1, e):
            if adj[x] > m:
                m = adj[x]
        top[j] = m
        cut = m - 1e-12
        f = s
        while f < e - 1 and adj[f] < cut:
            f += 1
        first[j] = f
        used[pool[f]] += weight[f]


def _price_arrays(q: PoolQ):
    """The per-job item ranges and contiguous arrays (with scratch space) that :func:`_price_picks` reads."""
    starts = np.flatnonzero(np.r_[True, q.job[1:] != q.job[:-1]])
    ends = np.r_[starts[1:], q.job.size]
    value = np.ascontiguousarray(q.value, np.float64)
    weight = np.ascontiguousarray(q.weight, np.int64)
    pool = np.ascontiguousarray(q.pool, np.int64)
    return starts, ends, value, weight, pool, np.empty(starts.size), np.empty(value.size), np.empty(q.capacity.size)


def lagrangian(q: PoolQ, iters: int = 80) -> tuple[float, np.ndarray, np.ndarray]:
    """``(best bound L(mu), its prices mu, the item each job picks at those prices)``.

    Every ``L(mu)`` with ``mu >= 0`` is an upper bound; the least one seen is kept with its picks. The
    prices searched: first one common price, by bisection on the total demand against the total
    capacity (from ``mu = 0`` every job wants its largest count: a plain subgradient step from there
    overshoots by several times the answer and spent most of its iterations coming back); then
    ``iters`` steps per pool against the sign of its subgradient (demand over capacity: raise the
    price), each pool's step growing 1.2x while its sign holds and halving when it flips -- a
    bisection on each pool's market-clearing price. Stops early when the prices satisfy
    complementary slackness (optimal for the relaxation) or no longer move."""
    P = q.capacity.size
    if q.job.size == 0:
        return 0.0, np.zeros(P), np.zeros(0, np.int64)
    starts, ends, value, weight, pool, top, adj, used = _price_arrays(q)
    cap = np.maximum(q.capacity.astype(np.float64), 1.0)
    total = float(q.capacity.sum())
    best: list = [math.inf, np.zeros(P), None]

    def at(mu):  # L(mu), kept if best; returns the subgradient per unit of capacity
        first = np.empty(starts.size, np.int64)
        _price_picks(starts, ends, value, weight, pool, mu, adj, top, first, used)
        L = float(top.sum() + mu @ q.capacity)
        if L < best[0]:
            best[:] = [L, mu.copy(), first]
        return (q.capacity - used) / cap

    def optimal(mu, g):  # complementary slackness: no pool over capacity, no priced pool under it
        return not (g < 0).any() and not ((mu > 0) & (g > 0)).any()

    mu = np.zeros(P)
    g = at(mu)
    if optimal(mu, g):
        return tuple(best)
    # one common price: bracket [0, hi] (at hi the total demand fits), then bisect
    pos = weight > 0
    hi = float(np.max(np.abs(value[pos]) / weight[pos])) if pos.any() else 1.0
    hi = hi if hi > 0 else 1.0
    for _ in range(64):
        at(np.full(P, hi))
        if used.sum() <= total:
            break
        hi *= 2.0
    span, lo = hi, 0.0
    while hi - lo > 1e-3 * span:
        m = 0.5 * (lo + hi)
        at(np.full(P, m))
        if used.sum() > total:
            lo = m
        else:
            hi = m
    # per pool: steps against the subgradient's sign, adapted per pool
    mu = np.full(P, hi)
    step = np.full(P, max(0.05 * hi, 1e-3 * span))
    prev = np.zeros(P)
    for _ in range(iters):
        g = at(mu)
        if optimal(mu, g):
            break
        sgn = np.sign(g)
        step = np.where(sgn * prev < 0, step * 0.5, np.where(sgn * prev > 0, step * 1.2, step))
        prev = sgn
        new = np.maximum(0.0, mu - step * sgn)
        if np.array_equal(new, mu):
            break
        mu = new
    return tuple(best)


def subgradient_prices(q: PoolQ, iters: int = 80) -> tuple[float, np.ndarray, np.ndarray]:
    """The same ``(bound, prices, picks)`` by plain projected subgradient steps from ``mu = 0`` (step
    ``2 / sqrt(t + 1)`` times the median value per GPU): :func:`allocate_pools` also tries its picks,
    so that the answer is never worse than this search's (the first one this module had)."""
    P = q.capacity.size
    if q.job.size == 0:
        return 0.0, np.zeros(P), np.zeros(0, np.int64)
    starts, ends, value, weight, pool, top, adj, used = _price_arrays(q)
    pos = q.weight > 0
    ratio = q.value[pos] / q.weight[pos]
    unit = float(np.median(np.abs(ratio))) if ratio.size else 1.0
    unit = unit if unit > 0 else 1.0
    mu = np.zeros(P)
    best = (math.inf, mu.copy(), None)
    cap = np.maximum(q.capacity.astype(np.float64), 1.0)
    for t in range(iters):
        first = np.empty(starts.size, np.int64)
        _price_picks(starts, ends, value, weight, pool, mu, adj, top, first, used)
        L = float(top.sum() + mu @ q.capacity)
        if L < best[0]:
            best = (L, mu.copy(), first)
        g = (q.capacity - used) / cap  # a subgradient of L, per unit of capacity
        if not (g < 0).any() and not ((mu > 0) & (g > 0)).any():
            break  # complementary slackness: these prices are optimal for the relaxation
        mu = np.maximum(0.0, mu - unit * 2.0 / math.sqrt(t + 1) * g)
    return best


def _assign(q: PoolQ, picks: np.ndarray) -> dict[int, int]:
    """Pool per job from the prices' picks. The admitted jobs' minimums are fitted: jobs with one pool
    first, then those with two, ..., each class in priority order, each in the pool the prices chose, else its witness, else
    any other with room; if that fails, the admission witnesses moved toward the prices' choice
    (:func:`_from_witness`)."""
    out = dict(zip(q.job[picks].tolist(), q.pool[picks].tolist(), strict=True))
    room = [int(c.capacity) for c in q.cands]
    P = len(room)
    # the most constrained first (jobs with one pool, then two, ...), each class in priority order
    npools = (q.minc > 0).sum(axis=1).tolist()
    order = sorted(q.witness, key=lambda j: (npools[j], j))
    minc = q.minc.tolist()
    for j in order:
        mj = minc[j]
        prefer = [out.get(j, q.witness[j]), q.witness[j]] + list(range(P))
        for i in prefer:
            if 0 < mj[i] <= room[i]:
                room[i] -= mj[i]
                out[j] = i
                break
        else:
            return _from_witness(q, out)
    return _fit_moves(q, out, room)


def _fit_moves(q: PoolQ, out: dict[int, int], room: list[int]) -> dict[int, int]:
    """Running jobs the prices send to another pool move there where their minimum fits in what is left
    (priority order; the minimum they held at home goes back to it), else stay home."""
    for j, h in sorted((q.home or {}).items()):
        want = out.get(j, h)
        if want == h:
            continue
        m = int(q.minc[j, want])
        if 0 < m <= room[want]:
            room[want] -= m
            room[h] += int(q.minc[j, h])
        else:
            out[j] = h
    return out


def _from_witness(q: PoolQ, prices: dict[int, int]) -> dict[int, int]:
    """The admission witnesses (feasible), then each admitted job moved to the pool the prices chose
    where its minimum fits in what is left there (priority order): every step stays feasible."""
    out = dict(prices)
    out.update(q.witness)
    moves = {j: prices.get(j, h) for j, h in (q.home or {}).items()}
    out.update(q.home or {})  # running jobs at home first: every step below stays feasible
    room = [int(c.capacity) for c in q.cands]
    for j, i in q.witness.items():
        room[i] -= int(q.minc[j, i])
    for j in sorted(q.witness):
        want, was = prices.get(j, q.witness[j]), out[j]
        if want != was and 0 < q.minc[j, want] <= room[want]:
            room[want] -= int(q.minc[j, want])
            room[was] += int(q.minc[j, was])
            out[j] = want
    # pools full of minimums: swap pairs of jobs that want each other's pool at the same minimum
    movers: dict[tuple[int, int, int], list[int]] = {}
    for j in sorted(q.witness):
        want, was = prices.get(j, out[j]), out[j]
        if want != was and q.minc[j, want] == q.minc[j, was]:
            movers.setdefault((was, want, int(q.minc[j, was])), []).append(j)
    for (p, r, m), js in movers.items():
        back = movers.get((r, p, m), [])
        while js and back:
            a, b = js.pop(0), back.pop(0)
            out[a], out[b] = r, p
    out.update(moves)
    return _fit_moves(q, out, room)


def _solve_pool(q: PoolQ, i: int, assign: np.ndarray, placement: bool, name: str):
    """Pool ``i``'s exact DP for the jobs assigned to it (``assign``: pool per problem job, -1 none);
    returns ``(its knapsack, the choice, its value)`` (:func:`_answers` turns the kept one into answers)."""
    c = q.cands[i]
    gj = q.dp_job[i]
    standing = np.asarray(q.standing, np.int64)
    take = (assign[gj] == i) & (standing[gj] > 0) if gj.size else np.zeros(0, bool)
    status = list(c.status)
    reasons = dict(c.reasons)
    dp_k = c.dp_jobs
    for p in np.flatnonzero(~take).tolist():
        k = int(dp_k[p])
        status[k] = NOT_ADMITTED
        reasons.setdefault(k, q.reasons.get(int(gj[p]), "in another pool"))
    # a REQUIRED job that was OPTIONAL in the pool's candidates: its minimum is reserved, its zero
    # choice dropped, its weights counted from its minimum
    st_k = np.asarray(c.status, np.int64)[dp_k] if dp_k.size else np.zeros(0, np.int64)
    req_opt = take & (st_k == OPTIONAL) & (standing[gj] == REQUIRED)
    lens = np.diff(c.offsets)
    pos = np.repeat(np.arange(lens.size), lens)
    counts = c.cols[0].astype(np.int64)
    s = np.where(q.minc[gj, i] > 0, q.sc[gj, i], 1.0) if gj.size else np.zeros(0)
    if gj.size and q.home:
        away = np.array([q.home.get(int(j), i) != i for j in gj.tolist()])
        s = np.where(away, s * q.move[gj], s)  # a running job's start here is a move: a restart
    # a running job admitted here that moved to another pool leaves its minimum here
    gone = (~take) & (st_k == ADMITTED) & (assign[gj] >= 0) if gj.size else np.zeros(0, bool)
    freed = int(q.minc[gj[gone], i].sum()) if gone.any() else 0
    keep_item = take[pos] & ~(req_opt[pos] & (counts == 0))
    if q.movable is not None:
        keep_item &= q.movable[i]
    flat = np.flatnonzero(keep_item)
    kp = pos[flat]
    kc = counts[flat]
    sc = np.where(kc > 0, s[kp], 1.0)
    values = c.values[flat] * sc
    n_kept = np.bincount(kp, minlength=lens.size)[take]
    offsets = np.zeros(n_kept.size + 1, np.int64)
    np.cumsum(n_kept, out=offsets[1:])
    base = np.zeros(lens.size, np.int64)
    ro = np.flatnonzero(req_opt)
    if ro.size:
        first = offsets[:-1][np.searchsorted(np.flatnonzero(take), ro)]
        base[ro] = kc[first]
        for k in dp_k[ro].tolist():
            status[k] = ADMITTED
    weights = np.where(req_opt[kp], kc - base[kp], c.weights[flat].astype(np.int64))
    keep_jobs = dp_k[take]
    capacity = int(c.capacity) + freed - int(base.sum())
    problem = c.problem
    if freed:  # the jobs that move away leave their nodes here free (placement replays from them)
        jobs = list(problem.jobs)
        for k in dp_k[gone].tolist():
            jobs[k] = _moved(jobs[k], jobs[k].model)
        problem = replace(problem, jobs=tuple(jobs))
    sub = replace(c, problem=problem, status=status, reasons=reasons, capacity=max(0, capacity),
                  dp_jobs=np.asarray(keep_jobs, np.int64), offsets=offsets, weights=weights, values=values,
                  cols=c.cols[:, flat] if flat.size else np.zeros((7, 0)), keep=c.keep[flat],
                  factor=c.factor[take], gross=c.gross[flat] * sc,
                  factor_up=None if c.factor_up is None else c.factor_up[take])
    if not keep_jobs.size:
        chosen = np.zeros(0, np.int64)
    elif placement:
        chosen = solve_placeable(sub, start_fills=1)  # pending jobs start on GPUs the repair left idle
    else:
        chosen = mckp(sub.offsets, sub.weights, sub.values, sub.capacity)[1]
    return sub, chosen, float(sub.values[chosen].sum()) if chosen.size else 0.0


def _solve_all(q: PoolQ, assign, placement, name, memo: dict | None = None):
    a = np.full(len(q.standing), -1, np.int64)
    for j, i in assign.items():
        a[j] = i
    a[np.asarray(q.standing, np.int64) == 0] = -1
    parts = []
    for i in range(len(q.cands)):
        key = (i, (a == i).tobytes())
        if memo is None or key not in memo:
            part = _solve_pool(q, i, a, placement, name)
            if memo is None:
                parts.append(part)
                continue
            memo[key] = part
        parts.append(memo[key])
    return parts, sum(p[2] for p in parts)


def _answers(parts, name: str):
    """Each pool's answer (sub-problem ids) for the jobs assigned to it."""
    return [build_allocation(sub, chosen, name, 0.0, sub.dp_jobs.tolist()) for sub, chosen, _ in parts]


def allocate_pools(problem: AllocationProblem, candidates, *, admission: str = "priority",
                   starvation_s: float = 3600.0, objective: str = "speedup", placement: bool = True,
                   name: str = "", enumerate_limit: int = 64, iters: int = 80) -> Allocation:
    """The multi-pool answer (module docstring); ``candidates`` as for :func:`build_q`."""
    t0 = time.perf_counter()
    q = build_q(problem, candidates, admission=admission, starvation_s=starvation_s, objective=objective)
    multi: dict[int, list[int]] = {}
    combos = 1.0
    if q.job.size:  # items are sorted by job, then pool: each (job, pool) is one run of items
        step = np.flatnonzero((q.job[1:] != q.job[:-1]) | (q.pool[1:] != q.pool[:-1])) + 1
        first = np.r_[0, step]
        pj, pp = q.job[first], q.pool[first]
        npools = np.bincount(pj, minlength=len(q.standing))
        several = npools[npools > 1]
        # Every factor is >= 2, so more than log2(limit) of them are past the limit: their product is not
        # taken (on 10,000 jobs in 8 pools it overflowed a float: a RuntimeWarning every allocation).
        fits = several.size <= math.log2(max(enumerate_limit, 1))
        combos = float(np.prod(several)) if fits else math.inf
        if combos <= enumerate_limit:
            for j, i in zip(pj.tolist(), pp.tolist(), strict=True):
                if npools[j] > 1:
                    multi.setdefault(j, []).append(i)
    searches = [subgradient_prices(q, iters=iters), lagrangian(q, iters=iters)]
    bound = min(x[0] for x in searches)
    picks = searches[0][2]
    if combos <= enumerate_limit:
        best, memo = None, {}
        fixed = {int(q.job[x]): int(q.pool[x]) for x in (picks.tolist() if picks is not None else [])}
        for choice in itertools.product(*multi.values()):
            assign = dict(fixed)
            assign.update(zip(multi, choice, strict=True))
            if not _min_fits(q, assign):
                continue
            allocs, obj = _solve_all(q, assign, placement, name, memo)
            if best is None or obj > best[1] + 1e-12:
                best = (allocs, obj, assign)
        allocs, obj, assign = best
        if not placement:
            bound = obj  # every assignment tried, each pool exact: Q's optimum
    else:  # each search's assignment (pools solved once per distinct set of jobs); the better answer
        best, memo = None, {}
        for _, _, picks in searches:
            assign = _assign(q, picks) if picks is not None else dict(q.witness)
            allocs, obj = _solve_all(q, assign, placement, name, memo)
            if best is None or obj > best[1] + 1e-12:
                best = (allocs, obj, assign)
        allocs, obj, assign = best
    if placement:
        allocs, obj, assign = _fill_pools(q, problem, allocs, obj, assign, name, memo)
    allocs = _answers(allocs, name)
    out: dict = {}
    for j, req in enumerate(problem.jobs):
        i = assign.get(j)
        if i is None or not q.standing[j]:
            out[req.job_id] = JobAllocation(req.job_id, 0, reason=q.reasons.get(j) or "pending: not started")
            continue
        a = allocs[i].jobs[req.job_id]
        pool = problem.pools[i].name
        why = a.reason + (f"; pool {pool}" if a.gpus else "")
        if a.gpus and q.home and q.home.get(j, i) != i:
            why = _move_reason(req, a, problem.pools[q.home[j]].name, pool, problem.node_size)
        there = dict(req.pool_models).get(pool) if a.gpus and req.pool_models else None
        if getattr(there, "provenance", None):  # where its speed on this type comes from (issue 23)
            why += f" (speed on {problem.pools[i].gpu_type}: {there.provenance})"
        if a.gpus and pool in req.unscaled_pools:
            why += f" (no {problem.pools[i].gpu_type} throughput data: its model unscaled)"
        out[req.job_id] = JobAllocation(a.job_id, a.gpus, a.nodes, a.batch, a.local_batch, a.accum,
                                        a.samples_per_s, why, pool if a.gpus else "")
    return Allocation(out, obj, time.perf_counter() - t0, name, bound=max(bound, obj))


def _move_reason(req, a: JobAllocation, home: str, pool: str, node_size: int) -> str:
    """A running job's move, as its owner reads it: from where and how many GPUs to where and how many,
    what its samples/s do by its models, then why this size there (the pool's own reason, whose
    "admitted" is the move's start there). A move to fewer GPUs that runs slower says its GPUs went to
    other jobs (found on Sia's cluster: "admitted: 2 GPUs" for a job moved off 16 T4s read as a start)."""
    was = current_samples_per_s(req, node_size)
    change = f": {pct(a.samples_per_s, was)}" if was and a.samples_per_s > 0 else ""
    if change and a.samples_per_s < was:
        change += ", its GPUs to higher-value jobs"
    there = a.reason.removeprefix("admitted: ")
    return (f"moved from {home} ({_plural(req.running_gpus)}) to {pool} ({_plural(a.gpus)}){change}, a restart; "
            f"there: {there}")


FILL_TRIES = 16  # re-solves at most per allocation (_fill_pools)


def _fill_pools(q: PoolQ, problem: AllocationProblem, parts, obj: float, assign: dict, name: str, memo: dict):
    """No GPU idle in one pool while a job that fits there waits for another (issue 23 item 7): the
    search assigns each pending job one pool, and where that pool has no place for it (its count fits,
    its nodes do not) the job waits while GPUs of another type it may use sit idle. Each such job, in
    priority order, is tried in each pool with spare GPUs its minimum fits on (its pool and that pool
    re-solved, :data:`FILL_TRIES` at most), and moved where the value of what places grows (found on Sia's
    cluster: 1-2 GPUs of the 8-GPU rtx nodes idle for minutes at a time while 1-GPU jobs waited)."""
    standing = np.asarray(q.standing, np.int64)

    def look(parts, assign):
        """(value of the starts and sizes that place, jobs started and placed, pools with spare GPUs)"""
        a = np.full(len(q.standing), -1, np.int64)
        for j, i in assign.items():
            a[j] = i
        value, started, spare = 0.0, set(), []
        for i, (sub, chosen, _) in enumerate(parts):
            if sub.dp_jobs.size:
                bad, _, free, _ = _replay(sub, chosen, fix=False)
                gj = q.dp_job[i]
                mine = gj[(a[gj] == i) & (standing[gj] > 0)] if gj.size else gj
                for p, (j, x) in enumerate(zip(mine.tolist(), chosen.tolist(), strict=True)):
                    if p in bad:
                        continue
                    value += float(sub.values[x])
                    if sub.cols[0, x] > 0:
                        started.add(int(j))
                left = int(sub.capacity - sub.weights[chosen].sum())
            else:
                free, left = start_map(sub.problem), int(q.cands[i].capacity)
            if left > 0:
                spare.append((i, left, free, sub.problem.node_size))
        return value, started, spare

    value, started, spare = look(parts, assign)
    tries = 0
    while spare and tries < FILL_TRIES:
        waiting = [j for j, r in enumerate(problem.jobs) if standing[j] and r.running_gpus <= 0 and j not in started]
        moved = False
        for j in waiting:
            for i, left, free, ns in spare:
                if not 0 < q.minc[j, i] <= left or assign.get(j) == i:
                    continue
                if not free.fits(*_shape(problem.jobs[j].spec, int(q.minc[j, i]), ns)):
                    continue
                trial = dict(assign)
                trial[j] = i
                if not _min_fits(q, trial):
                    continue
                tries += 1
                t_parts, t_obj = _solve_all(q, trial, True, name, memo)
                t_value, t_started, t_spare = look(t_parts, trial)
                # more jobs placed, else more value: a required job's minimum is worth 0 over its base
                if (len(t_started), t_value) > (len(started), value + 1e-12):
                    parts, obj, assign, moved = t_parts, t_obj, trial, True
                    value, started, spare = t_value, t_started, t_spare
                    break
                if tries >= FILL_TRIES:
                    break
            if moved or tries >= FILL_TRIES:
                break
        if not moved:
            break
    return parts, obj, assign


def _min_fits(q: PoolQ, assign: dict[int, int]) -> bool:
    need = Counter()
    for j, i in assign.items():
        if q.standing[j] == REQUIRED and j in q.witness:
            need[i] += int(q.minc[j, i])
        elif q.standing[j] == REQUIRED and q.home and j in q.home and i != q.home[j]:
            need[i] += int(q.minc[j, i])  # a move: its minimum there, and back at home
            need[q.home[j]] -= int(q.minc[j, q.home[j]])
    return all(need[i] <= int(q.cands[i].capacity) for i in need)
