"""``fixed-batch``: the paper's baseline -- elastic GPU count at the job's fixed requested batch.

Each job keeps the global batch it asked for (``spec.batch``, else ``min_batch``; a running job the
batch it runs); a GPU count is
allowed only if that batch splits over it (``batch % k == 0``, micro-batch within the per-GPU
limits, accumulation within ``max_accum``). Admission is the same as ``dp``'s. The GPUs left are
handed out greedily by marginal gain per GPU, as in Optimus (Peng et al., EuroSys'18): repeatedly
move the job whose next step (to any larger allowed count that still fits) adds the most value per
added GPU, until no GPU is left or no step gains. Values and restart costs are ``dp``'s, so the
objectives are comparable. Greedy is not exact: on non-concave profiles it can stop early. A job
whose count does not fit the nodes is lowered to one that does (``_placement.make_placeable``).
"""

from __future__ import annotations

import heapq
import time

import numpy as np

from slurm_elastic.policies._candidates import build_allocation, make_candidates
from slurm_elastic.policies._placement import make_placeable
from slurm_elastic.policies.base import Allocation, AllocationProblem, Policy, number_option


class FixedBatchPolicy(Policy):
    name = "fixed-batch"

    def __init__(self, starvation_s: float = 3600.0):
        self.starvation_s = number_option("starvation_s", starvation_s, low=0, finite=False)

    def allocate(self, problem: AllocationProblem) -> Allocation:
        t0 = time.perf_counter()
        plan = make_candidates(problem, fixed_batch=True, starvation_s=self.starvation_s)
        off, w, v = plan.offsets, plan.weights, plan.values
        n = plan.dp_jobs.size
        at = off[:-1].copy()  # current flat choice per job: its minimum
        free = plan.capacity

        def best_step(p):
            lo, hi = int(at[p]), int(off[p + 1])
            if hi - lo <= 1:
                return None
            dw = w[lo + 1:hi] - w[lo]
            ok = (dw > 0) & (dw <= free)
            if not ok.any():
                return None
            rate = np.where(ok, (v[lo + 1:hi] - v[lo]) / np.maximum(dw, 1), -np.inf)
            i = int(np.argmax(rate))
            return (float(rate[i]), lo + 1 + i) if rate[i] > 0 else None

        heap = []
        for p in range(n):
            s = best_step(p)
            if s is not None:
                heap.append((-s[0], p, s[1]))
        heapq.heapify(heap)
        while heap and free > 0:
            neg, p, target = heapq.heappop(heap)
            s = best_step(p)  # capacity may have shrunk since this entry was pushed
            if s is None:
                continue
            if s[1] != target or -neg != s[0]:
                heapq.heappush(heap, (-s[0], p, s[1]))
                continue
            free -= int(w[target] - w[at[p]])
            at[p] = target
            s = best_step(p)
            if s is not None:
                heapq.heappush(heap, (-s[0], p, s[1]))
        at = make_placeable(plan, at)
        return build_allocation(plan, at, self.name, time.perf_counter() - t0)
