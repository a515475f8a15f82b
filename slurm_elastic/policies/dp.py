"""``dp``: the paper's optimizer -- GPU count *and* global batch per job, exactly, every cycle.

After admission (see :mod:`slurm_elastic.policies._plan`), the GPUs left over are distributed by an
exact multiple-choice knapsack over every admitted job's allowed GPU counts, each at its best
batch ``b*(k)``: maximise the total weighted speedup, net of restart costs. The numba kernel is in
:mod:`slurm_elastic.policies._mckp`; the algorithm, its complexity and its memory are described in
docs/ALGORITHM.md.
"""

from __future__ import annotations

import time

from slurm_elastic.policies._mckp import mckp
from slurm_elastic.policies._plan import Plan, build_allocation, make_plan
from slurm_elastic.policies.base import Allocation, AllocationProblem, Policy


class DPPolicy(Policy):
    """Exact DP over (GPU count, batch) per job.

    ``admission``: ``"priority"`` (default; pending jobs get their minimum in priority order before
    optimising) or ``"joint"`` (the optimiser decides which pending jobs start). ``starvation_s``:
    a pending job blocked this long stops later jobs from passing it. ``objective``: ``"throughput"``
    (the paper's) or ``"goodput"`` (throughput x statistical efficiency, for profiles that have it).
    """

    name = "dp"

    def __init__(self, admission: str = "priority", starvation_s: float = 3600.0, objective: str = "throughput"):
        if objective not in ("throughput", "goodput"):
            raise ValueError(f"objective must be 'throughput' or 'goodput', not {objective!r}")
        self.admission = admission
        self.starvation_s = float(starvation_s)
        self.objective = objective

    def plan(self, problem: AllocationProblem) -> Plan:
        """Admission and the knapsack's choice arrays (the benchmark solves these with every solver)."""
        eff = None
        if self.objective == "goodput":
            from slurm_elastic.profiles.goodput import efficiency_for_request as eff
        return make_plan(problem, fixed_batch=False, admission=self.admission, starvation_s=self.starvation_s,
                         efficiency=eff)

    def allocate(self, problem: AllocationProblem) -> Allocation:
        t0 = time.perf_counter()
        plan = self.plan(problem)
        _, chosen = mckp(plan.offsets, plan.weights, plan.values, plan.capacity)
        return build_allocation(plan, chosen, self.name, time.perf_counter() - t0)
