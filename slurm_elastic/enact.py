"""Carry out the planner's actions through a :class:`SlurmBackend`, and the one cycle both drivers run.

Order of backend calls (the contract the daemon and the simulator share):

- **Start** a pending (held) job: ``update_job(gpus_per_node, num_nodes, start_now=True,
  admin_comment=decision)``, then ``release``.
- **Resize** a running job: ``signal(USR2)``; the job checkpoints and acknowledges; once
  :meth:`CheckpointAck.checkpoint_acked` says so, ``requeue_hold``, ``update_job(...)`` as for a
  start, ``release``. Until the ack comes the resize is *in flight* (:attr:`Enactor.in_flight`); a
  resize not acknowledged within ``ack_timeout_s`` is dropped, the job left running as it is, and the
  result says so.
- **Preempt**: as a resize, but after ``requeue_hold`` the job stays held (decision unchanged).
- **Hold**: ``hold`` a released job that Slurm could not place (it is pending again).
- A start that names resizes of its plan (``Start.after``: the planner placed it on the map they leave)
  is released once none of them is in flight, so that Slurm places it where the planner did; its result
  is "begun" until then. The next ``apply`` drops one still waiting (the new plan decides about the job).

A job slow to end (it acknowledged the stop but ignores TERM: Slurm waits KillWait before it kills
it) must delay only itself (issue 24 item 7): where the backend can, ``requeue_hold`` returns at once
(``wait=False``) and the resize stays in flight, *requeued*, until a later poll sees Slurm show the
job plain ``PENDING`` (the requeue done); only then ``update_job`` and ``release``. Each poll checks
every requeued job once and moves on, so other resizes, starts and the cycle never wait for it. The
journal's order is kept: the ``requeue_hold`` step is written before the call, ``update`` and
``release`` before theirs; a crash in between leaves the intent at ``requeue_hold``, which
:func:`slurm_elastic.daemon.journal.reconcile` finishes once the job is pending (not while it ends).

The enactor never blocks: :meth:`Enactor.apply` starts actions, :meth:`Enactor.poll` moves in-flight
resizes on (call it every few seconds in the daemon; the simulator calls it after every event). The
acknowledgement is an interface point: the simulated backend implements ``checkpoint_acked`` itself;
the real daemon will plug in the in-job library's ack (a later issue).

:func:`run_cycle` is the whole cycle ``list_jobs/list_nodes -> build_problem -> policy.allocate ->
planner.plan -> Enactor.apply``; the simulator calls exactly this function.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

from slurm_elastic import planner as pl
from slurm_elastic.backends.base import JobNotRequeueable, SlurmBackend, SlurmError
from slurm_elastic.claims import RESTART_CLAIM_MAX_S
from slurm_elastic.policies.base import Allocation, JobAllocation, Policy
from slurm_elastic.problem import ModelFor, Snapshot, SpecCache, build_problem


@runtime_checkable
class CheckpointAck(Protocol):
    def checkpoint_acked(self, job_id: int) -> bool:
        """True once the job has written its checkpoint after the USR2 it was sent."""


class Journal(Protocol):
    """Where a durable driver records each step *before* it is taken (the daemon: SQLite intents)."""

    def step(self, action: pl.Action, step: str) -> None:
        """About to take ``step`` ("signal", "requeue_hold", "hold", "update", "release") of ``action``."""

    def finish(self, action: pl.Action, status: str, message: str) -> None:
        """``action`` ended with ``status`` ("done", "timeout", "error")."""


@dataclass(frozen=True)
class ActionResult:
    action: pl.Action
    status: str  # "done", "begun" (resize waiting for its ack), "timeout", "error"
    message: str = ""
    at: float = 0.0


@dataclass
class _InFlight:
    action: pl.Resize | pl.Preempt
    signalled_at: float
    requeued_at: float | None = None  # driver clock when requeue_hold was sent (not waited for)
    requeued_wall: float = 0.0  # time.time() then: Slurm revokes the job's credentials for that second


class Enactor:
    """Turns actions into backend calls; keeps the resizes that wait for a checkpoint ack."""

    def __init__(
        self,
        backend: SlurmBackend,
        ack: CheckpointAck | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        ack_timeout_s: float = 300.0,
        signal: str = "USR2",
        journal: Journal | None = None,
        requeue_timeout_s: float = 600.0,
    ):
        self.backend = backend
        self.requeue_timeout_s = requeue_timeout_s
        if ack is None:
            if not isinstance(backend, CheckpointAck):
                raise TypeError("a backend without checkpoint_acked needs an explicit ack source")
            ack = backend
        self.ack = ack
        self.clock = clock
        self.ack_timeout_s = ack_timeout_s
        self.signal_name = signal
        self.in_flight: dict[int | str, _InFlight] = {}
        self.waiting: dict[int | str, pl.Start] = {}  # starts released once the resizes they follow are placed
        self.excluded: set[int | str] = set()  # jobs given an ExcNodeList for a rigid job (cleared later)
        self.log: list[ActionResult] = []
        self.journal = journal

    def _requeue_nowait(self) -> bool:
        """Can this backend's requeue_hold return before Slurm has finished the requeue?"""
        try:
            return "wait" in inspect.signature(self.backend.requeue_hold).parameters
        except (TypeError, ValueError):
            return False

    def _step(self, action, step: str) -> None:
        if self.journal is not None:
            self.journal.step(action, step)

    def adopt(self, action: pl.Resize | pl.Preempt, signalled_at: float) -> None:
        """Take over a resize that was signalled before a restart of the driver (crash recovery)."""
        self.in_flight[action.job_id] = _InFlight(action, signalled_at)

    def in_flight_targets(self) -> dict[int | str, int]:
        return {j: (f.action.gpus if isinstance(f.action, pl.Resize) else 0) for j, f in self.in_flight.items()}

    def _result(self, action, status, message="") -> ActionResult:
        r = ActionResult(action, status, message, self.clock())
        self.log.append(r)
        if self.journal is not None and status != "begun":
            self.journal.finish(action, status, message)
        return r

    def _place(self, a: pl.Start | pl.Resize) -> None:
        # One task per GPU: the job's task count follows its GPUs (srun inside inherits it).
        self._step(a, "update")
        self.backend.update_job(
            a.job_id,
            gpus_per_node=a.gpus_per_node,
            num_nodes=a.nodes,
            num_tasks=a.gpus,
            start_now=True,
            admin_comment=a.decision.to_admin_comment(),
            **{k: x for k in ("partition", "gpu_type", "exclude_nodes") if (x := getattr(a, k, None)) is not None},
        )
        self._step(a, "release")
        self.backend.release(a.job_id)

    def apply(self, actions: Iterable[pl.Action]) -> list[ActionResult]:
        out = []
        self.waiting.clear()  # a start still waiting from an earlier plan: this plan decides about its job
        for a in actions:
            if isinstance(a, pl.Leave):
                continue
            if a.job_id in self.in_flight:
                out.append(self._result(a, "error", "a resize of this job is already in flight"))
                continue
            try:
                if isinstance(a, pl.Start):
                    follows = [j for j in a.after if j in self.in_flight]
                    if follows:
                        self.waiting[a.job_id] = a
                        out.append(self._result(a, "begun", "released once the resizes of jobs "
                                                + ", ".join(map(str, follows)) + " are placed"))
                        continue
                    self._place(a)
                    out.append(self._result(a, "done"))
                elif isinstance(a, pl.Hold):
                    self._step(a, "hold")
                    self.backend.hold(a.job_id)
                    out.append(self._result(a, "done"))
                else:
                    # Never stop what cannot restart: Slurm refuses to requeue such a job, so after the
                    # signal it would checkpoint, stop and end FAILED. Checked on the job record before the signal.
                    job = self.backend.get_job(a.job_id)
                    if job is not None and not job.requeueable:
                        out.append(self._result(a, "error", "not requeueable (--no-requeue or JobRequeue=0): "
                                                            "not signalled, left at its size"))
                        continue
                    self._step(a, "signal")
                    try:
                        self.backend.signal(a.job_id, self.signal_name)
                    except SlurmError:
                        # Seen live (pyslurm, "Job/step already completing or completed"): the job ended
                        # between the cycle's read and the signal. Nothing to resize: not an error.
                        now_job = self.backend.get_job(a.job_id)
                        if now_job is None or not now_job.is_running or now_job.is_completing:
                            out.append(self._result(a, "skipped", "the job ended before the resize signal"))
                            continue
                        raise
                    self.in_flight[a.job_id] = _InFlight(a, self.clock())
                    out.append(self._result(a, "begun", f"sent {self.signal_name}, waiting for checkpoint"))
            except SlurmError as e:
                out.append(self._result(a, "error", str(e)))
        out.extend(self.poll())
        return out

    def _finish_requeued(self, job_id, f: _InFlight, now: float) -> ActionResult | None:
        """Place a job whose requeue_hold was sent, once Slurm shows the requeue done; None: not yet."""
        a = f.action
        job = self.backend.get_job(job_id)
        if job is None:
            del self.in_flight[job_id]
            return self._result(a, "error", "the job left the queue while being requeued")
        settled = job.is_requeued_settled and (self.backend.requeue_settles_at_once
                                               or time.time() - f.requeued_wall >= 1.05)
        if not settled:
            if now - f.requeued_at >= self.requeue_timeout_s:
                del self.in_flight[job_id]
                return self._result(a, "error", f"still {job.state} {now - f.requeued_at:.0f} s after "
                                                f"requeuehold; left held for the next cycles")
            return None
        del self.in_flight[job_id]
        if isinstance(a, pl.Resize):
            self._place(a)
        return self._result(a, "done")

    def poll(self) -> list[ActionResult]:
        """Finish every in-flight resize whose checkpoint is acknowledged; drop timed-out ones. A job whose
        requeue Slurm is still finishing is looked at once and left for the next poll."""
        out = []
        now = self.clock()
        for job_id in list(self.in_flight):
            f = self.in_flight[job_id]
            a = f.action
            if f.requeued_at is not None:
                try:
                    r = self._finish_requeued(job_id, f, now)
                except SlurmError as e:
                    self.in_flight.pop(job_id, None)
                    r = self._result(a, "error", str(e))
                if r is not None:
                    out.append(r)
                continue
            try:
                acked = self.ack.checkpoint_acked(job_id)
            except SlurmError as e:
                del self.in_flight[job_id]
                out.append(self._result(a, "error", str(e)))
                continue
            if not acked:
                if now - f.signalled_at >= self.ack_timeout_s:
                    del self.in_flight[job_id]
                    out.append(self._result(a, "timeout", f"no checkpoint ack in {self.ack_timeout_s:.0f}s; left running as it is"))
                continue
            try:
                self._step(a, "requeue_hold")
                if self._requeue_nowait():
                    self.backend.requeue_hold(job_id, wait=False)
                    f.requeued_at, f.requeued_wall = now, time.time()
                    r = self._finish_requeued(job_id, f, now)
                    if r is not None:
                        out.append(r)
                    continue
                del self.in_flight[job_id]
                self.backend.requeue_hold(job_id)
                if isinstance(a, pl.Resize):
                    self._place(a)
                out.append(self._result(a, "done"))
            except JobNotRequeueable as e:
                self.in_flight.pop(job_id, None)
                out.append(self._result(a, "error", f"not requeueable, left as it is: {e}"))
            except SlurmError as e:
                self.in_flight.pop(job_id, None)
                out.append(self._result(a, "error", str(e)))
        for job_id, a in list(self.waiting.items()):
            if any(j in self.in_flight for j in a.after):
                continue
            del self.waiting[job_id]
            try:
                self._place(a)
                out.append(self._result(a, "done"))
            except SlurmError as e:
                out.append(self._result(a, "error", str(e)))
        return out


