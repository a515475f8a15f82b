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
    def __init__(self, free: dict[str, int]):
        self.free = free

    def take(self, nodes: int, gpn: int) -> bool:
        cands = sorted((f, n) for n, f in self.free.items() if f >= gpn)
        if len(cands) < nodes:
            return False
        for _, n in cands[:nodes]:
            self.free[n] -= gpn
        return True

    def add(self, names, gpn: int, sign: int = 1) -> None:
        for n in names:
            if n in self.free:
                self.free[n] += sign * gpn


def place_check(cand, chosen: np.ndarray) -> dict[int, int]:
    """``{position in the knapsack: largest placeable count}`` for the chosen counts that do not fit."""
    problem = cand.problem
    if problem.node_capacity is None:
        return {}
    ns = problem.node_size
    free = _Free(dict(problem.node_capacity))
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
    """The largest count below ``k`` in the job's choices that fits now (``floor`` if none); the free map
    is not changed."""
    lo, hi = int(cand.offsets[p]), int(cand.offsets[p + 1])
    counts = sorted({int(c) for c in cand.cols[0, lo:hi] if floor < c < k}, reverse=True)
    for c in counts:
        trial = _Free(dict(free.free))
        if trial.take(*_shape(r.spec, c, ns)):
            return c
    return floor


def solve_placeable(cand, rounds: int = 8) -> np.ndarray:
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
