"""Placeable allocations: check an allocation against the nodes, the way the planner will place it.

The knapsack counts GPUs in a pool; Slurm places jobs on nodes (a job of k <= node size on one node,
larger ones on whole nodes, :meth:`ElasticSpec.placement`). :func:`place_check` replays the planner's
order on the per-node free map (kept and frozen jobs where they are, shrinks first, then starts in
priority order, then grows; best fit, fewest free GPUs first, as the planner and Slurm do) and returns,
for every job that cannot be placed, the largest count it could have at that point. The policy then
re-solves with those jobs capped (:func:`solve_placeable`), so what it returns can be carried out.
"""

from __future__ import annotations

import numpy as np

from slurm_elastic.policies._mckp import mckp

_MASKED = -1e30


def _shape(spec, k: int, ns: int) -> tuple[int, int]:
    try:
        return spec.placement(k, ns)
    except ValueError:
        return (1, k) if k <= ns else (-(-k // ns), ns)


class _Free:
    """Free GPUs per node, bucketed by free count. Best fit takes nodes from the fullest bucket that
    fits; which node of a bucket it takes does not change what fits later (nodes of equal free count
    are interchangeable), so this decides exactly as the planner's best fit, in O(node size) a take."""

    def __init__(self, free: dict[str, int], size: int):
        self.free = free
        self.size = size
        # dicts, not sets: insertion order makes the choice the same in every process (a set of strings
        # iterates in an order that depends on the per-process hash seed)
        self.buckets: list[dict] = [{} for _ in range(size + 1)]
        for n, f in free.items():
            self.buckets[min(max(f, 0), size)][n] = None

    def _move(self, n: str, f: int) -> None:
        old = self.free[n]
        self.buckets[min(max(old, 0), self.size)].pop(n, None)
        self.free[n] = f
        self.buckets[min(max(f, 0), self.size)][n] = None

    def fits(self, nodes: int, gpn: int) -> bool:
        return gpn <= self.size and sum(len(self.buckets[f]) for f in range(gpn, self.size + 1)) >= nodes

    def take(self, nodes: int, gpn: int) -> bool:
        if not self.fits(nodes, gpn):
            return False
        need = nodes
        for f in range(gpn, self.size + 1):
            while need and self.buckets[f]:
                n = next(iter(self.buckets[f]))
                self._move(n, f - gpn)
                need -= 1
            if not need:
                break
        return True

    def add(self, names, gpn: int, sign: int = 1) -> None:
        for n in names:
            if n in self.free:
                self._move(n, self.free[n] + sign * gpn)


def place_check(cand, chosen: np.ndarray) -> dict[int, int]:
    """``{position in the knapsack: largest placeable count}`` for the chosen counts that do not fit."""
    problem = cand.problem
    if problem.node_capacity is None:
        return {}
    ns = problem.node_size
    cap = dict(problem.node_capacity)
    free = _Free(cap, max(max(cap.values(), default=0), ns))
    jobs = problem.jobs
    for r in jobs:
        if r.running_gpus > 0 and r.nodes:
            free.add(r.nodes, r.gpus_per_node, -1)
    counts = cand.cols[0, chosen].astype(np.int64) if chosen.size else np.zeros(0, np.int64)
    shrinks, starts, grows = [], [], []
    for p, j in enumerate(cand.dp_jobs.tolist()):
        r = jobs[j]
        k = int(counts[p])
        if r.running_gpus > 0:
            if not r.nodes:  # released, not placed yet: it takes its place first
                free.take(*_shape(r.spec, r.running_gpus, ns))
            elif k < r.running_gpus:
                shrinks.append((p, r, k))
            elif k > r.running_gpus:
                grows.append((p, r, k))
        elif k > 0:
            starts.append((p, r, k))
    for _, r, k in shrinks:
        free.add(r.nodes, r.gpus_per_node)
        if k > 0:
            free.take(*_shape(r.spec, k, ns))
    bad: dict[int, int] = {}
    for p, r, k in starts:
        if not free.take(*_shape(r.spec, k, ns)):
            bad[p] = _largest(cand, p, free, r, ns, k, 0)
    for p, r, k in grows:
        free.add(r.nodes, r.gpus_per_node)
        if not free.take(*_shape(r.spec, k, ns)):
            bad[p] = _largest(cand, p, free, r, ns, k, r.running_gpus)
            if bad[p] == r.running_gpus:
                free.add(r.nodes, r.gpus_per_node, -1)  # stays where it is
            else:
                free.take(*_shape(r.spec, bad[p], ns))
    return bad


def _largest(cand, p: int, free: _Free, r, ns: int, k: int, floor: int) -> int:
    """The largest count below ``k`` in the job's choices that fits now (``floor`` if none)."""
    lo, hi = int(cand.offsets[p]), int(cand.offsets[p + 1])
    counts = sorted({int(c) for c in cand.cols[0, lo:hi] if floor < c < k}, reverse=True)
    for c in counts:
        if free.fits(*_shape(r.spec, c, ns)):
            return c
    return floor


def solve_placeable(cand, rounds: int = 4) -> np.ndarray:
    """The knapsack's choice, re-solved with unplaceable jobs capped at what fits, until it places."""
    values = cand.values
    _, chosen = mckp(cand.offsets, cand.weights, values, cand.capacity)
    for _ in range(rounds):
        bad = place_check(cand, chosen)
        if not bad:
            break
        if values is cand.values:
            values = values.copy()
        for p, cap in bad.items():
            lo, hi = int(cand.offsets[p]), int(cand.offsets[p + 1])
            c = cand.cols[0, lo:hi]
            over = c > cap
            over[0] = False  # the first choice (minimum or 0 GPUs) always stays
            values[lo:hi][over] = _MASKED
        _, chosen = mckp(cand.offsets, cand.weights, values, cand.capacity)
    return chosen
