"""Placeable allocations: replay an allocation on the nodes the way the planner will place it, and
make it placeable by construction.

The knapsack counts GPUs in a pool; Slurm places jobs on nodes (a job of k <= node size on one node,
larger ones on whole nodes, :meth:`ElasticSpec.placement`). :func:`_replay` carries out a choice on the
per-node free map in the planner's order (kept and frozen jobs where they are, released-but-unplaced
jobs first, then shrinks, then grows, then starts in priority order; best fit: the fewest free GPUs
first, then the node name, exactly as ``planner._Placer`` and the simulated Slurm do). Starts come last
(the enactor releases them once the cycle's resizes are placed): the GPUs a moved job leaves and those a
lowered grow does not take go to the starts, where before a start placed ahead of the grows could neither
use them nor fit without breaking a grow (issue 23 item 7: GPUs idle while a job that fitted waited).

Where some job does not fit at its turn, :func:`make_placeable` re-solves the knapsack once with those
jobs capped at what they fit at (so their GPUs go, exactly, where they are worth most), and then
:func:`repair` lowers every job that still does not fit to its best choice that fits *at that point of
the replay* and goes on: the repaired choice replays without a failure, so the planner carries out all
of it. Re-solving alone does not converge on a full, fragmented cluster (each re-solve hands the freed
GPUs to other counts that do not fit either: on the 10,000-job benchmark 12-21 jobs were still
unplaceable after 4 full re-solves, and 0.9-1.3% of dp's planned GPU time in the Pollux workloads).
Optional ``fills`` give the GPUs a repair leaves idle to larger counts that fit the free map left after
every action (a knapsack of capacity = the spare GPUs only); measured on the Pollux workloads it
raised rescales per job by 15-75% for no JCT gain, so the policies do not use it (docs/ALGORITHM.md).
Cost: one or two full solves and a few linear replays.
"""

from __future__ import annotations

import heapq

import numpy as np

from slurm_elastic.policies._mckp import mckp

_MASKED = -1e30


