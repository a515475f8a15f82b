"""Helpers shared by the simulator tests: a linear throughput model and a toy equal-share policy.

The toy policy exists only to test the engine, planner and enactor without depending on the real
policies' choices; tests of the real path use ``slurm_elastic.policies.get_policy``.
"""

from __future__ import annotations

from slurm_elastic.policies.base import Allocation, AllocationProblem, JobAllocation, Policy
from slurm_elastic.profiles.base import ThroughputModel
from slurm_elastic.sim.workloads import WorkloadJob
from slurm_elastic.spec import ElasticSpec


class LinearModel(ThroughputModel):
    """``per_gpu`` samples/s per GPU at any per-GPU batch: step time = local_batch / per_gpu."""

    def __init__(self, per_gpu: float = 100.0):
        self.per_gpu = per_gpu

    def step_time(self, gpus, nodes, local_batch):
        return local_batch / self.per_gpu, 0.0


class EqualShare(Policy):
    """Split the capacity evenly over the jobs (largest allowed count <= share, at least 1), in order, while GPUs last."""

    name = "toy-equal-share"

    def allocate(self, problem: AllocationProblem) -> Allocation:
        n = len(problem.jobs)
        share = max(1, problem.total_gpus // n) if n else 0
        free = problem.total_gpus
        out = {}
        for j in problem.jobs:
            b = j.spec.requested_batch
            counts = [k for k in j.spec.allowed_gpu_counts(problem.node_size)
                      if k <= min(share, free) and j.spec.split_batch(k, b) is not None]
            k = max(counts) if counts else 0
            free -= k
            if k:
                local, accum = j.spec.split_batch(k, b)
                out[j.job_id] = JobAllocation(j.job_id, k, batch=b, local_batch=local, accum=accum,
                                              samples_per_s=j.model.samples_per_s(k, 1, local, accum))
            else:
                out[j.job_id] = JobAllocation(j.job_id, 0)
        return Allocation(out, policy=self.name)


class Requested(Policy):
    """Start jobs FIFO at their requested GPUs while they fit; never resize (a toy 'static')."""

    name = "toy-requested"

    def allocate(self, problem: AllocationProblem) -> Allocation:
        free = problem.total_gpus - sum(j.running_gpus for j in problem.jobs)
        out = {}
        for j in problem.jobs:
            if j.is_running:
                out[j.job_id] = JobAllocation(j.job_id, j.running_gpus, batch=j.running_batch or 0)
                continue
            k, b = j.spec.requested_gpus, j.spec.requested_batch
            if k <= free:
                local, accum = j.spec.split_batch(k, b)
                out[j.job_id] = JobAllocation(j.job_id, k, batch=b, local_batch=local, accum=accum)
                free -= k
            else:
                out[j.job_id] = JobAllocation(j.job_id, 0)
        return Allocation(out, policy=self.name)


def toy_spec(min_gpus=1, max_gpus=4, batch=8, gpus=None, **kw) -> ElasticSpec:
    return ElasticSpec(min_gpus=min_gpus, max_gpus=max_gpus, min_batch=batch, max_batch=batch,
                       max_local_batch=batch, batch=batch, gpus=gpus, **kw)


def toy_job(name, arrival, total, **kw) -> WorkloadJob:
    return WorkloadJob(name=name, arrival_s=arrival, spec=toy_spec(**kw), total_samples=total)