@dataclass
class CycleState:
    """What a driver keeps between cycles: the planner's books and the spec cache."""

    books: dict[int | str, pl.JobBook] = field(default_factory=dict)
    spec_cache: SpecCache = field(default_factory=SpecCache)


@dataclass(frozen=True)
class CycleResult:
    snapshot: Snapshot
    allocation: Allocation
    plan: pl.Plan
    results: tuple[ActionResult, ...]


def _exclude_reserved(the_plan: pl.Plan, reserved: Mapping[str, int], enactor) -> pl.Plan:
    """Starts and resizes may not land on nodes whose GPUs are kept for a rigid job (pools.reserve_rigid):
    the daemon's reservation is told to Slurm as the job's ``ExcNodeList``, since a restarted job would
    otherwise be placed by Slurm wherever it fits. A job excluded before gets its list cleared at its
    next start or resize once nothing is reserved (``Enactor.excluded`` remembers whom)."""
    nodes = tuple(sorted(n for n, g in reserved.items() if g > 0))
    excluded = enactor.excluded
    if not nodes and not excluded:
        return the_plan
    out = []
    for a in the_plan.actions:
        if a.kind in ("start", "resize"):
            own = a.exclude_nodes  # the planner's pin to a pool (issue 23: the nodes of its other types)
            if nodes:
                a = replace(a, exclude_nodes=tuple(sorted(set(own or ()) | set(nodes))))
                excluded.add(a.job_id)
            elif own is not None:
                excluded.add(a.job_id)
            elif a.job_id in excluded:
                a = replace(a, exclude_nodes=())
                excluded.discard(a.job_id)
        out.append(a)
    return replace(the_plan, actions=tuple(out))


