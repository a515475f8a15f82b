"""``gavel``: Gavel's heterogeneity-aware max-min fairness (Narayanan et al., OSDI'20), rigid sizes.

Gavel does not resize jobs: each runs at the GPUs and batch it asked for, and the scheduler chooses
*where* (which GPU type) and *when*. Every round (``round_s``, 360 s as in Sia's comparison) it
solves the max-min fairness LP over time fractions ``X[j, type]``:

    maximise t  s.t.  sum_type X[j, type] x tput[j, type] / tput_eq[j] >= t   (every job j)
                      sum_type X[j, type] <= 1,   sum_j k_j X[j, type] <= GPUs of the type

with ``tput[j, type]`` the job's throughput at its size on that type (``JobRequest.pool_models``:
the per-type tables; a job with none has its own model in every pool) and ``tput_eq[j]`` its
throughput on a capacity-weighted mix of the types (Gavel's normalisation). Then, round-based,
jobs get GPUs in decreasing priority ``X[j, type] / (share of its time it has run on that type)``,
at most one type each, while their GPUs fit on the nodes. Between rounds running jobs keep their
GPUs and pending jobs start on idle GPUs in the same priority (Gavel waits for the round; starting
at once only helps it). A running job not chosen at a round is preempted (the planner checkpoints,
requeues and holds it); it can only be re-placed in its own pool while it runs, so a move between
types is a preemption and a later start elsewhere.

State (the policy object's, pure otherwise): the time each job has run per pool, the last LP's
fractions, and a clock advanced by the jobs' ages between calls. Not Gavel's code: no space
sharing, no lease extension beyond "a chosen running job keeps its GPUs", an LP solved by scipy.
"""

from __future__ import annotations

import math
import time

import numpy as np

from slurm_elastic.policies.base import Allocation, AllocationProblem, JobAllocation, Policy, number_option


def _size_batch(req) -> tuple[int, int]:
    if req.running_gpus > 0:
        return req.running_gpus, req.running_batch or req.spec.requested_batch
    return req.spec.requested_gpus, req.spec.requested_batch


