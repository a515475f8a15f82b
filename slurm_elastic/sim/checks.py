"""Per-cycle checks of what a policy and the planner left undone (issue 23 item 7; item 5's bound).

Two questions the simulator asks after every cycle, from the cycle's own snapshot and plan:

* **idle while a job waits**: after every action of the cycle is carried out, are GPUs left idle (not
  held, not committed to an in-flight change) on which a pending job that was not started could be
  placed at its smallest allowed count? Counted per cycle (``idle_wait_cycles``). With several pools
  (GPU types), in one pool the job may use: a job runs on one type, so idle GPUs of two do not add up.
* **held at a wrong size**: a running job left at its size while the GPUs left idle would, by its own
  measured model, speed it up by more than twice what the restart costs over its true remaining life
  (``(n / c) x (1 - 2 x restart_s / life) > 1``); with several pools, growing in its own pool or moving
  to another it may use (its model for that type). Jobs held so for longer than ``bound_s`` are counted
  (``held_wrong_jobs``), with the longest such hold (``held_wrong_max_s``).

Pure functions of a cycle plus a small accumulator; the engine keeps one per run.
"""

from __future__ import annotations

import numpy as np

from slurm_elastic.planner import PENDING, RUNNING, STARTING, _Placer

HELD_WRONG_BOUND_S = 1800.0


def _free_after(res) -> tuple[_Placer, int]:
    """The free map after the cycle's actions in the order they are placed (starts released at once first, then
    shrinks, grows, and the starts that follow them: ``Start.after``), and the GPUs not committed."""
    snap, plan = res.snapshot, res.plan
    placer = _Placer(snap.node_free, snap.node_size)
    views = {v.job_id: v for v in snap.views}
    acts = {a.job_id: a for a in plan.actions}
    for v in snap.views:
        a = acts.get(v.job_id)
        if v.status == STARTING and (a is None or a.kind != "hold"):
            placer.take(*placer.shape(v, v.gpus))
    def rank(a) -> int:  # a start that follows the resizes is placed after them, one that does not, first
        if a.kind == "start":
            return 4 if a.after else 1
        return {"preempt": 0, "hold": 0, "resize": 2}.get(a.kind, 9) + (1 if a.kind == "resize" and not a.is_shrink
                                                                          else 0)
    order = sorted(plan.actions, key=rank)
    for a in order:
        v = views.get(a.job_id)
        if v is None:
            continue
        if a.kind in ("preempt", "resize"):
            placer.give_back(v.nodes, v.gpus_per_node)
        if a.kind in ("resize", "start"):
            placer.take(a.nodes, a.gpus_per_node)
    return placer, snap.capacity - plan.committed_gpus


def idle_waiting(res) -> list:
    """Pending jobs not started this cycle that fit, at their smallest allowed count, in what is left idle
    in one pool they may use (a job runs on one GPU type: idle GPUs of two pools do not add up)."""
    placer, idle = _free_after(res)
    if idle <= 0:
        return []
    acts = {a.job_id: a for a in res.plan.actions}
    reqs = {r.job_id: r for r in res.snapshot.problem.jobs}
    out = []
    for v in res.snapshot.views:
        a = acts.get(v.job_id)
        if v.status != PENDING or v.spec is None or (a is not None and a.kind == "start"):
            continue
        req = reqs.get(v.job_id)
        for pool in job_pools(req, res.snapshot.problem):
            placer.scope(pool)
            spec = (req.spec_in(pool.name) if pool is not None else None) or v.spec
            counts = spec.allowed_gpu_counts(placer.node_size, most=idle)
            if counts and _fits(placer, v, counts[0]):
                out.append(v.job_id)
                break
        placer.scope(None)
    return out