def _freeze(snap, books, now: float, config: pl.PlannerConfig):
    jobs = list(snap.problem.jobs)
    changed = False
    for i, (req, view) in enumerate(zip(jobs, snap.views, strict=True)):
        if req.running_gpus <= 0 or req.frozen:
            continue
        book = books.get(view.job_id)
        since = None if book is None or book.last_change_s is None else now - book.last_change_s
        cooling = view.status == pl.RUNNING and since is not None and since < config.cooldown_s
        n = book.rescales if book is not None else 0
        age = req.age_s
        if book is not None and book.submitted_s is not None:  # Slurm's own restarted at our requeue
            age = max(0.0, now - book.submitted_s, age or 0.0)
        if view.status in (pl.IN_FLIGHT, pl.STARTING) or cooling:
            pool = req.pool
            if view.status == pl.STARTING and not pool and len(snap.problem.pools) > 1:
                pool = _released_to(view, book, req, snap.problem.pools, snap.node_free, snap.node_size)
            jobs[i] = replace(req, frozen=True, held_s=since, rescales=n, age_s=age, pool=pool)
            changed = True
        elif since is not None or n or age != req.age_s:
            jobs[i] = replace(req, held_s=since, rescales=n, age_s=age)
            changed = True
    if not changed:
        return snap
    return replace(snap, problem=replace(snap.problem, jobs=tuple(jobs)))