def _shape(spec, k: int, ns: int) -> tuple[int, int]:
    try:
        return spec.placement(k, ns)
    except ValueError:
        return (1, k) if k <= ns else (-(-k // ns), ns)


class _Free:
    """Free GPUs per node, bucketed by free count, each bucket a heap of node names. Best fit takes the
    nodes with the fewest free GPUs that fit, ties by name: the planner's ``sorted((free, name))``, in
    O(node size + log nodes) a take instead of a sort of every node."""

    def __init__(self, free: dict[str, int], size: int):
        self.free = dict(free)
        self.size = size
        self.count = [0] * (size + 1)
        self.heaps: list[list[str]] = [[] for _ in range(size + 1)]
        for n, f in self.free.items():
            b = f if 0 <= f <= size else (0 if f < 0 else size)
            self.count[b] += 1
            self.heaps[b].append(n)
        for h in self.heaps:
            heapq.heapify(h)

    def copy(self) -> _Free:
        new = object.__new__(_Free)
        new.free, new.size, new.count = dict(self.free), self.size, list(self.count)
        new.heaps = [list(h) for h in self.heaps]
        return new

    def _b(self, f: int) -> int:
        return f if 0 <= f <= self.size else (0 if f < 0 else self.size)

    def _move(self, n: str, f: int) -> None:
        old = self.free[n]
        self.free[n] = f
        s = self.size
        ob = old if 0 <= old <= s else (0 if old < 0 else s)
        nb = f if 0 <= f <= s else (0 if f < 0 else s)
        if ob != nb:
            self.count[ob] -= 1
            self.count[nb] += 1
            heapq.heappush(self.heaps[nb], n)  # the stale entry in ``ob`` is skipped when popped

    def fits(self, nodes: int, gpn: int) -> bool:
        return 1 <= gpn <= self.size and sum(self.count[gpn:]) >= nodes

    def fits_with(self, nodes: int, gpn: int, own, own_gpn: int) -> bool:
        """Would ``nodes x gpn`` fit once the job on ``own`` (``own_gpn`` GPUs each) gave them back?"""
        if not 1 <= gpn <= self.size:
            return False
        n = sum(self.count[gpn:])
        for x in own:
            f = self.free.get(x)
            if f is not None and f < gpn <= f + own_gpn:
                n += 1
        return n >= nodes

    def take(self, nodes: int, gpn: int) -> tuple[str, ...] | None:
        size, free = self.size, self.free
        if not 1 <= gpn <= size or sum(self.count[gpn:]) < nodes:
            return None
        got: list[str] = []
        for f in range(gpn, size + 1):
            h = self.heaps[f]
            while len(got) < nodes and h:
                n = heapq.heappop(h)
                x = free[n]
                if (x if 0 <= x <= size else (0 if x < 0 else size)) != f or n in got:
                    continue  # stale entry
                got.append(n)
            if len(got) == nodes:
                break
        for n in got:
            self._move(n, free[n] - gpn)
        return tuple(got)

    def add(self, names, gpn: int, sign: int = 1) -> None:
        for n in names:
            if n in self.free:
                self._move(n, self.free[n] + sign * gpn)


def _counts(cand, chosen: np.ndarray) -> np.ndarray:
    return cand.cols[0, chosen].astype(np.int64) if chosen.size else np.zeros(0, np.int64)


def start_map(problem) -> _Free:
    """The free map before this cycle's actions: node capacity less what running jobs hold (sized for
    the largest node, so a node freed whole keeps its count)."""
    free = dict(problem.node_capacity)
    for r in problem.jobs:
        if r.running_gpus > 0 and r.nodes:
            g = r.gpus_per_node
            for n in r.nodes:
                if n in free:
                    free[n] -= g
    return _Free(free, max(max(free.values(), default=0), problem.node_size,
                           max((c for _, c in problem.node_capacity), default=0)))


def _replay(cand, chosen: np.ndarray, fix: bool, start: _Free | None = None):
    """Carry ``chosen`` out in the planner's order (shrinks, grows, starts). Returns ``(bad, chosen, free, where)``: ``bad`` maps
    each position that did not fit to the flat choice it fits at (``fix``: ``chosen`` is changed to it
    and the replay goes on with it), ``free`` the map after every action, ``where[p]`` = (nodes, GPUs
    per node) the job holds after them."""
    problem = cand.problem
    ns = problem.node_size
    free = (start or start_map(cand.problem)).copy()
    jobs = problem.jobs
    chosen = chosen.copy() if fix else chosen
    counts = _counts(cand, chosen)
    where: dict[int, tuple[tuple[str, ...], int]] = {}
    shrinks, starts, grows = [], [], []
    for p, j in enumerate(cand.dp_jobs.tolist()):
        r = jobs[j]
        k = int(counts[p])
        if r.running_gpus > 0:
            if not r.nodes:  # released, not placed yet: it takes its place first
                n, g = _shape(r.spec, r.running_gpus, ns)
                where[p] = (free.take(n, g) or (), g)
            elif k < r.running_gpus:
                shrinks.append(p)
            elif k > r.running_gpus:
                grows.append(p)
            else:
                where[p] = (r.nodes, r.gpus_per_node)
        elif k > 0:
            starts.append(p)
    for p in shrinks:
        r = jobs[int(cand.dp_jobs[p])]
        free.add(r.nodes, r.gpus_per_node)
        k = int(counts[p])
        if k > 0:
            n, g = _shape(r.spec, k, ns)
            where[p] = (free.take(n, g) or (), g)  # fits in the GPUs it frees
    bad = _Bad()
    for p in grows:
        r = jobs[int(cand.dp_jobs[p])]
        free.add(r.nodes, r.gpus_per_node)
        n, g = _shape(r.spec, int(counts[p]), ns)
        got = free.take(n, g)
        if got is None:
            i = _best_fitting(cand, p, free, r, ns, int(counts[p]), r.running_gpus)
            bad[p] = i
            k = int(cand.cols[0, i])
            if not fix or k <= r.running_gpus:
                free.add(r.nodes, r.gpus_per_node, -1)  # stays where it is
                got, g = r.nodes, r.gpus_per_node
            else:
                n, g = _shape(r.spec, k, ns)
                got = free.take(n, g)
            if fix:
                chosen[p] = i
        where[p] = (got, g)
    stuck = []
    starts.sort(key=lambda p: -int(counts[p]))  # the planner's order: largest first, then priority
    for p in starts:
        r = jobs[int(cand.dp_jobs[p])]
        n, g = _shape(r.spec, int(counts[p]), ns)
        got = free.take(n, g)
        if got is None:
            i = _best_fitting(cand, p, free, r, ns, int(counts[p]), 0)
            bad[p] = i
            if fix:
                chosen[p] = i
                k = int(cand.cols[0, i])
                if k > 0:
                    n, g = _shape(r.spec, k, ns)
                    got = free.take(n, g)
                    if got is None:
                        stuck.append(p)  # no count of it fits (a start it must make: no 0 choice)
        if got:
            where[p] = (got, g)
    bad.stuck = len(stuck)
    return bad, chosen, free, where


class _Bad(dict):
    """``_replay``'s ``{position: choice it fits at}``; ``stuck``: starts no choice of which fits (``fix``)."""

    stuck = 0


def _repair(cand, chosen: np.ndarray, start: _Free | None = None):
    """``_replay`` with ``fix``, and where a start that must be made (its choices have no 0) fits at none of
    its counts after the grows, the grows capped at their running count, the last placed first (1, 2, 4, ...
    of them), until it fits: starts are placed after grows, so only a grow can make room for it."""
    out = _replay(cand, chosen, True, start)
    if not out[0].stuck:
        return out
    jobs = cand.problem.jobs
    grows = []
    for p, j in enumerate(cand.dp_jobs.tolist()):
        r = jobs[j]
        k = int(cand.cols[0, chosen[p]])
        if r.running_gpus > 0 and r.nodes and k > r.running_gpus:
            lo, hi = int(cand.offsets[p]), int(cand.offsets[p + 1])
            at = np.nonzero(cand.cols[0, lo:hi] == r.running_gpus)[0]
            if at.size:
                keep = at[cand.keep[lo + at]] if cand.keep[lo + at].any() else at
                grows.append((p, lo + int(keep[0])))
    n = 1
    while grows:
        capped = chosen.copy()
        for p, i in grows[-n:]:
            capped[p] = i
        out = _replay(cand, capped, True, start)
        if not out[0].stuck or n >= len(grows):
            break
        n *= 2
    return out


def _best_fitting(cand, p: int, free: _Free, r, ns: int, k: int, floor: int) -> int:
    """The flat index of the job's most valuable choice below ``k`` that fits now. ``floor`` (its running
    count, 0 for a start) always fits: it is where the job is. A running job's choices below its count
    are not considered (that would be a shrink, which the planner orders before every grow and start)."""
    lo, hi = int(cand.offsets[p]), int(cand.offsets[p + 1])
    c = cand.cols[0, lo:hi]
    v = cand.values[lo:hi]
    best, best_v = -1, -np.inf
    for i in range(hi - lo):
        ci = int(c[i])
        if not floor <= ci < k or v[i] <= best_v:
            continue
        if ci == floor or free.fits(*_shape(r.spec, ci, ns)):
            best, best_v = i, v[i]
    if best < 0:  # no choice at the floor (a running count outside the table): the closest below k
        below = np.nonzero(c < k)[0]
        best = int(below[np.argmax(c[below])]) if below.size else 0
    return lo + best


def place_check(cand, chosen: np.ndarray) -> dict[int, int]:
    """``{position in the knapsack: largest count it fits at}`` for the chosen counts that do not fit
    (empty: the planner can carry out every choice)."""
    if cand.problem.node_capacity is None or not chosen.size:
        return {}
    bad = _replay(cand, chosen, fix=False)[0]
    return {p: int(cand.cols[0, i]) for p, i in bad.items()}


def repair(cand, chosen: np.ndarray) -> np.ndarray:
    """``chosen`` with every job that does not fit at its turn lowered to its best choice that does."""
    if cand.problem.node_capacity is None or not chosen.size:
        return chosen
    return _repair(cand, chosen)[1]


def _fill(cand, chosen: np.ndarray, spare: int) -> np.ndarray | None:
    """Give ``spare`` GPUs to larger counts that fit the free map left after ``chosen``'s actions:
    an exact knapsack of capacity ``spare`` whose choices per job are its counts above the chosen one
    that can be placed on that map (giving back what the job holds). None: nothing to fill."""
    problem = cand.problem
    ns = problem.node_size
    _, _, free, where = _replay(cand, chosen, fix=False)
    if sum(free.count[1:]) == 0:
        return None
    jobs = problem.jobs
    offs, ws, vs, idx, pos = [0], [], [], [], []
    cw = cand.weights
    for p, j in enumerate(cand.dp_jobs.tolist()):
        hi = int(cand.offsets[p + 1])
        i0 = int(chosen[p])
        if i0 + 1 >= hi or cw[i0 + 1] - cw[i0] > spare:
            continue
        r = jobs[j]
        own, own_g = where.get(p, ((), 0))
        if r.running_gpus > 0 and r.nodes and int(cand.cols[0, i0]) < r.running_gpus:
            continue  # a shrink: grown back it would be another action; leave it
        row_w, row_v, row_i = [0], [0.0], [i0]
        v0 = cand.values[i0]
        for i in range(i0 + 1, hi):
            dw = int(cw[i] - cw[i0])
            if dw > spare:
                break
            if cand.values[i] <= v0:
                continue
            if free.fits_with(*_shape(r.spec, int(cand.cols[0, i]), ns), own, own_g):
                row_w.append(dw)
                row_v.append(float(cand.values[i] - v0))
                row_i.append(i)
        if len(row_w) > 1:
            ws += row_w
            vs += row_v
            idx += row_i
            offs.append(offs[-1] + len(row_w))
            pos.append(p)
    if not pos:
        return None
    _, pick = mckp(np.array(offs), np.array(ws), np.array(vs), spare)
    out = chosen.copy()
    out[np.array(pos)] = np.array(idx)[pick]
    return out


START_FILL_TRIES = 16  # starts tried by _start_fill (each try is one linear replay, ~10 ms at 1,000 jobs)
START_FILL_LARGE = 512  # beyond this many jobs, 2 tries (bench allocator's 1,000 jobs: +20 ms, not +170)


def _start_fill(cand, chosen: np.ndarray, tries: int | None = None) -> np.ndarray:
    """Start pending jobs on the GPUs the repair left idle: in order of the value of their start, each at
    its most valuable count within the spare GPUs whose whole choice still replays without a failure
    (starts are placed after every resize, in priority order: one must not take a node an earlier-placed
    start of lower priority counted on). No running
    job is restarted for them; a start always adds value, so no GPU is left idle while a job that fits
    waits (issue 23 item 7)."""
    spare = int(cand.capacity - cand.weights[chosen].sum())
    if spare <= 0:
        return chosen
    if tries is None:
        tries = START_FILL_TRIES if cand.dp_jobs.size <= START_FILL_LARGE else 2
    jobs = cand.problem.jobs
    pend = []
    for p, j in enumerate(cand.dp_jobs.tolist()):
        lo, hi = int(cand.offsets[p]), int(cand.offsets[p + 1])
        if jobs[j].running_gpus > 0 or int(cand.cols[0, chosen[p]]) > 0 or hi - lo < 2:
            continue
        gain = float(cand.values[lo + 1:hi].max() - cand.values[chosen[p]])
        if gain > 0:
            pend.append((-gain, p))
    pend.sort()
    out = chosen
    ns = cand.problem.node_size
    free = _replay(cand, out, fix=False)[2]  # the map after every action: a start must fit there too
    tried = 0
    for _, p in pend:
        lo, hi = int(cand.offsets[p]), int(cand.offsets[p + 1])
        i0 = int(out[p])
        r = jobs[int(cand.dp_jobs[p])]
        opts = [i for i in range(lo, hi) if cand.cols[0, i] > 0 and cand.weights[i] - cand.weights[i0] <= spare
                and cand.values[i] > cand.values[i0] and free.fits(*_shape(r.spec, int(cand.cols[0, i]), ns))]
        for i in sorted(opts, key=lambda i: -cand.values[i]):
            if tried >= tries:
                return out
            tried += 1
            trial = out.copy()
            trial[p] = i
            bad, _, after, _ = _replay(cand, trial, fix=False)
            if not bad:
                spare -= int(cand.weights[i] - cand.weights[i0])
                out, free = trial, after
                break
        if spare <= 0:
            break
    return out


RESOLVE_MAX_CELLS = 1 << 24  # jobs x capacity up to which a capped re-solve is tried (~50 ms of kernel)


def solve_placeable(cand, resolves: int | None = None, fills: int = 0, start_fills: int = 0) -> np.ndarray:
    """The knapsack's choice made placeable: one exact solve, then :func:`make_placeable`. By default
    one capped re-solve where the knapsack is small (``RESOLVE_MAX_CELLS``); on larger ones the repair
    alone (a re-solve costs a full solve, and on the 10,000-job benchmark it kept less value)."""
    _, chosen = mckp(cand.offsets, cand.weights, cand.values, cand.capacity)
    return make_placeable(cand, chosen, _resolves(cand) if resolves is None else resolves, fills,
                          start_fills=start_fills)


def _resolves(cand) -> int:
    return 1 if cand.dp_jobs.size * (cand.capacity + 1) <= RESOLVE_MAX_CELLS else 0


def make_placeable(cand, chosen: np.ndarray, resolves: int = 0, fills: int = 0, stats: dict | None = None,
                   start_fills: int = 0) -> np.ndarray:
    """Any policy's choice (flat indices, one per knapsack job) made placeable. Where some job does not
    fit: :func:`repair`; and up to ``resolves`` exact re-solves with the jobs that did not fit capped at
    the count they fit at (their larger choices masked, cumulatively), each repaired, the most valuable
    repaired answer kept; then, with ``start_fills``, :func:`_start_fill` (pending jobs start on the GPUs
    the repair left idle) and up to ``fills`` rounds of :func:`_fill` (each kept only when, repaired
    again, it is worth more)."""
    if cand.problem.node_capacity is None or not chosen.size:
        return chosen
    start = start_map(cand.problem)
    bad, best, _, _ = _repair(cand, chosen, start)
    seen = stats.setdefault("bad", []) if stats is not None else []
    seen.append(len(bad))
    if not bad:
        return chosen
    best_v = float(cand.values[best].sum())
    values = cand.values.copy()
    for _ in range(resolves):
        for p, i in bad.items():
            lo, hi = int(cand.offsets[p]), int(cand.offsets[p + 1])
            over = cand.cols[0, lo:hi] > cand.cols[0, i]
            over[0] = False  # the first choice (minimum or 0 GPUs) always stays
            values[lo:hi][over] = _MASKED
        _, chosen = mckp(cand.offsets, cand.weights, values, cand.capacity)
        bad, fixed, _, _ = _repair(cand, chosen, start)
        seen.append(len(bad))
        v = float(cand.values[fixed].sum())
        if v > best_v and not bad.stuck:  # the re-solve's GPUs may go to counts that do not fit either: keep the better
            best, best_v = fixed, v
        if not bad:
            break
    chosen = best
    if start_fills:
        chosen = _start_fill(cand, chosen)
    for _ in range(fills):
        spare = int(cand.capacity - cand.weights[chosen].sum())
        if spare <= 0:
            break
        filled = _fill(cand, chosen, spare)
        if filled is None:
            break
        filled = repair(cand, filled)
        if cand.values[filled].sum() <= cand.values[chosen].sum() + 1e-12:
            break
        chosen = filled
    return chosen


def placement_report(cand) -> dict:
    """What the placement step does on one instance (for the benchmark): jobs that do not fit after the
    pool-only solve and after the capped re-solve, jobs the repair lowers, and the share of the pool
    optimum's value kept."""
    _, chosen = mckp(cand.offsets, cand.weights, cand.values, cand.capacity)
    stats: dict = {}
    final = make_placeable(cand, chosen, _resolves(cand), 0, stats)
    bad = stats.get("bad") or [0]
    v0, v1 = float(cand.values[chosen].sum()), float(cand.values[final].sum())
    return {"unplaceable_after_solve": bad[0], "unplaceable_after_resolve": bad[1] if len(bad) > 1 else None,
            "repaired": bad[-1], "value_kept": v1 / v0 if v0 else 1.0,
            "unplaceable_after": len(place_check(cand, final))}
