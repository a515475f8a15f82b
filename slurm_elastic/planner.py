"""The planner: turn a policy's :class:`Allocation` into typed actions. Pure: no I/O, no clock.

The daemon and the simulator both run ``problem.build_problem -> policy.allocate -> planner.plan ->
enact.Enactor``; this module is the third step. Its input is the allocation, the elastic jobs as
``problem.build_problem`` classified them (pending / starting / running / in flight), the per-job
bookkeeping (:class:`JobBook`: last change, rescale count, decision sequence) and the time ``now``.

Rules, applied to each job of the problem in priority order:

1. **In flight** (a resize the enactor has started and not finished, or a job released with a decision
   that Slurm has not started yet): leave alone. Its GPUs count as committed at its target size.
2. **Running, same GPU count**: leave alone, even if the policy chose another batch. A batch-only change
   would cost a full restart that the policy did not weigh (its restart cost is charged on GPU changes).
3. **Running, policy gives 0 GPUs**: with ``allow_preemption`` a :class:`Preempt` (checkpoint, requeue,
   stay held); otherwise leave it running ("preemption is off") and keep its GPUs committed.
4. **Running, another GPU count**: a :class:`Resize`, unless the job changed less than ``cooldown_s``
   ago, or ``max_in_flight`` resizes are already under way (counting the ones planned in this cycle),
   or it is a grow whose throughput gain is below ``min_relative_gain`` (default 0: the policy already
   weighs the restart cost against the gain, so the planner adds no second threshold unless asked).
   **Stability guard**: nor while it has not reported a training step in its current start
   (``JobView.stepped is False``: admitted or resized, not yet training at that size), unless
   :func:`settle_s` passed since its last change: ``settle_per_restart`` (4) x its restart cost, within
   [``settle_min_s`` (60 s), ``settle_timeout_s`` (900 s)] (a job that never reports holds what it was
   admitted to about as long as an honest start takes, not 15 minutes).
   The cooldown is the minimum dwell on top of that.
   Shrinks are planned before grows, because they return GPUs; where ``max_in_flight`` then defers a
   grow and the GPUs a shrink returns would idle, that shrink is not made this cycle (:func:`plan`).
5. **Pending, policy gives k > 0**: a :class:`Start` at k GPUs.
6. **Running, its start cannot go on** (``JobView.restart``: its step ran out of memory at its batch):
   restarted now at the policy's choice (the learned batch limit is in its spec), even at the same GPU
   count, in cooldown or before its first step; with 0 GPUs a :class:`Preempt` (its tasks are gone).

Capacity gate: the planner never commits more GPUs than ``capacity``. Committed GPUs are those of
running jobs at their current size, plus in-flight jobs at their target. Shrinks are committed first
(freeing GPUs), then starts in priority order, then grows; an action that does not fit is left out
with the reason "waiting for GPUs". A policy whose allocation fits the capacity never hits the gate;
it matters when cooldowns or the in-flight limit defer a shrink that the policy counted on.

Placement order (issue 23 item 7): shrinks, then grows, then starts, the largest start first (best fit
decreasing: a 1-GPU start placed ahead of a 3-GPU one could take the node the 3 needed, and the GPU
left after them went to no job). A resize moves a job (it is requeued
and placed again), so the GPUs it leaves behind, and the ones a grow that cannot be placed does not take,
are free only after the resizes; starts placed before the grows could not use them (a 1-GPU start on a
whole free node broke a 3-node grow, so it waited while the GPU the grow left went to no job). Each start
therefore names the resizes of its plan it follows (``Start.after``) and the enactor releases it once they
are placed, so Slurm places it on the map the planner placed it on. Where the starts, placed now ahead of
the resizes as Slurm would place them at once, leave every resize placeable and the same free map, they
name none and are released at once (no wait for a checkpoint that has nothing to do with them).

Placement gate (when the driver passes ``node_free``, the free GPUs per node as Slurm reports them):
the planner places every action best-fit on that map, as Slurm would. A released job that Slurm has
not started (``starting``) keeps its place if it fits; if it does not fit and has waited
``start_timeout_s``, it is held again (:class:`Hold`) and goes back to pending, so that a job Slurm
cannot place (GPUs free in total but scattered over nodes) does not reserve GPUs forever. With several
pools its place is looked for only on the nodes it was pinned to (``JobView.start_nodes``), and a job that
does not fit there while the policy now puts it in another pool is held again at once, to start there. A start that
cannot be placed at the policy's k starts at the largest allowed k' < k that can be placed and runs the
same batch (``start_smaller``; off for gang-scheduled policies such as ``static``), else waits. A grow
or move that cannot be placed is tried again after the later grows and moves (one of them may leave the
node it needs), and if it still has no place is left for a later cycle (its GPUs go to the starts placed
after it) and named in ``Plan.blocked``, so that the cycle can solve again without it
(``enact.run_cycle``); so is a grow or move that ``max_in_flight`` defers (its GPUs would idle as
surely). A shrink always fits in the GPUs it frees. Moves between pools that each need the GPUs
another of them leaves (a cycle: a job on the A100s moved to the RTX nodes that a job moved to those
A100s holds) are made together: every member is requeued, each pinned to its new pool, so Slurm
starts each once the others have left; made only if all of them can be placed that way and the count
and ``max_in_flight`` take them all, with the reason "made with the moves that free its GPUs".

Placement: ``nodes`` and GPUs per node follow :meth:`ElasticSpec.placement` (k <= node size on one
node, larger k on whole nodes), unless the policy already gave a node count.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from slurm_elastic.policies.base import Allocation, JobAllocation
from slurm_elastic.spec import Decision

# Statuses of an elastic job, as problem.build_problem classifies them.
PENDING = "pending"  # held, waiting for the daemon to place it
STARTING = "starting"  # released with a decision; Slurm has not started it yet
RUNNING = "running"
IN_FLIGHT = "in_flight"  # a resize or preemption the enactor is carrying out


@dataclass(frozen=True)
class PlannerConfig:
    cooldown_s: float = 300.0  # minimum time between two rescales of one job
    max_in_flight: int = 8  # most resizes/preemptions under way at once
    min_relative_gain: float = 0.0  # grows below (1 + this) x current throughput are skipped
    allow_preemption: bool = False
    start_smaller: bool = True  # no placement at k: start at the largest placeable allowed k' < k
    start_timeout_s: float = 120.0  # a released job Slurm has not placed by then, and cannot, is held again
    settle_timeout_s: float = 900.0  # a job that never reports a step may be resized again after this
    # ... or sooner: after settle_per_restart x its restart cost (at least settle_min_s), so that a job that
    # never reports holds GPUs it was admitted to (all the free ones, with nothing measured) about as long
    # as an honest start of it takes, not 15 minutes, while others wait
    settle_per_restart: float = 4.0
    settle_min_s: float = 60.0


@dataclass(frozen=True)
class JobBook:
    """What the driver remembers about one job between cycles."""

    last_change_s: float | None = None  # when it was last started or resized
    rescales: int = 0
    seq: int = 0  # last decision sequence number written for it
    # Slurm's submit time before our first action on it: a requeue resets Slurm's SubmitTime (seen on
    # 22.05), and the job's age (Pollux's re-allocation factor) counts from its first submission
    submitted_s: float | None = None
    # the nodes its last start or resize excluded (ExcNodeList: the pin to a GPU type in a partition of
    # several, or nodes kept for a rigid job): Slurm will not place it there while it waits released
    excluded: tuple[str, ...] = ()


@dataclass(frozen=True)
class JobView:
    """One elastic job as the planner needs it (built by ``problem.build_problem``)."""

    job_id: int | str
    status: str  # PENDING, STARTING, RUNNING or IN_FLIGHT
    gpus: int = 0  # current (running) or committed (starting / in flight target) GPUs
    batch: int | None = None
    samples_per_s: float = 0.0  # current throughput, when known (for min_relative_gain)
    spec: object | None = None  # the ElasticSpec, for placement
    nodes: tuple[str, ...] = ()  # nodes it runs on (running / in flight)
    gpus_per_node: int = 0  # its GPUs on each of those nodes
    stepped: bool | None = None  # has it reported a training step in its current start? None: unknown
    partitions: tuple[str, ...] = ()  # the partitions it may run in (several pools: which to pin it to)
    # a released job (STARTING), several pools: the managed nodes the partition it was pinned to lets Slurm
    # start it on (None: any). Its placement is checked there, not on the pools it was not released to.
    start_nodes: frozenset[str] | None = None
    # why its current start cannot go on (its step ran out of memory at its batch, daemon/oom.py): it is
    # restarted now at the policy's choice, past cooldown, stability guard and the same-count rule
    restart: str = ""
    restart_below: int = 0  # ... the local batch that failed: a restart in the same pool must go below it
    restart_s: float | None = None  # its restart cost as the policy plans with it (measured, spec, default)
    restart_from: str = ""  # where that figure comes from: measured, spec or default; ",capped" when bounded


@dataclass(frozen=True)
class Start:
    job_id: int | str
    gpus: int
    nodes: int
    gpus_per_node: int
    decision: Decision
    reason: str = ""
    kind: str = "start"
    partition: str | None = None  # several pools: pin it to the chosen pool's partition and GPU type
    gpu_type: str | None = None
    exclude_nodes: tuple[str, ...] | None = None  # nodes kept for rigid jobs (set by enact; () clears)
    # the resizes of the same plan it is placed after (their GPUs may be the ones it gets): the enactor
    # releases it once none of them is in flight
    after: tuple[int | str, ...] = ()


@dataclass(frozen=True)
class Resize:
    job_id: int | str
    from_gpus: int
    gpus: int
    nodes: int
    gpus_per_node: int
    decision: Decision
    reason: str = ""
    kind: str = "resize"
    partition: str | None = None
    gpu_type: str | None = None
    exclude_nodes: tuple[str, ...] | None = None

    @property
    def is_shrink(self) -> bool:
        return self.gpus < self.from_gpus


@dataclass(frozen=True)
class Preempt:
    job_id: int | str
    from_gpus: int
    reason: str = ""
    kind: str = "preempt"


@dataclass(frozen=True)
class Hold:
    """Hold again a job released earlier that Slurm cannot place (it goes back to pending)."""

    job_id: int | str
    gpus: int = 0
    reason: str = ""
    kind: str = "hold"


@dataclass(frozen=True)
class Leave:
    job_id: int | str
    reason: str = ""
    kind: str = "leave"


Action = Start | Resize | Preempt | Hold | Leave


@dataclass(frozen=True)
class Plan:
    actions: tuple[Action, ...]
    committed_gpus: int  # GPUs committed once every planned action is done
    deferred: int = 0  # actions the policy wanted that the rules held back this cycle
    # running jobs whose grow or move found no place on the nodes, no GPUs by the count, or no resize slot
    # (max_in_flight) this cycle: the cycle may re-solve with them kept at their size (enact.run_cycle)
    blocked: frozenset = frozenset()

    def of_kind(self, kind: str) -> list[Action]:
        return [a for a in self.actions if a.kind == kind]

    @property
    def changes(self) -> list[Action]:
        return [a for a in self.actions if a.kind != "leave"]


@dataclass
class _Pending:
    view: JobView
    alloc: JobAllocation
    order: int = field(default=0)


def _decision(alloc: JobAllocation, view: JobView, node_size: int, seq: int) -> tuple[Decision, int, int]:
    k = alloc.gpus
    if alloc.nodes:
        nodes = alloc.nodes
    elif view.spec is not None:
        nodes, _ = view.spec.placement(k, node_size)
    else:
        nodes = 1 if k <= node_size else -(-k // node_size)
    if k % nodes:
        raise ValueError(f"job {view.job_id}: {k} GPUs do not split over {nodes} nodes")
    local = alloc.local_batch or (alloc.batch // (k * max(1, alloc.accum)) if alloc.batch else 0)
    batch = alloc.batch or local * k * max(1, alloc.accum)
    parts = view.partitions if len(view.partitions) > 1 and alloc.pool else ()  # it is pinned: keep the rest
    return Decision(gpus=k, nodes=nodes, batch=batch, local_batch=local, accum=max(1, alloc.accum), seq=seq,
                    parts=parts), nodes, k // nodes


class _Placer:
    """Best-fit placement on a map of free GPUs per node, the way the simulated Slurm places jobs."""

    def __init__(self, free: Mapping[str, int], node_size: int):
        self.free = dict(free)
        self.node_size = self.default_size = node_size
        self.only: frozenset[str] | None = None  # several pools: the nodes of the job's pool

    def scope(self, pool) -> None:
        """Place on ``pool``'s nodes (a policies.base.Pool), or anywhere (None)."""
        self.only = frozenset(n for n, _ in pool.node_capacity) if pool is not None else None
        self.node_size = (pool.node_size or self.default_size) if pool is not None else self.default_size

    def shape(self, v: JobView, k: int) -> tuple[int, int]:
        if v.spec is not None:
            try:
                return v.spec.placement(k, self.node_size)
            except ValueError:
                pass
        return (1, k) if k <= self.node_size else (-(-k // self.node_size), self.node_size)

    def take(self, nodes: int, gpn: int) -> list[str] | None:
        cands = sorted((f, n) for n, f in self.free.items() if f >= gpn and (self.only is None or n in self.only))
        if len(cands) < nodes:
            return None
        chosen = [n for _, n in cands[:nodes]]
        for n in chosen:
            self.free[n] -= gpn
        return chosen

    def give_back(self, names, gpn: int) -> None:
        for n in names:
            if n in self.free:
                self.free[n] += gpn

    def reserve(self, names, gpn: int) -> None:
        for n in names:
            if n in self.free:
                self.free[n] -= gpn


def plan(
    allocation: Allocation,
    jobs: Iterable[JobView],
    books: Mapping[int | str, JobBook],
    now: float,
    *,
    capacity: int,
    node_size: int,
    config: PlannerConfig = PlannerConfig(),
    node_free: Mapping[str, int] | None = None,
    pools: Iterable = (),
    urgent: Iterable[int | str] = (),
) -> Plan:
    """The actions that carry ``allocation`` out, under the rules in the module docstring.

    ``jobs`` are in priority order; a job missing from the allocation is left alone. ``node_free``
    (free GPUs per managed node now, as Slurm reports them) turns on the placement gate.

    No GPU is left idle by the order the rules run in (issue 23 item 7), so a pass that leaves GPUs
    uncommitted is followed by another (at most :data:`PASSES`, each kept when it commits more GPUs, or as
    many with fewer actions):

    * a start or grow the count gate turned away ("waiting for GPUs") while one counted ahead of it then
      found no placement: the next pass leaves the unplaceable one out of the count, so its GPUs go to
      the next job that places, and places it last, on what the others left, if the count still takes
      it (a guard: on Sia's cluster the idle cycles it was written for turned out to be moves, which the
      count now credits; see below);
    * a shrink made for a grow that ``max_in_flight`` deferred, whose GPUs would idle: not made (the
      lowest priority, on the nodes left idle, first), and its slot goes to the deferred grow (found on
      the simulator: 8 shrinks made, the grow they fed deferred, one GPU idle while 7 jobs that fitted
      waited).
    """
    views = list(jobs)
    kw = dict(capacity=capacity, node_size=node_size, config=config, node_free=node_free, pools=tuple(pools),
              urgent=frozenset(urgent))
    by = {v.job_id: v for v in views}
    prio = {v.job_id: i for i, v in enumerate(views)}
    keep: frozenset = frozenset()
    skip: frozenset = frozenset()
    best = _plan(allocation, views, books, now, keep=keep, skip=skip, **kw)
    for _ in range(PASSES - 1):
        idle = capacity - best.plan.committed_gpus
        if idle <= 0:
            break
        more_skip = best.unplaced if best.gated else frozenset()
        more_keep = set()
        if best.throttled:
            shrunk = [a for a in best.plan.actions if a.kind in ("resize", "preempt") and a.job_id not in kw["urgent"]
                      and not by[a.job_id].restart and (a.kind == "preempt" or a.is_shrink)]
            # the lowest priority first, and of those first the ones whose nodes are left with idle GPUs
            shrunk.sort(key=lambda a: (not any(best.free.get(n, 0) for n in (by[a.job_id].nodes or ())),
                                       -prio[a.job_id]))
            left = idle
            for a in shrunk:
                d = by[a.job_id].gpus - (a.gpus if a.kind == "resize" else 0)
                if 0 < d <= left:
                    more_keep.add(a.job_id)
                    left -= d
        if more_skip <= skip and more_keep <= keep:
            break
        keep, skip = keep | more_keep, skip | more_skip
        nxt = _plan(allocation, views, books, now, keep=keep, skip=skip, **kw)
        if nxt.plan.committed_gpus < best.plan.committed_gpus or (
                nxt.plan.committed_gpus == best.plan.committed_gpus and len(nxt.plan.changes) >= len(best.plan.changes)):
            break
        best = nxt
    return best.plan


PASSES = 3  # planning passes at most (plan)


@dataclass(frozen=True)
class _Pass:
    """One planning pass and what the next may change: the free map after it (empty without the node
    map), how many grows ``max_in_flight`` deferred, the starts and grows that found no placement, and
    whether the count turned one away."""

    plan: Plan
    free: dict
    throttled: int
    unplaced: frozenset
    gated: bool


def _plan(allocation: Allocation, views: list, books: Mapping[int | str, JobBook], now: float, *,
          capacity: int, node_size: int, config: PlannerConfig, node_free: Mapping[str, int] | None,
          pools: tuple, urgent: frozenset, keep: frozenset, skip: frozenset) -> _Pass:
    """:func:`plan`'s one pass; ``keep``: running jobs whose shrink or preemption is not made this cycle;
    ``skip``: starts and grows an earlier pass found no placement for, left out of the count."""
    actions: dict[int | str, Action] = {}
    committed = 0
    in_flight = 0
    shrinks: list[_Pending] = []
    grows: list[_Pending] = []
    starts: list[_Pending] = []
    late: list[_Pending] = []  # starts an earlier pass left out of the count (skip): placed last, if room is left
    waiting: list[JobView] = []
    flying: list[JobView] = []
    deferred = 0
    throttled = 0  # grows max_in_flight deferred
    unplaced: set = set()  # starts and grows that found no placement
    gated = False  # a start or grow the count turned away
    counted_out: list[_Pending] = []  # grows and moves the count turned away (for place_together)
    blocked: set = set()  # running jobs whose grow or move found no place, no GPUs by the count or no slot (Plan.blocked)
    placer = _Placer(node_free, node_size) if node_free is not None else None
    pool_by = {p.name: p for p in pools}  # several pools (issue 13): policies.base.Pool by name
    # urgent: jobs on GPUs reserved for a rigid job (pools.py): a shrink is not deferred
    for i, v in enumerate(views):
        a = allocation.jobs.get(v.job_id)
        if v.status in (IN_FLIGHT, STARTING):
            committed += v.gpus
            if v.status == IN_FLIGHT:
                in_flight += 1
                flying.append(v)
                actions[v.job_id] = Leave(v.job_id, "in flight")
            else:
                waiting.append(v)
                actions[v.job_id] = Leave(v.job_id, "starting")
            continue
        if v.status == RUNNING:
            committed += v.gpus
        if a is None:
            actions[v.job_id] = Leave(v.job_id, "not in the allocation")
            continue
        if v.status == PENDING:
            if a.gpus > 0 and v.job_id in skip:
                actions[v.job_id] = Leave(v.job_id, f"waiting for a placement of {a.gpus} GPUs")
                deferred += 1
                late.append(_Pending(v, a, i))
            elif a.gpus > 0:
                starts.append(_Pending(v, a, i))
            else:
                actions[v.job_id] = Leave(v.job_id, a.reason or "policy: not now")
            continue
        # running
        if v.restart:
            if a.gpus and v.restart_below and a.local_batch >= v.restart_below and not _moves(a, v, pool_by):
                # a policy that keeps the batch that failed (static, rigid) would restart it into the same error
                a = replace(a, gpus=0, reason=f"the policy keeps local batch {a.local_batch}")
            a = replace(a, reason=f"{v.restart}: restarted at local batch {a.local_batch}" if a.gpus else
                        f"{v.restart}: requeued and held, {a.reason or 'no GPUs for it now'}")
            # 0 GPUs: a Preempt, even with preemption off; a move to another pool needs GPUs there (a grow)
            (shrinks if a.gpus <= v.gpus and not _moves(a, v, pool_by) else grows).append(_Pending(v, a, i))
            continue
        moved = _moves(a, v, pool_by)
        if a.gpus == v.gpus and not moved:
            if a.reason and a.reason.startswith("kept"):
                why = a.reason  # the policy's own account (e.g. which size would pay but for the restart)
            elif a.batch == v.batch or not a.batch:
                why = "same GPU count"
            else:
                why = "same GPU count (batch-only change not worth a restart)"
            actions[v.job_id] = Leave(v.job_id, why)
            continue
        book = books.get(v.job_id, JobBook())
        if v.job_id in urgent and 0 < a.gpus < v.gpus:
            shrinks.append(_Pending(v, a, i))
            continue
        if book.last_change_s is not None and now - book.last_change_s < config.cooldown_s:
            actions[v.job_id] = Leave(v.job_id, f"cooldown ({now - book.last_change_s:.0f}s < {config.cooldown_s:.0f}s)")
            deferred += 1
            continue
        settle = settle_s(v, config)
        if v.stepped is False and (book.last_change_s is None or now - book.last_change_s < settle):
            actions[v.job_id] = Leave(v.job_id, f"stability: no step reported at {v.gpus} GPUs yet (held up to "
                                      f"{settle:.0f} s)")
            deferred += 1
            continue
        if v.job_id in keep and a.gpus < v.gpus and not moved:
            actions[v.job_id] = Leave(v.job_id, f"kept at {v.gpus} GPUs this cycle: a grow waits for a resize "
                                      f"slot (max_in_flight {config.max_in_flight}), so GPUs it gave up would idle")
            deferred += 1
            continue
        if a.gpus == 0:
            if not config.allow_preemption:
                actions[v.job_id] = Leave(v.job_id, "policy gave 0 GPUs but preemption is off")
                continue
            shrinks.append(_Pending(v, a, i))
            continue
        if a.gpus > v.gpus and config.min_relative_gain > 0 and v.samples_per_s > 0 and a.samples_per_s > 0:
            if a.samples_per_s < (1.0 + config.min_relative_gain) * v.samples_per_s:
                actions[v.job_id] = Leave(v.job_id, "gain below min_relative_gain")
                continue
        # a move to another pool (issue 23) needs GPUs there, as a grow does: planned with the grows
        if (a.gpus > v.gpus or moved) and v.job_id in skip:
            actions[v.job_id] = Leave(v.job_id, f"no placement for {a.gpus} GPUs")
            deferred += 1
            blocked.add(v.job_id)
            continue
        (shrinks if a.gpus < v.gpus and not moved else grows).append(_Pending(v, a, i))

    # Released jobs Slurm has not started: reserve their placement; one that has waited past the
    # timeout and cannot be placed now is held again, and its GPUs go back to the pool.
    # A job pinned to a pool where it no longer fits (a rigid job took the pool's GPUs between its release
    # and its start) while the policy now places it in another pool is held again at once: it starts there
    # next cycle instead of waiting, pinned, for the pool it was released to.
    if placer is not None:
        # A resize still in flight from an earlier cycle (its checkpoint outlasted the poll) has the GPUs
        # it had on Slurm's map, not its target: a grow's target is reserved here, or a start placed now
        # takes the GPUs it grows onto and the job, released, waits for a place (held again after
        # start_timeout_s). A shrink holds more than it will: nothing to add.
        for v in flying:
            if v.gpus <= 0 or v.nodes and v.gpus <= len(v.nodes) * v.gpus_per_node:
                continue  # a preemption (target 0) or a shrink: nothing to keep for it
            placer.give_back(v.nodes, v.gpus_per_node)
            if placer.take(*placer.shape(v, v.gpus)) is None:
                placer.reserve(v.nodes, v.gpus_per_node)  # no place for it now: its own at least
        for v in waiting:
            placer.only = v.start_nodes
            ex = books.get(v.job_id, JobBook()).excluded
            if ex:  # seen on the heterogeneous simulator: held a place on a type it was excluded from
                placer.only = frozenset(placer.free if placer.only is None else placer.only) - set(ex)
            n, g = placer.shape(v, v.gpus)
            if placer.take(n, g) is not None:
                continue
            book = books.get(v.job_id, JobBook())
            if book.last_change_s is not None and now - book.last_change_s >= config.start_timeout_s:
                committed -= v.gpus
                actions[v.job_id] = Hold(v.job_id, v.gpus, f"Slurm could not place {v.gpus} GPUs in "
                                         f"{now - book.last_change_s:.0f}s; held again")
            elif (elsewhere := _elsewhere(allocation.jobs.get(v.job_id), v, pool_by)) is not None:
                committed -= v.gpus
                actions[v.job_id] = Hold(v.job_id, v.gpus, f"no placement for {v.gpus} GPUs in the pool it was "
                                         f"released to; held again, to start in {elsewhere}")
        placer.only = None
    before = dict(placer.free) if placer is not None else None  # the map Slurm would place a start on now

    def take_slot(p: _Pending) -> bool:
        nonlocal in_flight, deferred
        if in_flight >= config.max_in_flight:
            actions[p.view.job_id] = Leave(p.view.job_id, f"max_in_flight ({config.max_in_flight}) reached")
            deferred += 1
            return False
        in_flight += 1
        return True

    def seq_of(v: JobView) -> int:
        return books.get(v.job_id, JobBook()).seq + 1

    def resize(p: _Pending, why: str) -> None:
        """Record ``p``'s grow or move: its decision at the node size of the pool the placer is scoped to,
        pinned to its pool."""
        v, a = p.view, p.alloc
        d, nodes, gpn = _decision(a, v, placer.node_size if placer is not None else node_size, seq_of(v))
        actions[v.job_id] = Resize(v.job_id, v.gpus, a.gpus, nodes, gpn, d, why, **_pin(a, v, pool_by))

    for p in shrinks:
        if not take_slot(p):
            continue
        v, a = p.view, p.alloc
        committed -= v.gpus - a.gpus
        if placer is not None:
            placer.give_back(v.nodes, v.gpus_per_node)
        if a.gpus == 0:
            actions[v.job_id] = Preempt(v.job_id, v.gpus, a.reason or "policy: preempt")
            continue
        if placer is not None:  # in its pool, as Slurm places it there (pinned: _pin); best fit over every
            placer.scope(pool_by.get(a.pool))  # pool put it on another type's node in the model only
        d, nodes, gpn = _decision(a, v, placer.node_size if placer is not None else node_size, seq_of(v))
        if placer is not None:
            placer.take(nodes, gpn)  # fits in the GPUs it frees
        actions[v.job_id] = Resize(v.job_id, v.gpus, a.gpus, nodes, gpn, d, a.reason or "policy: shrink",
                                   **_pin(a, v, pool_by))
    # Capacity in priority order (starts before grows); placement in execution order (grows, then starts).
    # A move to another pool gives back the GPUs it leaves before the starts are counted (found on Sia's
    # cluster: an 8-GPU start onto the node a moving job left was turned away by the count, and the
    # node idled): with the node map, a start counted on them whose move then cannot be made finds no
    # placement and is left, so nothing is committed twice.
    moving_out = sum(p.view.gpus for p in grows if _moves(p.alloc, p.view, pool_by)) if placer is not None else 0
    admitted: list[_Pending] = []
    for p in starts:
        if committed - moving_out + p.alloc.gpus > capacity:
            actions[p.view.job_id] = Leave(p.view.job_id, "waiting for GPUs")
            deferred += 1
            gated = True
            continue
        committed += p.alloc.gpus  # reserved here; what it is placed at is settled below
        admitted.append(p)
    def place_grow(p: _Pending) -> bool | None:
        """A grow or move: True made, False no placement on the map now, None turned away otherwise."""
        nonlocal committed, deferred, throttled, gated, in_flight
        v, a = p.view, p.alloc
        if committed + a.gpus - v.gpus > capacity:
            actions[v.job_id] = Leave(v.job_id, "waiting for GPUs")
            deferred += 1
            gated = True
            blocked.add(v.job_id)
            counted_out.append(p)
            return None
        if not take_slot(p):  # before the map: a deferred grow must not hold its target's GPUs there
            throttled += 1
            blocked.add(v.job_id)  # its GPUs would idle: the cycle may solve again without it
            return None
        if placer is not None:
            placer.scope(pool_by.get(a.pool))
            placer.give_back(v.nodes, v.gpus_per_node)
            n, g = placer.shape(v, a.gpus)
            if placer.take(n, g) is None:
                placer.reserve(v.nodes, v.gpus_per_node)
                actions[v.job_id] = Leave(v.job_id, f"no placement for {a.gpus} GPUs")
                deferred += 1
                unplaced.add(v.job_id)
                in_flight -= 1  # its slot back
                return False
        committed += a.gpus - v.gpus
        resize(p, a.reason or "policy: grow")
        return True

    # A grow that found no place may find one once a later move has left its nodes (found on Sia's
    # cluster: a move onto the T4s that a shrink and a lower-priority move were vacating was turned away,
    # and the GPUs those left idled for a cycle while a job waited): tried again while any is made.
    def deferred_back(p: _Pending) -> None:
        """Undo what turning ``p`` away counted, before it is tried again."""
        nonlocal deferred
        deferred -= 1
        unplaced.discard(p.view.job_id)
        blocked.discard(p.view.job_id)

    def retried(retry: list[_Pending]) -> list[_Pending]:
        """Try the grows and moves that found no place again while any is made; those still left."""
        while retry:
            left = []
            for p in retry:
                deferred_back(p)
                if place_grow(p) is False:
                    left.append(p)
            if len(left) == len(retry):
                break
            retry = left
        return retry

    def place_together(moves: list[_Pending]) -> set:
        """Moves between pools that each need GPUs another of them leaves (a cycle: A's new nodes are
        B's and B's are A's) are never placed one at a time. Place them as one: every member's nodes
        given back, each placed in its new pool; a member with no place even then is dropped and the
        rest tried again. Made only if the count and ``max_in_flight`` take them all; the ids made."""
        nonlocal committed, in_flight
        start = dict(placer.free)
        while len(moves) >= 2:
            placer.free = dict(start)
            for p in moves:
                placer.give_back(p.view.nodes, p.view.gpus_per_node)
            placed, left = [], []
            for p in moves:
                placer.scope(pool_by.get(p.alloc.pool))
                (placed if placer.take(*placer.shape(p.view, p.alloc.gpus)) is not None else left).append(p)
            if left:
                moves = placed
                continue
            grow = sum(p.alloc.gpus - p.view.gpus for p in moves)
            if committed + grow > capacity or in_flight + len(moves) > config.max_in_flight:
                break
            committed += grow
            in_flight += len(moves)
            for p in moves:
                deferred_back(p)
                placer.scope(pool_by.get(p.alloc.pool))
                resize(p, f"{p.alloc.reason or 'policy: move'}; made with the moves that free its GPUs")
            return {p.view.job_id for p in moves}
        placer.free = start
        return set()

    retry = retried([p for p in grows if place_grow(p) is False])
    if placer is not None and len(pool_by) > 1:
        # a cycle of moves (found on Sia's cluster, workload 7: a job on 7 A100s moved to 16 RTX GPUs held by
        # a job moved to those A100s; both 'no placement' for 25 minutes while GPUs idled)
        moving = [p for p in {p.view.job_id: p for p in (*retry, *counted_out)}.values()
                  if actions[p.view.job_id].kind == "leave" and _moves(p.alloc, p.view, pool_by)]
        moving.sort(key=lambda p: (-p.alloc.gpus, p.order))  # largest first, as the starts (best fit decreasing)
        if len(moving) >= 2 and (made := place_together(moving)):
            retry = retried([p for p in retry if p.view.job_id not in made])
    blocked |= {p.view.job_id for p in retry}
    resized = tuple(a.job_id for a in actions.values() if a.kind == "resize") if placer is not None else ()

    def start(p: _Pending, k: int) -> None:
        """Record ``p``'s start at ``k`` GPUs (the policy's count, or fewer that fit now at the same batch),
        released once the plan's resizes are placed."""
        v, a = p.view, p.alloc
        why = a.reason or "policy: start"
        if k != a.gpus:
            why = f"placement: {k} of the {a.gpus} GPUs the policy chose fit now"
            a = _at(a, v, k)
        d, nodes, gpn = _decision(a, v, placer.node_size if placer is not None else node_size, seq_of(v))
        actions[v.job_id] = Start(v.job_id, k, nodes, gpn, d, why, **_pin(a, v, pool_by), after=resized)

    for p in sorted(admitted, key=lambda p: -p.alloc.gpus):  # largest first: a 1-GPU start takes no node a larger one needs
        v, a = p.view, p.alloc
        k = a.gpus
        if placer is not None:
            placer.scope(pool_by.get(a.pool))
            k = _placeable(placer, v, a, config.start_smaller)
            if k == 0:
                committed -= a.gpus
                actions[v.job_id] = Leave(v.job_id, f"waiting for a placement of {a.gpus} GPUs")
                deferred += 1
                unplaced.add(v.job_id)
                continue
            committed -= a.gpus - k
        start(p, k)
    # Starts left out of the count are placed last, on what the others left, where the count still takes
    # them (found on Sia's cluster: a move the count turned away until a start was left out then vacated the
    # very node that start needed, and its GPU idled while the start waited)
    if placer is not None:
        for p in sorted(late, key=lambda p: -p.alloc.gpus):
            placer.scope(pool_by.get(p.alloc.pool))
            k = _placeable(placer, p.view, p.alloc, config.start_smaller, most=capacity - committed)
            if k == 0:
                continue
            committed += k
            deferred -= 1
            admitted.append(p)
            start(p, k)
    pool_of = {p.view.job_id: p.alloc.pool for p in (*shrinks, *grows, *admitted)}
    if resized and _same_map_now(before, placer, actions, views, pool_by, pool_of):
        for j, a in actions.items():  # placed now, they land where they would after the resizes: no wait
            if a.kind == "start":
                actions[j] = replace(a, after=())
    ordered = tuple(actions[v.job_id] for v in views if v.job_id in actions)
    # Execution order: holds, shrinks and preemptions first (they return GPUs), then grows, then starts
    # (released by the enactor once the resizes they follow are placed).
    rank = {"hold": 0, "preempt": 0, "resize": 1, "start": 3, "leave": 4}
    ordered = tuple(sorted(ordered, key=lambda x: rank[x.kind] + (1 if x.kind == "resize" and not x.is_shrink else 0)))
    return _Pass(Plan(actions=ordered, committed_gpus=committed, deferred=deferred,
                      blocked=frozenset(j for j in blocked if actions[j].kind == "leave")),
                 placer.free if placer is not None else {}, throttled, frozenset(unplaced), gated)


def settle_s(v: JobView, config: PlannerConfig) -> float:
    """How long the stability guard holds a job that has not reported a step since its last change:
    ``settle_per_restart`` x its restart cost, at least ``settle_min_s``, at most ``settle_timeout_s``.
    An honest start reaches its first step in about one restart cost (the same imports, rendezvous and
    checkpoint load), so the margin keeps slow honest starts; a job that never reports is resized once
    the others need its GPUs after that time, not after settle_timeout_s."""
    if v.restart_s is None:
        return config.settle_timeout_s
    return min(config.settle_timeout_s, max(config.settle_min_s, config.settle_per_restart * v.restart_s))


def _same_map_now(before: dict, after: _Placer, actions: Mapping, views: list, pool_by: Mapping,
                  pool_of: Mapping) -> bool:
    """Would the plan's starts, released now (placed on ``before``, ahead of every resize, as Slurm would
    place them), leave every resize placeable and the same free map as placed after the resizes? Then they
    need not wait for the resizes' checkpoints (seconds to minutes live)."""
    starts = [a for a in actions.values() if a.kind == "start"]
    if not starts:
        return False
    t = _Placer(before, after.default_size)
    by = {v.job_id: v for v in views}
    for a in starts:
        t.scope(pool_by.get(pool_of.get(a.job_id)))
        if t.take(a.nodes, a.gpus_per_node) is None:
            return False
    for a in sorted((a for a in actions.values() if a.kind == "resize"), key=lambda a: not a.is_shrink):
        v = by[a.job_id]
        t.give_back(v.nodes, v.gpus_per_node)
        t.scope(pool_by.get(pool_of.get(a.job_id)))  # as placed above
        if t.take(a.nodes, a.gpus_per_node) is None:
            return False
    return t.free == after.free


def _moves(a: JobAllocation, v: JobView, pool_by: Mapping) -> bool:
    """Does the policy move running job ``v`` to another pool (another GPU type)? A restart there."""
    pool = pool_by.get(a.pool) if a.gpus > 0 else None
    if pool is None or not v.nodes:
        return False
    there = {n for n, _ in pool.node_capacity}
    return not set(v.nodes) <= there


def _elsewhere(a: JobAllocation | None, v: JobView, pool_by: Mapping) -> str | None:
    """The pool the policy now gives released job ``v`` when that pool is not among the nodes it was
    pinned to (``v.start_nodes``), else None."""
    pool = pool_by.get(a.pool) if a is not None and a.gpus > 0 else None
    if pool is None or v.start_nodes is None:
        return None
    return None if {n for n, _ in pool.node_capacity} <= v.start_nodes else pool.name


def _pin(a: JobAllocation, v: JobView, pool_by: Mapping) -> dict:
    """The partition and GPU type that pin a job to the pool the policy chose (several pools only):
    the first of the job's partitions that the pool is in, and the pool's GPU type."""
    pool = pool_by.get(a.pool)
    if pool is None:
        return {}
    part = target = next((p for p in v.partitions if p in pool.partitions), None)
    if part is not None and v.partitions == (part,):
        part = None  # already its only partition
    # Issue 23: the job's gres stays as submitted (Slurm 22.05 never retypes a typed request: the job would
    # be trapped on its first type). Where the partition holds one GPU type, the partition pins the type;
    # where it holds several, the nodes of its other pools are excluded (ExcNodeList). Either moves the job
    # on 22.05 and 24.11 alike, at its next start.
    if target is None:
        return {"partition": part, "gpu_type": pool.gpu_type or None}
    others = tuple(sorted(n for q in pool_by.values() if q.name != pool.name and target in q.partitions
                          for n, _ in q.node_capacity))
    if not others or {q.gpu_type for q in pool_by.values() if target in q.partitions} == {pool.gpu_type}:
        return {"partition": part, "gpu_type": None}
    return {"partition": part, "gpu_type": None, "exclude_nodes": others}


def _placeable(placer: _Placer, v: JobView, a: JobAllocation, smaller: bool, most: int | None = None) -> int:
    """The GPU count to start at: the policy's if it can be placed, else (with ``smaller``) the largest
    allowed count below it that can be placed and runs the same batch; 0 if none. ``most``: the most GPUs
    it may take (what the count leaves)."""
    if most is None or a.gpus <= most:
        n, g = placer.shape(v, a.gpus)
        if placer.take(n, g) is not None:
            return a.gpus
        most = a.gpus - 1
    if not smaller or v.spec is None or most <= 0:
        return 0
    batch = a.batch
    for k in sorted((c for c in v.spec.allowed_gpu_counts(placer.node_size, most=most)), reverse=True):
        if batch and v.spec.split_batch(k, batch) is None:
            continue
        n, g = placer.shape(v, k)
        if placer.take(n, g) is not None:
            return k
    return 0


def _at(a: JobAllocation, v: JobView, k: int) -> JobAllocation:
    """The allocation ``a`` moved to ``k`` GPUs at the same global batch."""
    local, accum = v.spec.split_batch(k, a.batch) if a.batch else (a.local_batch, a.accum)
    return replace(a, gpus=k, nodes=0, local_batch=local, accum=accum, samples_per_s=0.0)


def update_books(
    books: Mapping[int | str, JobBook], done: Iterable[Action], now: float,
    submitted: Mapping[int | str, float] | None = None,
) -> dict[int | str, JobBook]:
    """New bookkeeping after ``done`` actions were carried out (or begun) at ``now``. Pure.
    ``submitted``: each job's submit time as Slurm showed it before these actions; a job's first action
    keeps it (the requeue of a resize resets Slurm's)."""
    out = dict(books)
    for a in done:
        b = out.get(a.job_id, JobBook())
        if b.submitted_s is None and submitted and a.job_id in submitted:
            b = replace(b, submitted_s=float(submitted[a.job_id]))
        if isinstance(a, (Start, Resize)) and a.exclude_nodes is not None:  # None: as it was; (): cleared
            b = replace(b, excluded=tuple(a.exclude_nodes))
        if isinstance(a, Start):
            out[a.job_id] = replace(b, last_change_s=now, seq=a.decision.seq)
        elif isinstance(a, Resize):
            out[a.job_id] = replace(b, last_change_s=now, seq=a.decision.seq, rescales=b.rescales + 1)
        elif isinstance(a, Preempt):
            out[a.job_id] = replace(b, last_change_s=now, rescales=b.rescales + 1)
        elif isinstance(a, Hold):
            out[a.job_id] = replace(b, last_change_s=now)
    return out
