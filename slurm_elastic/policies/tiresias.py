"""``tiresias``: Tiresias's discretized two-dimensional least-attained-service (2D-LAS), rigid.

Gu et al., NSDI'19. Jobs are never resized: each runs at its requested GPUs and batch. Priority is
attained service in GPU-seconds (GPUs x time run, the "2D" of 2D-LAS), discretized into queues by
``thresholds_gpu_s`` (default one threshold at 1 GPU-hour: Tiresias's two-queue setting; in a spec string
several as ``tiresias:thresholds_gpu_s=3600/36000``); within a
queue, first come first served. Every cycle the jobs are taken in that order and each gets its
requested size while it fits (a job that does not fit is passed, as Tiresias's placement does); a
running job that is not reached is preempted (checkpoint, requeue, hold): this policy needs the
planner's preemption. "Fits" is on the nodes when the problem gives them (``node_capacity``): the
order's choice is replayed the way the planner carries it out (preemptions free their nodes, then
starts in queue order, best fit, ``policies._placement``); a start that finds no placement is passed
and the order is taken again without it, so running jobs preempted only for it keep their GPUs and
later jobs may use what it would have had. Sizes and order stay Tiresias's; only what is placeable
starts. A job's size never changes, so there are no grow/shrink rescales, only
preemptions. The objective reported is ``dp``'s weighted speedup at the requested size.
"""

from __future__ import annotations

import time

from slurm_elastic.policies._placement import _shape, start_map
from slurm_elastic.policies._tables import allowed_counts, job_table
from slurm_elastic.policies.base import Allocation, AllocationProblem, JobAllocation, Policy, number_option


class TiresiasPolicy(Policy):
    name = "tiresias"
    rigid = True
    preemptive = True

    def __init__(self, thresholds_gpu_s: tuple[float, ...] = (3600.0,)):
        if isinstance(thresholds_gpu_s, (str, int, float)):  # "tiresias:thresholds_gpu_s=3600/36000"
            thresholds_gpu_s = str(thresholds_gpu_s).split("/")
        self.thresholds = tuple(sorted(number_option("thresholds_gpu_s", t, low=0, open_low=True)
                                       for t in thresholds_gpu_s))

    def _queue(self, attained: float) -> int:
        return sum(attained >= t for t in self.thresholds)

    def allocate(self, problem: AllocationProblem) -> Allocation:
        t0 = time.perf_counter()
        jobs = problem.jobs
        order = sorted(range(len(jobs)), key=lambda j: (self._queue(jobs[j].attained_gpu_s), j))
        passed: dict[int, str] = {}  # pending jobs with no placement on the nodes: passed
        while True:
            out, objective = self._las(problem, order, passed)
            unplaced = _unplaceable(problem, out)
            if not unplaced:
                break
            passed.update(unplaced)
        ordered = {r.job_id: out[r.job_id] for r in jobs}
        return Allocation(ordered, objective, time.perf_counter() - t0, self.name)

    def _las(self, problem: AllocationProblem, order: list[int], passed: dict[int, str]):
        """One pass of the 2D-LAS order over the GPU count; ``passed`` jobs stay pending."""
        ns, cap = problem.node_size, problem.total_gpus
        jobs = problem.jobs
        free = cap
        out: dict = {}
        objective = 0.0
        for j in order:
            req = jobs[j]
            spec = req.spec
            if req.is_running:
                k, b = req.running_gpus, req.running_batch or spec.requested_batch
            else:
                k, b = spec.requested_gpus, spec.requested_batch
            if j in passed:
                out[req.job_id] = JobAllocation(req.job_id, 0, reason=passed[j])
                continue
            if req.frozen and req.is_running:  # the planner will not touch it this cycle
                free -= k
            split = spec.split_batch(k, b)
            if split is None or k not in allowed_counts(spec, ns, cap, req.model):
                out[req.job_id] = JobAllocation(req.job_id, 0, reason=f"pending: the request ({k} GPUs, batch {b}) "
                                                                      "cannot run here")
                continue
            if not (req.frozen and req.is_running):
                if k > free:
                    verb = "preempted" if req.is_running else "pending"
                    out[req.job_id] = JobAllocation(req.job_id, 0, reason=f"{verb}: queue "
                                                    f"{self._queue(req.attained_gpu_s)}, {free} GPUs left")
                    continue
                free -= k
            nodes = spec.placement(k, ns)[0]
            local, accum = split
            sps = float(req.model.samples_per_s(k, nodes, local, accum))
            ref_t = job_table(req.model, spec, ns, cap)
            if len(ref_t) and ref_t.value[0] > 0:
                objective += req.weight * sps / float(ref_t.value[0])
            why = "kept (rigid)" if req.is_running else f"started: {k} GPUs as requested"
            out[req.job_id] = JobAllocation(req.job_id, k, nodes, b, local, accum, sps, why)
        return out, objective


def _unplaceable(problem: AllocationProblem, out: dict) -> dict[int, str]:
    """The pending jobs of ``out`` that the planner could not place: its order replayed on the per-node
    free map (running jobs where they are, released-but-unplaced ones first, preemptions free their
    nodes, then starts in queue order, best fit; as ``policies._placement._replay``). ``{}`` without
    node data."""
    if problem.node_capacity is None:
        return {}
    ns = problem.node_size
    fm = start_map(problem)
    starts = []
    for j, r in enumerate(problem.jobs):
        k = out[r.job_id].gpus
        if r.running_gpus > 0 and not r.nodes:
            fm.take(*_shape(r.spec, r.running_gpus, ns))
        elif r.running_gpus > 0 and k == 0:
            fm.add(r.nodes, r.gpus_per_node)
        elif r.running_gpus <= 0 and k > 0:
            starts.append((j, k))
    bad = {}
    for j, k in starts:
        n, g = _shape(problem.jobs[j].spec, k, ns)
        if fm.take(n, g) is None:
            bad[j] = f"pending: no placement for {k} GPUs ({n} node{'s' if n > 1 else ''} x {g}) on the free nodes"
    return bad
