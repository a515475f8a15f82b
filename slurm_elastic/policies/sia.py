"""``sia``: Sia's scheduling objective (Jayaram Subramanya et al., SOSP'23), solved by our optimizer.

Sia values every (job, GPU type, count) configuration at the job's goodput there, *normalised per
job* by its goodput in its slowest configuration (one GPU of its slowest type), and re-decides every
round across types, with a penalty on restarts. This peer keeps those inputs: goodput (throughput x
statistical efficiency), the per-type tables the problem carries (``JobRequest.pool_models``: a
``profiled`` run hands it every job's table on every type, as Sia's bootstrap measures them), the
per-job normalisation, Pollux's re-allocation factor ``(T - S d) / (T + d)`` as its restart
penalty, and solves it with the multi-pool optimizer (``policies/_multipool.py``: Lagrangian prices
on the pools, exact knapsack per pool, placement re-solve), as ``pollux-dp`` does for Pollux.

Differences from Sia's code (not copied): the sum of normalised goodputs is maximised (Sia's p = 1
setting; its default p-norm p = -0.5 is not expressible across pools by the shared optimizer, whose
p-norm values are per pool), no MIP solver, and a running job is re-placed only in its own pool
(the problem pins a running job to the pool of its nodes; moves go through a stop and a new start).

Normalisation across pools: the optimizer scales a job's value in pool p by ``ref_p / ref_best``
(its speed at its minimum there over its best pool it may use); the job's weight here multiplies that
by ``ref_best / ref_worst``, so a value is goodput over goodput at the minimum on the slowest type, as
Sia's. A running job sees only its pool; the rates seen while it was pending are remembered (state
keyed by job id, the only state this policy keeps).
"""

from __future__ import annotations

import time
from dataclasses import replace

from slurm_elastic.policies._candidates import build_allocation, make_candidates
from slurm_elastic.policies._placement import solve_placeable
from slurm_elastic.policies.base import Allocation, AllocationProblem, JobRequest, Policy, number_option


def _one_gpu_rate(req: JobRequest, model) -> float:
    """Samples/s on one GPU at the job's smallest per-GPU batch (the normalisation point)."""
    s = req.spec
    lb = max(1, min(s.max_local_batch or s.min_batch, max(s.min_local_batch or 1, s.min_batch)))
    try:
        r = float(model.samples_per_s(1, 1, lb, 1))
    except (ValueError, ZeroDivisionError):
        return 0.0
    return r if r > 0 else 0.0


class SiaPolicy(Policy):
    name = "sia"

    def __init__(self, starvation_s: float = 3600.0):
        self.starvation_s = number_option("starvation_s", starvation_s, low=0, finite=False)
        self._rates: dict = {}  # job id -> {pool: 1-GPU samples/s}, as seen when it could use every pool

    def _weights(self, problem: AllocationProblem) -> AllocationProblem:
        live = set()
        jobs = []
        for req in problem.jobs:
            live.add(req.job_id)
            models = dict(req.pool_models)
            names = req.pools or tuple(p.name for p in problem.pools)
            seen = {n: _one_gpu_rate(req, models.get(n, req.model)) for n in names}
            rates = self._rates.setdefault(req.job_id, {})
            if req.running_gpus <= 0:
                rates.update({n: r for n, r in seen.items() if r > 0})
            else:
                for n, r in seen.items():
                    rates.setdefault(n, r)
            worst = min((r for r in rates.values() if r > 0), default=0.0)
            here = max((r for n, r in seen.items() if r > 0), default=0.0)
            w = here / worst if worst > 0 and here > 0 else 1.0
            jobs.append(req if w == 1.0 else replace(req, spec=replace(req.spec, weight=req.spec.weight * w)))
        for gone in set(self._rates) - live:
            del self._rates[gone]
        return replace(problem, jobs=tuple(jobs))

    def allocate(self, problem: AllocationProblem) -> Allocation:
        from slurm_elastic.profiles.goodput import efficiency_for_request

        if len(problem.pools) > 1:
            from slurm_elastic.policies._multipool import allocate_pools

            def joint(sub):
                return make_candidates(sub, admission="joint", starvation_s=float("inf"),
                                       efficiency=efficiency_for_request, objective="speedup", realloc="pollux")
            return allocate_pools(self._weights(problem), joint, starvation_s=self.starvation_s,
                                  objective="speedup", name=self.name)
        t0 = time.perf_counter()
        cand = make_candidates(problem, starvation_s=self.starvation_s, efficiency=efficiency_for_request,
                               objective="speedup", realloc="pollux")
        chosen = solve_placeable(cand)
        return build_allocation(cand, chosen, self.name, time.perf_counter() - t0)