def _released_to(view: pl.JobView, book: pl.JobBook | None, req, pools, node_free, node_size: int) -> str:
    """The pool a released job that Slurm has not started will start in: of the pools it was pinned to (its
    partition, less the nodes its last start excluded), the one where it fits on the free GPUs now, so the
    planner keeps it there; "" if it fits in none, or in several (a partition spanning types: Slurm may
    take either; the policy may then start it elsewhere, and the planner holds it again at once:
    ``planner._elsewhere``). Without it the policy saw a job that will start where it was
    released in every pool it may use, and counted its GPUs in another pool, or, in one whose table lacks
    its count, fewer of them than the planner keeps (found on Sia's cluster: 16 RTX GPUs released, 8 in
    the allocation, so a 7-GPU start it counted on there was turned away while GPUs idled)."""
    ex = set(book.excluded) if book is not None else set()
    names = set(req.pools) if req.pools else {p.name for p in pools}
    left = [p for p in pools if p.name in names and any(
        n not in ex and (view.start_nodes is None or n in view.start_nodes) for n, _ in p.node_capacity)]
    if not left or node_free is None:
        return ""
    fits = []
    for p in left:
        placer = pl._Placer(node_free, node_size)
        placer.scope(p)
        if placer.take(*placer.shape(view, view.gpus)) is not None:
            fits.append(p.name)
    return fits[0] if len(fits) == 1 else ""


