"""``static``: Slurm-like FIFO gang scheduling at the requested GPUs and batch, never resized.

Running jobs keep exactly what they run (GPUs and batch). Pending jobs start in priority order at
their requested GPU count (``spec.gpus``, else ``min_gpus``) and batch (``spec.batch``, else
``min_batch``) while that fits; the first pending job that does not fit blocks every later one
(strict FIFO, no backfill: without runtime limits Slurm's backfill cannot promise the head job its
start time). A job whose request is not runnable here (count not allowed by the node shape, or batch
not splittable over it) stays pending with that reason. The objective is ``dp``'s weighted speedup,
so the numbers compare.
"""

from __future__ import annotations

import time

from slurm_elastic.policies._tables import allowed_counts, current_samples_per_s, job_table
from slurm_elastic.policies.base import Allocation, AllocationProblem, JobAllocation, Policy


class StaticPolicy(Policy):
    name = "static"
    rigid = True

    def allocate(self, problem: AllocationProblem) -> Allocation:
        t0 = time.perf_counter()
        ns, cap = problem.node_size, problem.total_gpus
        free = cap
        out: dict = {}
        objective = 0.0
        blocker = None
        jobs = problem.jobs
        order = [j for j, r in enumerate(jobs) if r.is_running] + [j for j, r in enumerate(jobs) if not r.is_running]
        for j in order:
            req = jobs[j]
            spec = req.spec
            ref_t = job_table(req.model, spec, ns, cap)
            ref = float(ref_t.value[0]) if len(ref_t) else 0.0
            if req.is_running:
                k, b = req.running_gpus, req.running_batch or spec.requested_batch
            else:
                k, b = spec.requested_gpus, spec.requested_batch
            split = spec.split_batch(k, b)
            runnable = split is not None and k in allowed_counts(spec, ns, cap, req.model) and ref > 0
            if req.is_running and k <= free:
                free -= k
                sps = current_samples_per_s(req, ns) or 0.0
                nodes = _nodes(spec, k, ns)
                local, accum = split if split is not None else (b // k, 1)
                out[req.job_id] = JobAllocation(req.job_id, k, nodes, b, local, accum, sps, "kept (static)")
                objective += req.weight * sps / ref if ref > 0 else 0.0
                continue
            if req.is_running:
                out[req.job_id] = JobAllocation(req.job_id, 0, reason=f"stopped: running jobs exceed the {cap} GPUs")
                continue
            if not runnable:
                out[req.job_id] = JobAllocation(
                    req.job_id, 0, reason=f"pending: the request ({k} GPUs, batch {b}) cannot run here"
                )
                continue
            if blocker is not None:
                out[req.job_id] = JobAllocation(req.job_id, 0, reason=f"pending: FIFO behind job {blocker}")
                continue
            if k > free:
                blocker = req.job_id
                out[req.job_id] = JobAllocation(req.job_id, 0, reason=f"pending: needs {k} GPUs, {free} free")
                continue
            free -= k
            nodes = _nodes(spec, k, ns)
            local, accum = split
            sps = float(req.model.samples_per_s(k, nodes, local, accum))
            out[req.job_id] = JobAllocation(req.job_id, k, nodes, b, local, accum, sps, f"started: {k} GPU{'s' if k != 1 else ''} as requested")
            objective += req.weight * sps / ref
        ordered = {r.job_id: out[r.job_id] for r in jobs}
        return Allocation(ordered, objective, time.perf_counter() - t0, self.name)


def _nodes(spec, k, ns):
    try:
        return spec.placement(k, ns)[0]
    except ValueError:
        return -(-k // ns)
