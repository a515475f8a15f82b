"""``pollux-dp``: Pollux's scheduling objective (Qiao et al., OSDI'21), solved exactly by our DP.

Pollux maximises the p-norm (p = -1) of per-job goodput speedups, each relative to the job's goodput
at its fair share of the GPUs, with a penalty on re-allocations; it searches with a genetic algorithm
over placements. This peer keeps Pollux's objective and inputs -- goodput (throughput x statistical
efficiency from each job's noise scale), p = -1, speedup over the fair share, Pollux's re-allocation
factor ``(T - S d) / (T + d)`` (T the job's age, S its re-allocations, d the restart time) --
and solves it with the exact knapsack of ``dp`` plus the same placement re-solve. It is not Pollux's
code: no genetic algorithm, no interference avoidance; admission in priority order (a job at 0 GPUs
would make Pollux's objective -inf, so every job whose minimum fits runs, as in Pollux).
"""

from __future__ import annotations

import time

from slurm_elastic.policies._candidates import build_allocation, make_candidates
from slurm_elastic.policies._placement import solve_placeable
from slurm_elastic.policies.base import Allocation, AllocationProblem, Policy, number_option


class PolluxDPPolicy(Policy):
    name = "pollux-dp"

    def __init__(self, p: float = -1.0, starvation_s: float = 3600.0):
        self.p = number_option("p", p, high=0, open_high=True)  # negative: Pollux uses -1
        self.starvation_s = number_option("starvation_s", starvation_s, low=0, finite=False)

    def allocate(self, problem: AllocationProblem) -> Allocation:
        from slurm_elastic.profiles.goodput import efficiency_for_request

        if len(problem.pools) > 1:  # several pools (issue 13): policies/_multipool.py
            from slurm_elastic.policies._multipool import allocate_pools

            def joint(sub):
                return make_candidates(sub, admission="joint", starvation_s=float("inf"),
                                       efficiency=efficiency_for_request, objective="pnorm", p=self.p, fair_ref=True,
                                       realloc="pollux")
            return allocate_pools(problem, joint, starvation_s=self.starvation_s, objective="pnorm", name=self.name)
        t0 = time.perf_counter()
        cand = make_candidates(problem, starvation_s=self.starvation_s, efficiency=efficiency_for_request,
                               objective="pnorm", p=self.p, fair_ref=True, realloc="pollux")
        chosen = solve_placeable(cand)
        return build_allocation(cand, chosen, self.name, time.perf_counter() - t0)
