"""Build the policy's :class:`AllocationProblem` from what a backend lists. Pure: no I/O.

``build_problem(jobs, nodes, ...)`` takes the ``JobRecord``/``NodeRecord`` lists of one backend read
and returns a :class:`Snapshot`: the problem for ``policy.allocate``, the planner's view of every
elastic job, and the jobs whose spec did not parse (reported, never acted on).

Rules:

- **Managed nodes** are usable nodes (``NodeRecord.usable``) in the managed partitions (all
  partitions when ``partitions`` is None). The node size is the most common GPU count among them
  (ties: the larger), unless given.
- **Elastic jobs** are active jobs in a managed partition whose ``Comment`` is an ``elastic:`` spec.
  A spec that fails :func:`parse_spec` (or cannot be placed on this node size) puts the job in
  ``errors``; for capacity it then counts as non-elastic.
- **Left alone**: an elastic job that Slurm will not requeue (``requeueable`` false: ``--no-requeue``,
  or ``JobRequeue=0`` without ``--requeue``) once it runs, and every job the driver names in
  ``left_alone`` (the daemon: operator holds), go to ``unmanaged`` with the reason and count as
  non-elastic: never signalled, resized or released; a non-requeueable job may still be started.
- **Capacity** (GPUs available to elastic jobs) = GPUs of the managed nodes minus the GPUs held by
  running non-elastic jobs on them. Elastic jobs' own GPUs are part of the capacity, since the policy
  reallocates them.
- **Status** of an elastic job: ``in_flight`` if the driver says a resize of it is under way;
  ``running`` if Slurm runs it (current size = its GPUs, batch = its decision's, else the requested
  one); ``starting`` if it is pending, not held and carries a decision (released, Slurm has not
  started it yet: its decision's GPUs are committed); otherwise ``pending``.
- **Pools** (issue 13, :mod:`slurm_elastic.pools`): the managed nodes grouped by (partitions, GPU type,
  features, reservations). With one pool the problem is the single-pool one (``pools=()``). With
  several, each job carries the pools it may use (a running job: the pool of its nodes) and its model
  per pool GPU type (``model_for_type``; default: Gavel tables per type, else none and the job's model
  is used unscaled, recorded in ``unscaled_pools``). A pending job that no pool admits, or whose
  ``--constraint`` is beyond feature names joined by ``&``, is an error (field ``partition`` /
  ``constraint``).
- **Rigid jobs** (non-elastic, pending for Resources/Priority, not held) get GPUs reserved in Slurm
  priority order when they would fit at the elastic minimums (``pools.reserve_rigid``): the reserved
  GPUs leave the capacity, the node map and ``node_free``; elastic jobs on them are capped below their
  size; ``Snapshot.kept_for_rigid`` says what was reserved, for whom, and who waits and why.
- **Time limits**: a running job whose ``--time`` ends within one restart is frozen; one where no grow
  could repay its restart before the limit is not grown (it may still be shrunk for other jobs).
- **Priority order** handed to the policy: Slurm priority when set and non-zero (higher first), then
  submit time, then job id: FIFO among held jobs, whose Slurm priority is 0.
- Each job gets the throughput model returned by ``model_for(record, spec)``; ``restart_s`` is the
  restart cost measured for the job (the model's ``restart_s``, see profiles/learned.py), else the
  spec's own estimate, either at most ``restart_claim_max_s`` (a claim, claims.py), else
  ``default_restart_s``;
  ``noise_scale``/``base_batch`` are the model's
  (what the job reported, profiles/learned.py; None otherwise), unless the driver's ``job_info``
  gives a noise scale (the simulator: the trace's); ``attained_gpu_s``/``remaining_samples`` come
  from ``job_info``. A running job's view says whether it has reported a step
  in its current start (``stepped``; None when the model does not know), for the planner's
  stability guard; ``wait_s`` is the time since submission while it
  is pending. Starting and in-flight jobs are handed to the policy as running at their committed size,
  so that the policy keeps their GPUs for them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

from slurm_elastic.backends.base import JobRecord, NodeRecord, PartitionRecord
from slurm_elastic.claims import RESTART_CLAIM_MAX_S, restart_claim
from slurm_elastic.planner import IN_FLIGHT, PENDING, RUNNING, STARTING, JobView
from slurm_elastic.policies.base import AllocationProblem, JobRequest, Pool, most_common_size
from slurm_elastic.pools import (
    ElasticOnNode,
    KeptForRigid,
    NodePool,
    allowed_pools,
    group_pools,
    reserve_rigid,
    rigid_demand,
)
from slurm_elastic.profiles.base import ThroughputModel
from slurm_elastic.spec import (
    Decision,
    ElasticSpec,
    SpecError,
    is_elastic_comment,
    parse_decision,
    parse_spec,
    validate_spec,
)

ModelFor = Callable[[JobRecord, ElasticSpec], ThroughputModel]
# Pending reasons of a rigid job that only GPUs hold back: GPUs are reserved only for these (a job waiting
# for a dependency, a begin time, a QOS/association limit or a down node would leave its GPUs idle).
RIGID_WAITING = frozenset({"", "None", "Resources", "Priority"})
# A job's model on another GPU type: (record, spec, its model, GPU type, home type) -> model, or None: no
# data. ``home``: the GPU type the model's numbers come from (a running job: its pool's; "" unknown).
ModelForType = Callable[[JobRecord, ElasticSpec, ThroughputModel, str, str], "ThroughputModel | None"]


def typed_model_for_type(record: JobRecord, spec: ElasticSpec, model: ThroughputModel, gpu_type: str,
                         home: str = ""):
    """The default per-type rule (profiles.types.model_on_type): the job's own reports on that type, a
    Gavel table, the cluster's type ratios, else the measured per-type prior; None only for a GPU type
    nothing is known of (the allocator then uses its model unscaled and says so in the job's reason).
    ``home``: the type the model's numbers come from ("" unknown)."""
    from slurm_elastic.profiles.types import model_on_type

    return model_on_type(model, gpu_type, home)


gavel_model_for_type = typed_model_for_type  # the name issue 13 gave it


@dataclass(frozen=True)
class JobInfo:
    """What a job itself reports beyond Slurm's view (the in-job library's report; the simulated job's
    state in the simulator): its gradient noise scale and reference batch, the GPU-seconds it has had,
    and the work it has left. Every field may be None/0: unknown."""

    noise_scale: float | None = None
    base_batch: int | None = None
    attained_gpu_s: float = 0.0
    remaining_samples: float | None = None
    # Per-GPU batch limits learned from out-of-memory failures (daemon/oom.py): (GPU type, largest local
    # batch; "" = untyped GPUs), applied as the spec's own local_batch_by_type; and why its current start
    # must be restarted now ("" none: JobView.restart)
    local_batch_limits: tuple[tuple[str, int], ...] = ()
    restart_now: str = ""
    restart_below: int = 0  # the local batch its start failed at (the restart must go below it there)


JobInfoFor = Callable[[JobRecord], "JobInfo | None"]


@dataclass(frozen=True)
class Snapshot:
    problem: AllocationProblem
    views: tuple[JobView, ...]  # elastic jobs in priority order (same order as problem.jobs)
    records: Mapping[int, JobRecord]
    specs: Mapping[int, ElasticSpec]
    errors: Mapping[int, SpecError]
    capacity: int
    managed_gpus: int
    non_elastic_gpus: int
    node_size: int
    decisions: Mapping[int, Decision] = field(default_factory=dict)
    node_free: Mapping[str, int] = field(default_factory=dict)  # free GPUs per managed node, now
    unmanaged: Mapping[int, str] = field(default_factory=dict)  # elastic jobs left alone -> why
    # Issue 13: the pools (pools.NodePool, in problem order), and the GPUs kept free for pending rigid
    # jobs (pools.KeptForRigid: per node, per rigid job, and those that wait, with the reason).
    pools: tuple[NodePool, ...] = ()
    kept_for_rigid: KeptForRigid = field(default_factory=KeptForRigid)
    partitions_of: Mapping[int, tuple[str, ...]] = field(default_factory=dict)  # elastic job -> its partitions
    # Running jobs whose Comment turned invalid, scheduled on their last valid spec (shrink only) -> why
    degraded: Mapping[int, SpecError] = field(default_factory=dict)


class SpecCache:
    """Parsed specs and decisions by text, and current throughputs, so a polling loop computes each once."""

    def __init__(self, max_size: int = 100_000):
        self._d: dict[tuple[str, int], ElasticSpec | SpecError] = {}
        self._dec: dict[str, Decision | None | SpecError] = {}
        self._sps: dict[tuple, float] = {}
        self._rec: dict[int, tuple] = {}
        self.max_size = max_size
        # job id -> the last spec that passed every check (parser, site rules): what a running job is
        # held to when its Comment turns invalid (it may then shrink, never grow). The daemon persists it.
        self.last_valid: dict[int, ElasticSpec] = {}

    def record_hit(self, record: JobRecord, context: tuple):
        """What :func:`build_problem` derived from this very record object (identity, not equality) in
        the same context (in-flight target, node size, restart default, model object) last time."""
        hit = self._rec.get(record.job_id)
        if hit is not None and hit[0] is record and hit[1][:3] == context[:3] and hit[1][3] is context[3]:
            return hit[2]
        return None

    def remember(self, record: JobRecord, context: tuple, payload) -> None:
        if len(self._rec) >= self.max_size:
            self._rec.clear()
        self._rec[record.job_id] = (record, context, payload)

    def _parsed(self, cache: dict, key, parse, job_id):
        """``parse()`` once per key; a SpecError is cached too and raised again naming this job."""
        hit = cache.get(key, self)
        if hit is self:
            try:
                hit = parse()
            except SpecError as e:
                hit = e
            if len(cache) >= self.max_size:
                cache.clear()
            cache[key] = hit
        if isinstance(hit, SpecError):
            raise SpecError(hit.reason, job_id=job_id, field=hit.field)
        return hit

    def decision(self, admin_comment: str, job_id) -> Decision | None:
        return self._parsed(self._dec, admin_comment, lambda: parse_decision(admin_comment, job_id), job_id)

    def running_samples_per_s(self, model: ThroughputModel, spec: ElasticSpec, gpus: int, batch: int, size: int,
                              nodes: int = 0) -> float:
        """Throughput of ``spec`` on ``gpus`` GPUs at global ``batch`` (0 when the batch cannot run there);
        ``nodes``: the nodes it runs on (0: as ``spec.placement`` puts it on nodes of ``size``; a job on
        nodes of another size than the problem's, in a pool of its own, needs its own count)."""
        key = (model, spec, gpus, batch, size, nodes)
        v = self._sps.get(key)
        if v is None:
            split = spec.split_batch(gpus, batch)
            if split is None:
                v = 0.0
            else:
                n, _ = (nodes, 0) if nodes else spec.placement(gpus, size) if size else (1, gpus)
                v = model.samples_per_s(gpus, n, split[0], split[1])
            if len(self._sps) >= self.max_size:
                self._sps.clear()
            self._sps[key] = v
        return v

    def samples_per_s(self, model: ThroughputModel, gpus: int, nodes: int, local: int, accum: int) -> float:
        key = (model, gpus, nodes, local, accum)  # the model itself (not its id): no reuse after GC
        v = self._sps.get(key)
        if v is None:
            if len(self._sps) >= self.max_size:
                self._sps.clear()
            v = self._sps[key] = model.samples_per_s(gpus, nodes, local, accum)
        return v

    def get(self, comment: str, job_id, node_size: int) -> ElasticSpec:
        def parse() -> ElasticSpec:
            spec = parse_spec(comment, job_id)
            validate_spec(spec, job_id, node_size=node_size)
            return spec

        return self._parsed(self._d, (comment, node_size), parse, job_id)


def capped_spec(spec: ElasticSpec, limits) -> ElasticSpec:
    """``spec`` with learned per-type local batch limits folded into ``local_batch_by_type`` (the lower
    of the two wins; never below ``min_local_batch``); an untyped limit ("") lowers ``max_local_batch``."""
    if not limits:
        return spec
    top = spec.max_local_batch
    for t, lim in limits:
        if t == "":
            top = max(spec.min_local_batch, min(top, lim))
    by = {t: min(lim, top) for t, lim in spec.local_batch_by_type}
    for t, lim in limits:
        if t:
            by[t] = max(spec.min_local_batch, min(by.get(t, top), lim))
    return replace(spec, max_local_batch=top, local_batch_by_type=tuple(sorted(by.items())))


def _with_info(req: JobRequest, info: JobInfo | None) -> JobRequest:
    if info is None:
        return req
    if info.local_batch_limits:
        req = replace(req, spec=capped_spec(req.spec, info.local_batch_limits))
    # A noise scale the driver reports wins over the model's (the daemon's model carries what the job
    # reported, see profiles/learned.py); an unknown one keeps the model's rather than erasing it.
    if info.noise_scale is not None:
        ns, b0 = info.noise_scale, info.base_batch
    else:
        ns, b0 = req.noise_scale, req.base_batch
    return replace(req, noise_scale=ns, base_batch=b0,
                   attained_gpu_s=info.attained_gpu_s, remaining_samples=info.remaining_samples)


def _fallback_spec(r: JobRecord, cache: SpecCache, in_flight: Mapping[int, int]) -> ElasticSpec | None:
    """A job whose spec turned invalid after the daemon validated it keeps its last valid spec for every
    decision that takes GPUs from it: capped at the GPUs it holds (or is being resized to, or was
    started at), so it can be shrunk, never grown. None for a job with no GPUs or no valid spec known."""
    last = cache.last_valid.get(r.job_id)
    if last is None:
        return None
    held = in_flight.get(r.job_id)
    if held is None:
        if r.is_running:
            held = r.gpus_total
        elif r.is_pending and not r.held and r.admin_comment:
            try:
                d = cache.decision(r.admin_comment, r.job_id)
            except SpecError:
                d = None
            held = d.gpus if d is not None else 0
    if not held or held <= 0:
        return None
    cap = min(last.max_gpus, held)
    gpus = last.gpus if last.gpus is not None and last.gpus <= cap else None
    return replace(last, max_gpus=cap, min_gpus=min(last.min_gpus, cap), gpus=gpus)


def node_size_of(nodes: Iterable[NodeRecord]) -> int:
    return most_common_size(n.gpus_total for n in nodes)


def _priority_key(r: JobRecord):
    prio = r.priority if (r.priority and not r.held) else 0
    return (-prio, r.submit_time if r.submit_time is not None else 0, r.job_id)


@dataclass
class _Sorted:
    """The cycle's jobs sorted out (step 1 of :func:`build_problem`): elastic jobs with their specs and
    pools, those reported or left alone, pending rigid jobs, and the GPUs every other job holds."""

    elastic: list[JobRecord] = field(default_factory=list)
    specs: dict[int, ElasticSpec] = field(default_factory=dict)
    allowed: dict[int, tuple[str, ...]] = field(default_factory=dict)
    pinned: dict[int, str] = field(default_factory=dict)
    errors: dict[int, SpecError] = field(default_factory=dict)
    degraded: dict[int, SpecError] = field(default_factory=dict)  # on its last valid spec: its Comment turned invalid
    unmanaged: dict[int, str] = field(default_factory=dict)
    rigid: list[JobRecord] = field(default_factory=list)
    non_elastic_gpus: int = 0
    non_elastic_per_node: Counter = field(default_factory=Counter)


@dataclass(frozen=True)
class _Shape:
    """The managed part of the cluster this cycle."""

    managed: list[NodeRecord]
    names: frozenset[str]
    pools: list[NodePool]
    pool_of_node: dict[str, str]
    size: int
    parts: frozenset[str] | None

    def managed_partition(self, p: str) -> bool:
        return self.parts is None or bool(set(p.split(",")) & self.parts)


def build_problem(
    jobs: Iterable[JobRecord],
    nodes: Iterable[NodeRecord],
    *,
    model_for: ModelFor,
    now: float,
    partitions: Iterable[str] | None = None,
    node_size: int | None = None,
    in_flight: Mapping[int, int] | None = None,
    default_restart_s: float = 45.0,
    restart_claim_max_s: float = RESTART_CLAIM_MAX_S,
    horizon_s: float = 3600.0,
    allow_preemption: bool = False,
    spec_cache: SpecCache | None = None,
    job_info: JobInfoFor | None = None,
    left_alone: Mapping[int, str] | None = None,
    model_for_type: ModelForType | None = typed_model_for_type,
    partition_limits: Mapping[str, PartitionRecord] | None = None,
) -> Snapshot:
    """See the module docstring. ``in_flight`` maps job id -> target GPUs of resizes under way;
    ``job_info`` gives what each job reports about itself (:class:`JobInfo`), when known;
    ``left_alone`` maps job id -> reason for elastic jobs the driver must not act on.

    Three steps: sort the jobs out (:func:`_sort_jobs`), one request and view per elastic job
    (:func:`_job_request`), then the rigid jobs' reservations, pools and the problem itself."""
    parts = None if partitions is None else frozenset(partitions)
    jobs = jobs if isinstance(jobs, (list, tuple)) else list(jobs)
    in_flight = in_flight or {}
    cache = spec_cache or SpecCache()
    managed = [n for n in nodes if n.usable and (parts is None or set(n.partitions) & parts)]
    node_pools = group_pools(managed)
    shape = _Shape(managed, frozenset(n.name for n in managed), node_pools,
                   {n: p.name for p in node_pools for n in p.nodes}, node_size or node_size_of(managed), parts)
    size = shape.size
    managed_gpus = sum(n.gpus_total for n in managed)
    st = _sort_jobs(jobs, shape, cache, in_flight, left_alone or {}, partition_limits)
    non_elastic_gpus = min(st.non_elastic_gpus, managed_gpus)
    capacity = managed_gpus - non_elastic_gpus

    reqs: list[JobRequest] = []
    views: list[JobView] = []
    decisions: dict[int, Decision] = {}
    for r in st.elastic:
        spec = st.specs[r.job_id]
        target = in_flight.get(r.job_id)
        try:
            model = model_for(r, spec)
        except SpecError as e:
            # e.g. profile=NAME with a well-formed but unknown name, or a ckpt_dir the site refuses: this
            # job is reported, the cycle goes on (found by tests/faults: it used to fail every cycle of
            # the daemon, for every job). A running job falls back to its last valid spec (may shrink).
            fallback = None if r.job_id in st.degraded else _fallback_spec(r, cache, in_flight)
            try:
                model = model_for(r, fallback) if fallback is not None else None
            except SpecError:
                model = None
            if model is None:
                st.errors[r.job_id] = e
                st.specs.pop(r.job_id)
                if r.is_running:
                    capacity -= r.gpus_total
                continue
            st.degraded[r.job_id] = e
            spec = st.specs[r.job_id] = fallback
        if r.job_id not in st.degraded:
            cache.last_valid[r.job_id] = spec
        # The same record object as last cycle (the simulated backend reuses unchanged ones) with the same
        # in-flight target gives the same request and view; only a pending job's wait_s moves on.
        costs = (default_restart_s, restart_claim_max_s)
        hit = cache.record_hit(r, (target, size, costs, model))
        if hit is not None:
            req, view, d = hit
            if r.submit_time is not None:  # only the clock moves on: its age, and a pending job's wait
                age = max(0.0, now - r.submit_time)
                req = replace(req, age_s=age, wait_s=age if view.status == PENDING else req.wait_s)
        else:
            try:
                d = cache.decision(r.admin_comment, r.job_id) if r.admin_comment else None
            except SpecError as e:
                st.errors[r.job_id] = e
                st.specs.pop(r.job_id)
                if r.is_running:
                    capacity -= r.gpus_total
                continue
            req, view = _job_request(r, spec, model, d, target, shape, cache, now, costs)
            cache.remember(r, (target, size, costs, model), (req, view, d))
        if d is not None:
            decisions[r.job_id] = d
        info = job_info(r) if job_info is not None else None
        req = _with_info(req, info)
        if info is not None and info.restart_now and view.status == RUNNING:
            view = replace(view, restart=info.restart_now, restart_below=info.restart_below)
        reqs.append(req)
        views.append(view)

    node_cap = {n.name: max(0, n.gpus_total - st.non_elastic_per_node[n.name]) for n in managed}
    res = _reserve(st.rigid, node_pools, managed, node_cap, reqs, st.pinned, in_flight)
    if res.by_node:
        reserved = sum(res.by_node.values())
        capacity -= reserved
        node_cap = {n: max(0, c - res.by_node.get(n, 0)) for n, c in node_cap.items()}
    reqs = _pool_requests(reqs, res, st.allowed, st.pinned, node_pools, st.elastic, model_for_type, now, size,
                          capacity)
    # The per-GPU batch limit each job runs with (its one type's, learned ones): the planner splits by it
    views = [replace(v, spec=replace(v.spec, max_local_batch=q.spec.max_local_batch,
                                     local_batch_by_type=q.spec.local_batch_by_type))
             if v.spec is not None and (q.spec.max_local_batch, q.spec.local_batch_by_type) !=
             (v.spec.max_local_batch, v.spec.local_batch_by_type) else v
             for v, q in zip(views, reqs, strict=True)]
    if res.by_node:
        free_per_node = tuple(node_cap[n.name] for n in managed) or None
    elif st.non_elastic_per_node:
        free_per_node = tuple(max(0, n.gpus_total - st.non_elastic_per_node[n.name]) for n in managed) or None
    else:
        free_per_node = tuple(n.gpus_total for n in managed) or None
    problem = AllocationProblem(
        total_gpus=max(0, capacity),
        node_size=size,
        jobs=tuple(reqs),
        horizon_s=horizon_s,
        allow_preemption=allow_preemption,
        free_gpus_per_node=free_per_node,
        node_capacity=tuple((n.name, node_cap[n.name]) for n in managed) or None,
        pools=tuple(Pool(p.name, p.gpu_type, p.key.partitions, tuple((n, node_cap[n]) for n in p.nodes),
                         node_size_of(n for n in managed if shape.pool_of_node[n.name] == p.name))
                    for p in node_pools) if len(node_pools) > 1 else (),
    )
    return Snapshot(
        problem=problem,
        views=tuple(views),
        records={r.job_id: r for r in st.elastic},
        specs=st.specs,
        errors=st.errors,
        capacity=max(0, capacity),
        managed_gpus=managed_gpus,
        non_elastic_gpus=non_elastic_gpus,
        node_size=size,
        decisions=decisions,
        # A reserved node may show less than nothing free: the elastic GPUs on it that must leave count
        # against the reservation, so the planner's give-back of a leaving job does not free them again.
        node_free={n.name: (n.gpus_total - n.gpus_used - res.by_node[n.name]) if res.by_node.get(n.name)
                   else max(0, n.gpus_total - n.gpus_used) for n in managed},
        unmanaged=st.unmanaged,
        pools=tuple(node_pools),
        kept_for_rigid=res,
        partitions_of={r.job_id: _submitted_to(r, cache).partitions for r in st.elastic if r.job_id in st.specs},
        degraded=st.degraded,
    )


def _sort_jobs(jobs, shape: _Shape, cache: SpecCache, in_flight, left_alone, partition_limits) -> _Sorted:
    """Which jobs are elastic and managed (with their spec, or their last valid one while they hold GPUs),
    which are reported (bad spec) or left alone (operators, ending, not requeueable), which rigid jobs
    wait, and the GPUs every job that is not planned holds; in priority order."""
    st = _Sorted()
    size = shape.size
    for r in jobs:
        if not r.is_active:
            continue
        is_el = shape.managed_partition(r.partition) and is_elastic_comment(r.comment)
        ending = r.is_completing and r.job_id not in in_flight
        if is_el and ending:
            # Cancelled, ended or requeued outside the daemon and still ending (COMPLETING, up to KillWait):
            # never planned (issue 24 item 7: a cancelled job was given start attempts); its GPUs, still
            # held on its nodes, count as taken.
            st.unmanaged[r.job_id] = f"ending ({r.state}{'+COMPLETING' if r.state != 'COMPLETING' else ''}): not planned"
            is_el = False
        elif is_el and r.job_id in left_alone and r.job_id not in in_flight:
            st.unmanaged[r.job_id] = left_alone[r.job_id]
            is_el = False
        elif is_el and not r.requeueable and not r.is_pending and r.job_id not in in_flight:
            st.unmanaged[r.job_id] = (f"not requeueable (--no-requeue, or JobRequeue=0 without --requeue): "
                                      f"left at its {r.gpus_total} GPUs, never signalled to resize")
            is_el = False
        if is_el:
            try:
                spec = _within_limits(r, cache.get(r.comment, r.job_id, size), partition_limits, size)
                st.allowed[r.job_id], st.pinned[r.job_id] = _job_pools(_submitted_to(r, cache), shape.pools,
                                                                       shape.pool_of_node, shape.names)
                st.specs[r.job_id] = spec
                st.elastic.append(r)
                continue
            except SpecError as e:
                fallback = _fallback_spec(r, cache, in_flight)
                try:
                    if fallback is not None:
                        st.allowed[r.job_id], st.pinned[r.job_id] = _job_pools(
                            _submitted_to(r, cache), shape.pools, shape.pool_of_node, shape.names)
                        st.degraded[r.job_id] = e
                        st.specs[r.job_id] = fallback
                        st.elastic.append(r)
                        continue
                except SpecError:
                    pass
                st.errors[r.job_id] = e
        elif (r.is_pending and not r.held and shape.managed_partition(r.partition)
              and not is_elastic_comment(r.comment) and (r.gpus_total > 0 or r.gpus_per_node > 0)
              and r.state_reason in RIGID_WAITING):
            st.rigid.append(r)
        if (r.is_running or (ending and r.nodes)) and r.gpus_total > 0:
            on = [n for n in r.nodes if n in shape.names]
            if r.nodes and not on:
                continue  # runs outside the managed nodes
            if r.nodes:
                per = r.gpus_per_node or (r.gpus_total // max(1, len(r.nodes)))
                held = per * len(on)
                for n in on:
                    st.non_elastic_per_node[n] += per
            else:
                held = r.gpus_total
            st.non_elastic_gpus += held
    active = {r.job_id for r in jobs if r.is_active}
    for jid in [j for j in cache.last_valid if j not in active]:
        del cache.last_valid[jid]
    st.elastic.sort(key=_priority_key)
    st.rigid.sort(key=_priority_key)
    return st


def _job_request(r: JobRecord, spec: ElasticSpec, model: ThroughputModel, d: Decision | None, target: int | None,
                 shape: _Shape, cache: SpecCache, now: float, costs: tuple[float, float]) -> tuple[JobRequest, JobView]:
    """One elastic job's request to the policy and its view for the planner: where it stands (pending,
    starting, running, in flight), at what size and batch, its age, wait and restart cost. ``costs``: the
    restart cost of a job nothing is known of, and the most a claimed or measured one counts for."""
    default_restart_s, most_s = costs
    size = shape.size
    if target is not None:
        status, gpus = IN_FLIGHT, target
        batch = d.batch if d else spec.requested_batch
    elif r.is_running:
        status, gpus = RUNNING, r.gpus_total
        batch = d.batch if (d and d.gpus == r.gpus_total) else spec.requested_batch
    elif r.is_pending and not r.held and d is not None:
        status, gpus, batch = STARTING, d.gpus, d.batch
    else:
        status, gpus, batch = PENDING, 0, None
    sps = 0.0
    if status == RUNNING and gpus > 0:
        sps = cache.running_samples_per_s(model, spec, gpus, batch, size, r.node_count) if batch else 0.0
    age = max(0.0, now - r.submit_time) if r.submit_time is not None else None
    wait = age if (status == PENDING and age is not None) else 0.0
    # the trust rule: both rest on the job's word (its first step's report; its spec), so both are bounded
    raw_measured = getattr(model, "restart_s", None)
    measured_restart = restart_claim(raw_measured, most_s)
    claimed_restart = restart_claim(spec.restart_s, most_s)
    if measured_restart is not None:
        restart_from = "measured" + (",capped" if float(raw_measured) > most_s else "")
    elif claimed_restart is not None:
        restart_from = "spec" + (",capped" if spec.restart_s > most_s else "")
    else:
        restart_from = "default"
    req = JobRequest(
        job_id=r.job_id,
        spec=spec,
        model=model,
        running_gpus=gpus,
        running_batch=batch if gpus else None,
        restart_s=measured_restart if measured_restart is not None else
        claimed_restart if claimed_restart is not None else default_restart_s,
        wait_s=wait,
        age_s=age,
        noise_scale=getattr(model, "noise_scale", None),
        base_batch=getattr(model, "base_batch", None),
        user=r.user or "",
    )
    on = tuple(n for n in r.nodes if n in shape.names) if r.is_running else ()
    if on:
        req = replace(req, nodes=on, gpus_per_node=r.gpus_per_node)
    facts = getattr(model, "facts", None)
    known = facts is not None and facts.stepped_restarts is not None and status == RUNNING
    stepped = (r.restart_count in facts.stepped_restarts) if known else None
    view = JobView(r.job_id, status, gpus, batch, sps, spec, on, r.gpus_per_node if on else 0, stepped,
                   _submitted_to(r, cache).partitions, _start_nodes(r, shape) if status == STARTING else None,
                   restart_s=req.restart_s, restart_from=restart_from)
    return req, view


def _start_nodes(r: JobRecord, shape: _Shape) -> frozenset[str] | None:
    """Several pools: the managed nodes released job ``r`` may start on as Slurm shows it now (the
    partition it was pinned to); None with one pool."""
    if len(shape.pools) < 2:
        return None
    try:
        names = set(allowed_pools(r, shape.pools))
    except SpecError:
        return None
    return frozenset(n for p in shape.pools if p.name in names for n in p.nodes)


def _submitted_to(r: JobRecord, cache: SpecCache) -> JobRecord:
    """The job as submitted: the daemon pins a job to one of its partitions (Slurm then shows only that
    one) and keeps the others in its decision (``Decision.parts``), so that it may move back."""
    if "," in r.partition or not r.admin_comment:
        return r
    try:
        d = cache.decision(r.admin_comment, r.job_id)
    except SpecError:
        return r
    if d is None or not d.parts or r.partition not in d.parts:
        return r
    return replace(r, partition=",".join(d.parts))


def _job_pools(r: JobRecord, pools, pool_of_node, managed_names) -> tuple[tuple[str, ...], str]:
    """(the pools job ``r`` may use, the pool it runs in now or ""). A running job lists the pool of its
    nodes first, then the other pools it may use (issue 23: it may move there, as a restart); a pending
    one that no pool admits is reported as its bad input (SpecError), naming what it asked for."""
    ap = allowed_pools(r, pools)
    if r.is_running:
        on = [pool_of_node[n] for n in r.nodes if n in managed_names]
        if on:
            now = Counter(on).most_common(1)[0][0]
            return (now,) + tuple(p for p in ap if p != now), now
        return ap, ""
    if not ap:
        what = [f"partition {r.partition!r}"]
        if r.gpu_type:
            what.append(f"gres type {r.gpu_type!r}")
        if r.constraint:
            what.append(f"constraint {r.constraint!r}")
        if r.reservation:
            what.append(f"reservation {r.reservation!r}")
        raise SpecError("no managed, usable nodes match its " + ", ".join(what) + ": not placed",
                        job_id=r.job_id, field="partition")
    return ap, ""


def _reserve(rigid, pools, managed, node_cap, reqs, pinned, in_flight) -> KeptForRigid:
    """GPUs kept free for pending rigid jobs (pools.reserve_rigid), given the elastic requests."""
    if not rigid:
        return KeptForRigid()
    demands = []
    blocked: dict[int, str] = {}
    for r in rigid:
        try:
            d = rigid_demand(r, pools)
        except SpecError as e:
            blocked[r.job_id] = str(e)  # its constraint is beyond the daemon: Slurm alone places it
            continue
        if d is not None:
            demands.append(d)
    on_nodes, committed = [], Counter()
    for rank, q in enumerate(reqs):
        pool = pinned.get(q.job_id, "")
        if q.running_gpus > 0:
            moving = q.frozen or q.job_id in in_flight  # cannot shrink now: it keeps what it has
            committed[pool] += q.running_gpus if moving else q.spec.min_gpus
            if q.nodes and q.gpus_per_node and not moving:
                on_nodes.append(ElasticOnNode(q.job_id, pool, q.running_gpus, q.spec.min_gpus, q.nodes,
                                              q.gpus_per_node, rank))
    res = reserve_rigid(demands, pools, node_cap, {n.name: max(0, n.gpus_total - n.gpus_used) for n in managed},
                        {n.name: n.gpus_total for n in managed}, on_nodes, committed)
    res.blocked.update(blocked)
    return res


def _within_limits(r: JobRecord, spec: ElasticSpec, limits: Mapping[str, PartitionRecord] | None,
                   size: int) -> ElasticSpec:
    """The spec as Slurm will let it run: an elastic ``--exclusive`` job is refused (the daemon sizes jobs
    by GPU, Slurm would give it whole nodes), and the most GPUs are capped by its partitions' MaxNodes
    (the strictest of the partitions it may use: a plan past it would never start)."""
    if r.exclusive:
        raise SpecError("an elastic job cannot be --exclusive (the daemon sizes it by GPU; Slurm would hold "
                        "whole nodes for it): submit it without --exclusive", job_id=r.job_id, field="exclusive")
    if not limits or size <= 0:
        return spec
    caps = [(lim.max_nodes, p) for p in r.partitions if (lim := limits.get(p)) is not None and lim.max_nodes]
    if not caps:
        return spec
    max_nodes, part = min(caps)
    # The largest count that spec.placement fits on max_nodes nodes, from the bounds (never a walk down
    # from max_gpus, which a user sets): g per node with gpus_per_node=g, else one node up to its size
    # and whole nodes above it.
    g = spec.gpus_per_node
    if g:
        most = min(spec.max_gpus, max_nodes * g) // g * g
    elif spec.max_gpus <= size:
        most = spec.max_gpus
    else:
        most = min(spec.max_gpus // size, max_nodes) * size
    if most < spec.min_gpus:
        most = 0
    if most < spec.min_gpus:
        raise SpecError(f"min_gpus={spec.min_gpus} needs more nodes of {size} GPUs than partition {part}'s "
                        f"MaxNodes={max_nodes}", job_id=r.job_id, field="min_gpus")
    return spec if most == spec.max_gpus else replace(spec, max_gpus=most)


def _pool_requests(reqs, res, allowed, pinned, pools, records, model_for_type, now, size, capacity):
    """The requests with what issue 13 adds: pools and per-pool models (several pools only), shrink caps
    on jobs that sit on GPUs reserved for rigid jobs, and no rescale a job's time limit cannot repay."""
    recs = {r.job_id: r for r in records}
    by_name = {p.name: p for p in pools}
    multi = len(pools) > 1
    out = []
    for q in reqs:
        r = recs.get(q.job_id)
        cap = res.caps.get(q.job_id)
        if cap is not None and q.running_gpus > 0 and cap < q.running_gpus:
            q = replace(q, spec=replace(q.spec, max_gpus=max(q.spec.min_gpus, cap)))
        if r is not None and q.running_gpus > 0 and not q.frozen and r.time_limit_s and r.start_time is not None:
            left = r.start_time + r.time_limit_s - now
            best = min(q.spec.max_gpus, max(capacity, 0)) / q.running_gpus  # a linear grow: the most a grow gains
            if left <= q.restart_s:
                q = replace(q, frozen=True)  # any restart would use up the time it has left
            elif best > 1 and best * (left - q.restart_s) <= left:
                # No grow repays its restart before the limit; a shrink for other jobs stays possible (a
                # job at its maximum, or holding all the GPUs, was frozen here for its whole --time, a year
                # for a job Slurm 22.05's backfill started without one: it was never shrunk for anyone).
                q = replace(q, spec=replace(q.spec, max_gpus=max(q.spec.min_gpus, q.running_gpus)))
        if multi and r is not None:
            names = allowed.get(q.job_id, ())
            here = pinned.get(q.job_id, "")
            # the type its model's numbers are for: where it runs, else what its model says (its last type)
            home = by_name[here].gpu_type if here in by_name else getattr(q.model, "gpu_type", "") or ""
            models, unscaled = [], []
            for name in names:
                t = by_name[name].gpu_type
                if not t or (t == home and name == here):
                    continue  # an untyped pool, or the one it runs in: the job's own model
                m = model_for_type(r, q.spec, q.model, t, home) if model_for_type else None
                if m is None:
                    unscaled.append(name)
                elif m is not q.model:
                    models.append((name, m))
            specs = tuple((n, sp) for n in names if (sp := q.spec.on_type(by_name[n].gpu_type)) is not q.spec)
            q = replace(q, pools=names, pool=pinned.get(q.job_id, ""), pool_models=tuple(models),
                        unscaled_pools=tuple(unscaled), pool_specs=specs)
        elif not multi and pools and pools[0].gpu_type and q.spec.local_batch_by_type:
            q = replace(q, spec=q.spec.on_type(pools[0].gpu_type))  # one type: its batch limit
        out.append(q)
    return out