RESOLVES = 3  # solves after the first, at most, when what the planner could not make (or held again) left GPUs idle


def _kept_why(a: JobAllocation, planner_reason: str) -> str:
    """The reason a job kept at its size for a re-solve shows: what it was to get and why it could not."""
    where = f" in {a.pool}" if a.pool else ""
    if planner_reason.startswith("max_in_flight"):
        what = f"its change to {a.gpus} GPUs{where} waits for a resize slot ({planner_reason})"
    else:
        held = "no place on the nodes yet" if planner_reason.startswith("no placement") else \
            "GPUs still held by other jobs"
        what = f"its {a.gpus} GPUs{where} had {held}"
    return f"kept at its size this cycle: {what}; the others were solved again for the GPUs that would idle"


def run_cycle(
    backend: SlurmBackend,
    policy: Policy,
    enactor: Enactor,
    state: CycleState,
    *,
    model_for: ModelFor,
    now: float,
    planner_config: pl.PlannerConfig | None = None,
    partitions: Iterable[str] | None = None,
    node_size: int | None = None,
    default_restart_s: float = 45.0,
    restart_claim_max_s: float = RESTART_CLAIM_MAX_S,
    horizon_s: float = 3600.0,
    placement: bool = True,
    job_info=None,
    left_alone: Mapping[int, str] | None = None,
    partition_limits: Mapping | None = None,
    model_for_type=None,
    note_nodes=None,
) -> CycleResult:
    """One scheduling cycle: read, build the problem, allocate, plan, enact. Updates ``state.books``.
    ``model_for_type``: a job's model per GPU type (problem.build_problem's; None: its default rule).

    Jobs the planner will not resize this cycle (in flight, released but not started, in their
    rescale cooldown) are handed to the policy ``frozen`` at their size, so the allocation counts on
    no GPUs the planner cannot move; so are, in further solves, those whose grow or move the planner
    could not make (``Plan.blocked``: no place, no GPUs by the count, no resize slot) when GPUs would
    otherwise idle, and without the released jobs the plan holds again (:data:`RESOLVES`)."""
    enactor.poll()
    jobs, nodes = backend.list_jobs(), backend.list_nodes()
    if note_nodes is not None:
        note_nodes(nodes)  # the GPU type of each node, for the job models (issue 23)
    if node_size is None and not any(n.gpus_total > 0 for n in nodes):
        # Seen live right after a slurmctld restart: nodes listed before they register, with no GPUs.
        # Planning on that would be planning on an empty cluster; skip the cycle as for a failed read.
        raise SlurmError("no node reports GPUs yet (slurmctld just started, or no slurmd registered): "
                         "nothing to plan on this cycle")
    snap = build_problem(
        jobs,
        nodes,
        model_for=model_for,
        now=now,
        partitions=partitions,
        node_size=node_size,
        in_flight=enactor.in_flight_targets(),
        default_restart_s=default_restart_s,
        restart_claim_max_s=restart_claim_max_s,
        horizon_s=horizon_s,
        allow_preemption=bool(planner_config and planner_config.allow_preemption),
        spec_cache=state.spec_cache,
        job_info=job_info,
        left_alone=left_alone,
        partition_limits=partition_limits,
        **({"model_for_type": model_for_type} if model_for_type is not None else {}),
    )
    if snap.node_size <= 0 and snap.problem.jobs:
        # Seen live (pyslurm, right after a slurmctld restart): nodes listed with GPUs but none of the
        # managed ones usable yet. Nothing can be placed; skip the cycle as for a failed read.
        raise SlurmError("no managed node is usable yet (slurmctld just started, or every managed node is "
                         "down or drained): nothing to plan on this cycle")
    snap = _freeze(snap, state.books, now, planner_config or pl.PlannerConfig())
    if snap.problem.jobs:
        alloc = policy.allocate(snap.problem)
    else:
        alloc = Allocation(policy=getattr(policy, "name", ""))

    def plan_for(a: Allocation) -> pl.Plan:
        return pl.plan(
            a, snap.views, state.books, now, capacity=snap.capacity, node_size=snap.node_size,
            config=planner_config or pl.PlannerConfig(),
            node_free=snap.node_free if placement else None, pools=snap.problem.pools,
            urgent=snap.kept_for_rigid.caps,
        )

    the_plan = plan_for(alloc)
    kept: frozenset = frozenset()
    dropped: dict = {}  # released job the plan holds again -> its allocation then: out of the next solve
    why: dict = {}  # job kept at its size -> the reason it shows
    last, last_alloc = the_plan, alloc  # the latest solve: its blocked jobs are kept in the next
    for _ in range(RESOLVES):
        held = frozenset(a.job_id for a in last.actions if a.kind == "hold")
        if the_plan.committed_gpus >= snap.capacity or (last.blocked <= kept and held <= set(dropped)):
            break
        # The planner could not carry out a grow or move (no place on the nodes yet, the GPUs it counted
        # on still held, or no resize slot left), and GPUs the allocation gave it would idle this cycle:
        # solve again with those jobs kept at their size, so the GPUs go to jobs that can take them now
        # (found on Sia's cluster: a move waiting for another's nodes left 4-8 GPUs idle for 1-3 cycles
        # while jobs that fitted waited). The GPUs may go to another grow that finds no place either (on
        # Sia's cluster, workload 3: two grows on fragmented RTX nodes in turn, two GPUs idle while five
        # jobs waited), so the next solve keeps it too; the plan that commits the most GPUs is carried out.
        # A released job Slurm could not start is held again by the plan, and the GPUs the allocation
        # kept for it would idle as surely (workloads 6 and 8: 5 and 16 GPUs for a cycle): the next solve
        # leaves it out, and the planner holds it again.
        why.update({a.job_id: _kept_why(last_alloc.jobs[a.job_id], a.reason)
                    for a in last.actions if a.job_id in last.blocked and a.job_id in last_alloc.jobs})
        kept = kept | last.blocked
        dropped.update({j: last_alloc.jobs.get(j) for j in held if j not in dropped})
        again = replace(snap.problem, jobs=tuple(replace(r, frozen=True) if r.job_id in kept else r
                                                 for r in snap.problem.jobs if r.job_id not in dropped))
        alloc2 = policy.allocate(again)
        # a dropped job keeps the allocation it was held under, so the planner holds it again alike (one
        # the policy put in another pool is held at once only while the allocation says so; seen live)
        alloc2 = replace(alloc2, jobs={**{j: a for j, a in dropped.items() if a is not None},
                                       **{j: replace(a, reason=why[j]) if j in why and a.gpus > 0 else a
                                          for j, a in alloc2.jobs.items()}})
        last, last_alloc = plan_for(alloc2), alloc2
        if last.committed_gpus > the_plan.committed_gpus:
            alloc, the_plan = alloc2, last
    the_plan = _exclude_reserved(the_plan, snap.kept_for_rigid.by_node, enactor)
    results = enactor.apply(the_plan.actions)
    # A start is done at once; a resize/preemption counts from when it began (its signal).
    ok = [r.action for r in results
          if (r.action.kind in ("start", "hold") and r.status == "done") or r.status == "begun"]
    submitted = {j: r.submit_time for j, r in snap.records.items() if r.submit_time is not None}
    books = pl.update_books(state.books, ok, now, submitted)
    # Forget jobs Slurm no longer lists (finished), so a long-running daemon's books stay small.
    state.books = {j: b for j, b in books.items() if j in snap.records or j in enactor.in_flight}
    return CycleResult(snap, alloc, the_plan, tuple(results))