class GavelPolicy(Policy):
    name = "gavel"
    rigid = True
    preemptive = True

    def __init__(self, round_s: float = 360.0):
        self.round_s = number_option("round_s", round_s, low=0, open_low=True)
        self._clock = 0.0
        self._next_round = 0.0
        self._ages: dict = {}
        self._received: dict = {}  # job -> {pool: seconds run there}
        self._seen_s: dict = {}  # job -> seconds since first seen
        self._x: dict = {}  # (job, pool) -> LP time fraction

    # ---- the pools and each job's throughput there ----
    @staticmethod
    def _pools(problem: AllocationProblem):
        if problem.pools:
            return [(p.name, p.node_size or problem.node_size, list(p.node_capacity)) for p in problem.pools]
        caps = list(problem.node_capacity or ())
        if not caps:
            ns = max(1, problem.node_size)
            caps = [(f"n{i}", ns) for i in range(max(1, problem.total_gpus // ns))]
        return [("", problem.node_size, caps)]

    @staticmethod
    def _options(req, pools) -> dict:
        """pool -> (nodes, local, accum, samples/s) at the job's rigid size and batch."""
        k, b = _size_batch(req)
        split = req.spec.split_batch(k, b)
        out = {}
        if split is None:
            return out
        allowed = ((req.pool,) if req.running_gpus > 0 and req.pool else req.pools) or tuple(p[0] for p in pools)
        models = dict(req.pool_models)
        for name, size, caps in pools:
            if name not in allowed or k > sum(c for _, c in caps):
                continue
            try:
                nodes = req.spec.placement(k, size)[0]
            except ValueError:
                continue
            m = models.get(name, req.model)
            if m.max_gpus is not None and k > m.max_gpus:
                continue
            r = float(m.samples_per_s(k, nodes, split[0], split[1]))
            if r > 0 and math.isfinite(r):
                out[name] = (nodes, split[0], split[1], r)
        return out

    def _tick(self, problem: AllocationProblem) -> float:
        dts = [req.age_s - self._ages[req.job_id] for req in problem.jobs
               if req.age_s is not None and req.job_id in self._ages]
        dt = float(np.median(dts)) if dts else 0.0
        self._ages = {req.job_id: req.age_s for req in problem.jobs if req.age_s is not None}
        self._clock += max(0.0, dt)
        return max(0.0, dt)

    def _lp(self, problem, opts, pools) -> None:
        from scipy.optimize import linprog

        cap = {name: sum(c for _, c in caps) for name, _, caps in pools}
        total = sum(cap.values()) or 1
        pairs = [(j, p) for j, o in enumerate(opts) for p in o]
        self._x = {}
        if not pairs:
            return
        m = len(pairs)
        c = np.zeros(m + 1)
        c[-1] = -1.0  # maximise t
        rows, rhs = [], []
        for j, o in enumerate(opts):
            if not o:
                continue
            eq = sum(r * cap[p] / total for p, (_, _, _, r) in o.items())
            row = np.zeros(m + 1)
            for i, (jj, p) in enumerate(pairs):
                if jj == j:
                    row[i] = -o[p][3] / eq
            row[-1] = 1.0
            rows.append(row)
            rhs.append(0.0)
            one = np.zeros(m + 1)
            one[[i for i, (jj, _) in enumerate(pairs) if jj == j]] = 1.0
            rows.append(one)
            rhs.append(1.0)
        for p in cap:
            row = np.zeros(m + 1)
            for i, (j, pp) in enumerate(pairs):
                if pp == p:
                    row[i] = _size_batch(problem.jobs[j])[0]
            rows.append(row)
            rhs.append(float(cap[p]))
        res = linprog(c, A_ub=np.array(rows), b_ub=np.array(rhs), bounds=[(0, 1)] * m + [(0, None)], method="highs")
        if res.status == 0:
            self._x = {(problem.jobs[j].job_id, p): float(res.x[i]) for i, (j, p) in enumerate(pairs)}

    def allocate(self, problem: AllocationProblem) -> Allocation:
        t0 = time.perf_counter()
        dt = self._tick(problem)
        pools = self._pools(problem)
        live = {req.job_id for req in problem.jobs}
        for d in (self._received, self._seen_s):
            for gone in set(d) - live:
                del d[gone]
        for req in problem.jobs:
            self._seen_s[req.job_id] = self._seen_s.get(req.job_id, 0.0) + dt
            if req.running_gpus > 0:
                rec = self._received.setdefault(req.job_id, {})
                rec[req.pool] = rec.get(req.pool, 0.0) + dt
        opts = [self._options(req, pools) for req in problem.jobs]
        new_round = self._clock >= self._next_round
        if new_round:
            self._lp(problem, opts, pools)
            self._next_round = self._clock + self.round_s

        def priority(req, p) -> float:
            x = self._x.get((req.job_id, p), 0.0)
            got = self._received.get(req.job_id, {}).get(p, 0.0) / max(self._seen_s.get(req.job_id, 0.0), 1.0)
            return x / got if got > 0 else (math.inf if x > 0 else 0.0) + x

        free = {name: dict(caps) for name, _, caps in pools}
        sizes = {name: size for name, size, _ in pools}
        out: dict = {}
        keep: set = set()
        for j, req in enumerate(problem.jobs):  # running jobs: kept between rounds, frozen ones always
            if req.running_gpus > 0 and (req.frozen or not new_round) and opts[j]:
                self._take_running(req, free)
                keep.add(j)
        pairs = sorted(((priority(req, p), -j, j, p) for j, req in enumerate(problem.jobs) if j not in keep
                        for p in opts[j]), reverse=True)
        if new_round:  # the round: GPU counts per pool in priority order; chosen running jobs stay put
            left = {name: sum(caps.values()) for name, caps in free.items()}
            chosen: set = set()
            for _, _, j, p in pairs:
                req = problem.jobs[j]
                k = _size_batch(req)[0]
                if j in chosen or k > left[p]:
                    continue
                chosen.add(j)
                left[p] -= k
            for j in sorted(chosen):
                req = problem.jobs[j]
                if req.running_gpus > 0:
                    keep.add(j)
                    self._take_running(req, free)
        for j in keep:
            req = problem.jobs[j]
            p = req.pool or next(iter(opts[j]))
            nodes, local, accum, r = opts[j][p]
            k, b = _size_batch(req)
            out[req.job_id] = JobAllocation(req.job_id, k, nodes, b, local, accum, r, "kept (rigid)", req.pool)
        for _, _, j, p in pairs:
            req = problem.jobs[j]
            if req.job_id in out or req.running_gpus > 0:
                continue
            nodes, local, accum, r = opts[j][p]
            k, b = _size_batch(req)
            if _fit(free[p], nodes, k // nodes, sizes[p]):
                out[req.job_id] = JobAllocation(req.job_id, k, nodes, b, local, accum, r,
                                                f"started on {p or 'the cluster'} (max-min share "
                                                f"{self._x.get((req.job_id, p), 0.0):.2f})", p)
        for j, req in enumerate(problem.jobs):
            if req.job_id not in out:
                why = ("preempted: its round went to jobs with a higher max-min priority" if req.running_gpus > 0
                       else "pending: no pool fits its requested size" if not opts[j]
                       else "pending: its GPUs went to jobs with a higher max-min priority")
                out[req.job_id] = JobAllocation(req.job_id, 0, reason=why)
        ordered = {req.job_id: out[req.job_id] for req in problem.jobs}
        objective = min((self._x.get((req.job_id, a.pool), 0.0) for req in problem.jobs
                         if (a := ordered[req.job_id]).gpus > 0), default=0.0)
        return Allocation(ordered, objective, time.perf_counter() - t0, self.name)

    @staticmethod
    def _take_running(req, free, check: bool = False) -> bool:
        """Count a running job's GPUs on its nodes (``check``: only say whether they are still free)."""
        pool = free.get(req.pool) if req.pool in free else next(iter(free.values()))
        g = req.gpus_per_node or req.running_gpus
        if not req.nodes:
            return True
        if check:
            return all(pool.get(n, 0) >= g for n in req.nodes)
        for n in req.nodes:
            pool[n] = pool.get(n, 0) - g
        return True


def _fit(free: dict, nodes: int, per_node: int, size: int) -> bool:
    """Best fit of ``nodes`` x ``per_node`` GPUs on a pool's free map; takes them when it fits."""
    cands = sorted((f, n) for n, f in free.items() if f >= per_node)
    if len(cands) < nodes:
        return False
    for f, n in cands[:nodes]:
        free[n] = f - per_node
    return True