def job_pools(req, problem) -> list:
    """The pools (``policies.base.Pool``) a job may run in, the one it runs in first; ``[None]`` (anywhere)
    where the problem has one pool or the job is unknown."""
    pools = problem.pools
    if req is None or len(pools) <= 1:
        return [None]
    by = {p.name: p for p in pools}
    names = list(req.pools) if req.pools else list(by)
    if req.running_gpus > 0 and req.pool in by:
        names = [req.pool] + [n for n in names if n != req.pool]
    return [by[n] for n in names if n in by] or [None]


def held_wrong(res, remaining_s) -> list:
    """Running jobs left at their size whose measured gain on the idle GPUs pays twice its restart over
    ``remaining_s(job_id, rate)`` (the job's true remaining life at ``rate``; None: unknown, skipped).
    With several pools, the idle GPUs of the job's own pool (a grow), or of another pool it may use, by
    its model for that GPU type (a move: a restart too); never GPUs of two pools at once."""
    from slurm_elastic.policies._tables import current_samples_per_s, job_table, restart_s
    from slurm_elastic.profiles.goodput import efficiency_for_request

    placer, idle = _free_after(res)
    if idle <= 0:
        return []
    snap = res.snapshot
    acts = {a.job_id: a for a in res.plan.actions}
    reqs = {r.job_id: r for r in snap.problem.jobs}
    out = []
    for v in snap.views:
        a = acts.get(v.job_id)
        req = reqs.get(v.job_id)
        if v.status != RUNNING or req is None or (a is not None and a.kind != "leave") or not v.nodes:
            continue
        eff, key = efficiency_for_request(req)
        cur = current_samples_per_s(req, snap.node_size)
        if not cur or req.running_batch is None:
            continue
        c = cur * (float(eff(np.array([float(req.running_batch)]))[0]) if eff is not None else 1.0)
        best = 0.0
        placer.give_back(v.nodes, v.gpus_per_node)
        for pool in job_pools(req, snap.problem):
            placer.scope(pool)
            if pool is None:  # one pool: the whole map, a grow
                model, spec, lo = req.model, req.spec, v.gpus
            else:  # its own pool: a grow; another: a move, at any count
                model, spec = req.model_in(pool.name), req.spec_in(pool.name) or req.spec
                lo = v.gpus if pool.name == req.pool else 0
            t = job_table(model, spec, placer.node_size, snap.capacity, None, eff, key)
            for i, k in enumerate(t.counts.tolist()):
                if lo < k <= lo + idle and _fits(placer, v, k):
                    best = max(best, float(t.value[i]))
        placer.scope(None)
        placer.reserve(v.nodes, v.gpus_per_node)
        life = remaining_s(v.job_id, c)
        if best > c and life is not None and life > 0 and best / c * (1.0 - 2.0 * restart_s(req) / life) > 1.0:
            out.append(v.job_id)
    return out


def _fits(placer: _Placer, v, k: int) -> bool:
    """Could ``v`` be placed at ``k`` GPUs on the map (the map is left as it was)?"""
    saved = dict(placer.free)
    ok = placer.take(*placer.shape(v, k)) is not None
    placer.free = saved
    return ok


class CycleChecks:
    """What the checks found over a run: cycles with an idle GPU while a fitting job waited, and jobs held
    at a wrong size for longer than ``bound_s``."""

    def __init__(self, bound_s: float = HELD_WRONG_BOUND_S):
        self.bound_s = bound_s
        self.idle_wait_cycles = 0
        self.since: dict = {}
        self.longest: dict = {}

    def cycle(self, res, now: float, remaining_s) -> None:
        if idle_waiting(res):
            self.idle_wait_cycles += 1
        wrong = set(held_wrong(res, remaining_s))
        for j in list(self.since):
            if j not in wrong:
                del self.since[j]
        for j in wrong:
            t0 = self.since.setdefault(j, now)
            self.longest[j] = max(self.longest.get(j, 0.0), now - t0)

    def summary(self) -> dict:
        return {"idle_wait_cycles": self.idle_wait_cycles,
                "held_wrong_jobs": sum(1 for s in self.longest.values() if s > self.bound_s),
                "held_wrong_max_s": max(self.longest.values(), default=0.0)}
