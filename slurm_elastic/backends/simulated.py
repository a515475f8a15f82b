"""An in-memory Slurm with a virtual clock, implementing :class:`SlurmBackend` for the simulator.

It behaves like the parts of Slurm the daemon uses, and models what a job does:

- **Nodes** of ``gpus_per_node`` GPUs in one partition. A job asks for ``num_nodes`` x
  ``gpus_per_node``; placement is best-fit (the nodes with the fewest free GPUs that fit), so small
  jobs pack and whole nodes stay free for large ones.
- **Slurm's own scheduler**: pending, not-held jobs start in submit order when their GPUs fit,
  with backfill (a job that fits starts even if an earlier one does not). Elastic jobs are submitted
  held (as the submit plugin holds them), so only the daemon's ``release`` lets them start.
  Non-elastic jobs are submitted released and run for their ``duration_s``.
- **An elastic job's work**: it has ``total_samples`` to process (with an ``efficiency`` function, the
  goodput work model: progress accrues at samples/s x efficiency(batch), and ``total_samples`` is the
  work in samples at the app's initial batch). Once started it spends a start-up
  time (``startup_s`` on its first start, ``restart_s`` after a requeue) holding its GPUs without
  progress, then trains at ``model.samples_per_s(gpus, nodes, local_batch, accum)`` with the
  decision read from its ``AdminComment`` (without a decision: the spec's requested batch), and
  completes when it has processed ``total_samples``.
- ``signal(USR2)``: the job stops training, writes a checkpoint for ``checkpoint_s`` and then
  acknowledges (:meth:`checkpoint_acked`); it keeps its GPUs until ``requeue_hold``.
- ``requeue_hold``: the job goes back to pending and held and frees its GPUs. Work since its last
  checkpoint is lost (none, after an acknowledged checkpoint).
- ``update_job`` (pending jobs only) sets GPUs per node, node count and admin comment (and the
  partition and GPU type); ``release`` lets Slurm start it.
- **Issue 13**: ``groups`` gives node groups ``(count, GPUs per node, partition, GPU type)`` instead of
  one uniform partition; a job runs only on nodes of one group that is in one of its partitions and
  of its GPU type ("" = any), and an elastic job on a Gavel table runs at its type's table there
  (``profiles.gavel.model_on_type``). ``drain(node)`` takes a node out of scheduling (its jobs run on).
- **Issue 23**: a job may carry its true model per GPU type (``type_models``, e.g. the Sia tables):
  it runs at that type's speed wherever it starts, whatever the policy knows. A start on another type
  than the job's last start is a *move* (``moves``); GPU-seconds are kept per type (``gpu_s_by_type``).

The clock only moves through :meth:`advance_to`, which processes the internal events (start-up done,
checkpoint written, job complete) in time order. Time integrals (GPU-seconds in use, GPU-seconds
lost to rescales) are kept for the simulator's metrics. Nothing here reads a file or the wall clock.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from slurm_elastic.backends.base import (
    PENDING,
    RUNNING,
    JobNotRequeueable,
    JobRecord,
    NodeRecord,
    SlurmBackend,
    SlurmError,
)
from slurm_elastic.profiles.base import ThroughputModel
from slurm_elastic.spec import SpecError, parse_decision, parse_spec

COMPLETED = "COMPLETED"

# Phases of a running elastic job.
STARTING = "starting"
TRAINING = "training"
CHECKPOINTING = "checkpointing"
ACKED = "acked"


@dataclass
class SimJob:
    job_id: int
    name: str
    user: str
    partition: str
    comment: str
    submit_time: float
    gpus_per_node: int
    num_nodes: int
    held: bool
    requeueable: bool = True
    hold_reason: str = "JobHeldUser"  # the plugin's submit hold, as Slurm shows it; root's holds: JobHeldAdmin
    account: str = ""
    admin_comment: str = ""
    total_samples: float | None = None  # elastic jobs
    duration_s: float | None = None  # non-elastic jobs
    model: ThroughputModel | None = None
    efficiency: object | None = None  # goodput work model: batch -> statistical efficiency (None: 1)
    grad_trace: object | None = None  # goodput work model over time: efficiency(batch, progress), next_change
    checkpoint_s: float = 10.0
    restart_s: float = 35.0
    startup_s: float = 0.0
    state: str = PENDING
    phase: str = ""
    nodes: list[int] = field(default_factory=list)
    processed: float = 0.0
    checkpointed: float = 0.0
    rate: float = 0.0
    last_update: float = 0.0
    run_start: float = 0.0
    first_start: float | None = None
    end_time: float | None = None
    excluded: frozenset = frozenset()  # node indices it may not start on (ExcNodeList)
    restart_count: int = 0
    acked: bool = False
    version: int = 0
    gpu_s: float = 0.0
    run_s: float = 0.0  # seconds it ran (held GPUs), over all its runs
    lost_gpu_s: float = 0.0  # GPU-seconds held while checkpointing or restarting
    startup_gpu_s: float = 0.0
    rescales: int = 0
    record: JobRecord | None = None
    gpu_type: str = ""  # requested GPU type ("" = any)
    batch: int = 0
    local_batch: int = 0
    accum: int = 1
    size_history: list[tuple[float, int, int]] = field(default_factory=list)  # (time, gpus, batch)
    # Heterogeneous runs: the job's true model per GPU type (the speed it runs at there; the policy may
    # know less), the type of its last start, starts on another type than the last, GPU-seconds by type.
    type_models: dict | None = None
    last_type: str | None = None
    moves: int = 0
    gpu_s_by_type: dict = field(default_factory=dict)

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.num_nodes

    @property
    def elastic(self) -> bool:
        return self.total_samples is not None


class SimulatedSlurm(SlurmBackend):
    """See the module docstring."""

    def __init__(
        self,
        nodes: int = 16,
        gpus_per_node: int = 4,
        *,
        partition: str = "gpu",
        checkpoint_s: float = 10.0,
        restart_s: float = 35.0,
        startup_s: float = 0.0,
        first_job_id: int = 1,
        groups=None,
    ):
        if groups:
            groups = [(int(c), int(g), str(p), str(t)) for c, g, p, t in groups]
            nodes = sum(c for c, *_ in groups)
        if nodes < 1 or gpus_per_node < 1:
            raise ValueError("a simulated cluster needs at least one node with one GPU")
        self.now = 0.0
        groups = groups or [(nodes, gpus_per_node, partition, "")]
        self.node_size = [g for c, g, _, _ in groups for _ in range(c)]
        self.node_part = [p for c, _, p, _ in groups for _ in range(c)]
        self.node_type = [t for c, _, _, t in groups for _ in range(c)]
        self.partition = ",".join(dict.fromkeys(self.node_part))  # a job without one may use every partition
        self.node_names = [f"sim{i:04d}" for i in range(nodes)]
        self.node_gpus = max(self.node_size)
        self.free = list(self.node_size)
        self.total_gpus = sum(self.node_size)
        self.drained: set[int] = set()
        self.checkpoint_s = checkpoint_s
        self.restart_s = restart_s
        self.startup_s = startup_s
        self.jobs: dict[int, SimJob] = {}
        self.active: dict[int, SimJob] = {}
        self.finished: list[SimJob] = []
        self._next_id = first_job_id
        self._events: list[tuple[float, int, int, int, str]] = []
        self._seq = 0
        self._queue: list[int] = []  # pending, released jobs, submit order
        self._dirty = False
        self.in_use = 0
        self.peak_in_use = 0
        self.busy_gpu_s = 0.0
        self._nodes_cache: list[NodeRecord] | None = None
        self._node_recs: list[NodeRecord | None] = [None] * nodes
        self.on_complete = None  # optional callback(job)

    # ---- job submission (what sbatch would do) ----
    def submit(
        self,
        *,
        name: str,
        gpus_per_node: int,
        num_nodes: int = 1,
        comment: str = "",
        user: str = "user",
        account: str = "",
        held: bool | None = None,
        total_samples: float | None = None,
        duration_s: float | None = None,
        model: ThroughputModel | None = None,
        requeueable: bool = True,
        efficiency=None,
        grad_trace=None,
        checkpoint_s: float | None = None,
        restart_s: float | None = None,
        startup_s: float | None = None,
        partition: str | None = None,
        gpu_type: str = "",
        type_models: dict | None = None,
    ) -> int:
        if (total_samples is None) == (duration_s is None):
            raise ValueError("a simulated job needs exactly one of total_samples (elastic) or duration_s")
        if total_samples is not None and model is None:
            raise ValueError("an elastic simulated job needs a throughput model")
        if gpus_per_node > self.node_gpus:
            raise SlurmError(f"job {name}: {gpus_per_node} GPUs per node on nodes of {self.node_gpus}")
        job_id = self._next_id
        self._next_id += 1
        elastic = total_samples is not None
        j = SimJob(
            job_id=job_id,
            name=name,
            user=user,
            account=account,
            partition=partition or self.partition,
            gpu_type=gpu_type,
            comment=comment,
            submit_time=self.now,
            gpus_per_node=gpus_per_node,
            num_nodes=num_nodes,
            held=elastic if held is None else held,
            requeueable=requeueable,
            total_samples=total_samples,
            duration_s=duration_s,
            model=model,
            efficiency=efficiency,
            grad_trace=grad_trace,
            checkpoint_s=self.checkpoint_s if checkpoint_s is None else checkpoint_s,
            restart_s=self.restart_s if restart_s is None else restart_s,
            startup_s=self.startup_s if startup_s is None else startup_s,
            last_update=self.now,
            type_models=type_models,
        )
        self.jobs[job_id] = j
        self.active[job_id] = j
        if not j.held:
            self._queue.append(job_id)
            self._dirty = True
        self._schedule()
        return job_id

    # ---- the clock ----
    def next_event_time(self) -> float:
        while self._events:
            t, _, job_id, version, _ = self._events[0]
            j = self.jobs[job_id]
            if j.version == version:
                return t
            heapq.heappop(self._events)
        return math.inf

    def advance_to(self, t: float) -> None:
        """Move the clock to ``t``, processing every internal event up to and including ``t``."""
        if t < self.now:
            raise ValueError(f"the clock cannot go back ({t} < {self.now})")
        while self._events and self._events[0][0] <= t:
            te, _, job_id, version, kind = heapq.heappop(self._events)
            j = self.jobs[job_id]
            if j.version != version:
                continue
            self._tick(te)
            if kind == "train":
                self._begin_training(j)
            elif kind == "ack":
                self._on_ack(j)
            elif kind == "done":
                self._complete(j)
            elif kind == "stats":
                self._on_stats(j)
                continue
            self._schedule()
        self._tick(t)

    def _tick(self, t: float) -> None:
        if t > self.now:
            self.busy_gpu_s += self.in_use * (t - self.now)
            self.now = t

    def _push(self, t: float, j: SimJob, kind: str) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, j.job_id, j.version, kind))

    def _changed(self, j: SimJob) -> None:
        j.version += 1
        j.record = None

    # ---- job lifecycle ----
    def _accrue(self, j: SimJob) -> None:
        if j.phase == TRAINING and j.rate > 0:
            j.processed += j.rate * (self.now - j.last_update)
        j.last_update = self.now

    def _start(self, j: SimJob, nodes: list[int]) -> None:
        for n in nodes:
            self.free[n] -= j.gpus_per_node
            self._node_recs[n] = None
            if self.free[n] < 0:
                raise AssertionError(f"node {self.node_names[n]} over-allocated")
        self.in_use += j.gpus
        self.peak_in_use = max(self.peak_in_use, self.in_use)
        self._nodes_cache = None
        self._changed(j)
        j.state = RUNNING
        j.nodes = nodes
        j.run_start = self.now
        j.last_update = self.now
        j.acked = False
        if j.first_start is None:
            j.first_start = self.now
        t = self.node_type[nodes[0]] if nodes else ""
        if j.last_type is not None and t != j.last_type:
            j.moves += 1
        j.last_type = t
        if not j.elastic:
            j.phase = TRAINING
            self._push(self.now + j.duration_s, j, "done")
            return
        j.phase = STARTING
        delay = j.restart_s if j.restart_count > 0 else j.startup_s
        if j.restart_count > 0:
            j.lost_gpu_s += delay * j.gpus
        else:
            j.startup_gpu_s += delay * j.gpus
        self._push(self.now + delay, j, "train")

    def _begin_training(self, j: SimJob) -> None:
        self._changed(j)
        j.phase = TRAINING
        j.last_update = self.now
        j.rate = self._rate(j)
        j.size_history.append((self.now, j.gpus, j.batch))
        if j.rate <= 0:
            raise SlurmError(f"job {j.job_id}: throughput model gave {j.rate} samples/s")
        self._push_next(j)

    def _push_next(self, j: SimJob) -> None:
        """The job's next event at its current rate: done, or (trace work model) the next change of
        its gradient statistics, where its rate is recomputed."""
        remaining = max(0.0, j.total_samples - j.processed)
        if j.grad_trace is not None:
            nxt = j.grad_trace.next_change(j.processed)
            if nxt < j.total_samples:
                self._push(self.now + max(nxt - j.processed, 0.0) / j.rate + 1e-9, j, "stats")
                return
        self._push(self.now + remaining / j.rate, j, "done")

    def _on_stats(self, j: SimJob) -> None:
        self._accrue(j)
        j.rate = self._rate(j)
        self._push_next(j)

    def noise_scale(self, j: SimJob) -> float | None:
        """What the in-job library would report now: the noise scale at its batch and progress."""
        if j.grad_trace is None or j.phase != TRAINING or not j.batch:
            return None
        return j.grad_trace.noise_scale(j.batch, self.progress(j))

    def progress(self, j: SimJob) -> float:
        """Work done so far (samples, at the app's initial batch under the goodput work model)."""
        if j.phase == TRAINING and j.rate > 0 and j.end_time is None:
            return j.processed + j.rate * (self.now - j.last_update)
        return j.processed

    def running_s(self, j: SimJob) -> float:
        """Seconds the job has held GPUs, over all its runs (what Slurm shows the daemon)."""
        return j.run_s + ((self.now - j.run_start) if j.nodes else 0.0)

    def attained_gpu_s(self, j: SimJob) -> float:
        return j.gpu_s + (j.gpus * (self.now - j.run_start) if j.nodes else 0.0)

    def _rate(self, j: SimJob) -> float:
        try:
            d = parse_decision(j.admin_comment, j.job_id)
        except SpecError:
            d = None
        if d is not None and d.gpus == j.gpus:
            j.batch, j.local_batch, j.accum = d.batch, d.local_batch, d.accum
        else:
            try:
                spec = parse_spec(j.comment, j.job_id)
            except SpecError as e:
                raise SlurmError(f"job {j.job_id}: no usable decision and no spec: {e}") from e
            b = spec.requested_batch
            split = spec.split_batch(j.gpus, b)
            if split is None:
                raise SlurmError(f"job {j.job_id}: requested batch {b} cannot run on {j.gpus} GPUs")
            j.batch, j.local_batch, j.accum = b, split[0], split[1]
        model = self.true_model(j)
        rate = model.samples_per_s(j.gpus, j.num_nodes, j.local_batch, j.accum)
        if j.grad_trace is not None:
            rate *= j.grad_trace.efficiency(j.batch, j.processed)
        elif j.efficiency is not None:
            rate *= float(np.asarray(j.efficiency(np.array([float(j.batch)])))[0])
        return rate

    def true_model(self, j: SimJob, gpu_type: str | None = None) -> ThroughputModel:
        """The speed ``j`` runs at on ``gpu_type`` (default: the type of its nodes): its per-type table
        when it has one, else a Gavel table of that type (profiles.gavel.model_on_type), else its model."""
        t = gpu_type if gpu_type is not None else (self.node_type[j.nodes[0]] if j.nodes else "")
        if not t:
            return j.model
        if j.type_models and t in j.type_models:
            return j.type_models[t]
        from slurm_elastic.profiles.gavel import model_on_type

        return model_on_type(j.model, t) or j.model

    def _on_ack(self, j: SimJob) -> None:
        self._changed(j)
        j.phase = ACKED
        j.acked = True
        j.checkpointed = j.processed

    def _free_nodes(self, j: SimJob) -> None:
        for n in j.nodes:
            self.free[n] += j.gpus_per_node
            self._node_recs[n] = None
        self.in_use -= j.gpus
        self._nodes_cache = None
        t = self.node_type[j.nodes[0]] if j.nodes else ""
        j.gpu_s_by_type[t] = j.gpu_s_by_type.get(t, 0.0) + j.gpus * (self.now - j.run_start)
        j.gpu_s += j.gpus * (self.now - j.run_start)
        j.run_s += self.now - j.run_start
        j.nodes = []
        self._dirty = True

    def _complete(self, j: SimJob) -> None:
        self._accrue(j)
        self._free_nodes(j)
        self._changed(j)
        j.state = COMPLETED
        j.phase = ""
        j.end_time = self.now
        del self.active[j.job_id]
        self.finished.append(j)
        if self.on_complete is not None:
            self.on_complete(j)

    def _schedule(self) -> None:
        if not self._dirty:
            return
        self._dirty = False
        still = []
        for job_id in self._queue:
            j = self.jobs[job_id]
            if j.state != PENDING or j.held:
                continue
            nodes = self._place(j.gpus_per_node, j.num_nodes, j)
            if nodes is None:
                still.append(job_id)
            else:
                self._start(j, nodes)
        self._queue = still

    def _place(self, gpn: int, count: int, j: SimJob | None = None) -> list[int] | None:
        if gpn * count > self.total_gpus - self.in_use:
            return None
        parts = set(j.partition.split(",")) if j is not None else None
        want = j.gpu_type if j is not None else ""
        avoid = j.excluded if j is not None else frozenset()
        cands = [i for i, f in enumerate(self.free) if f >= gpn and i not in self.drained and i not in avoid
                 and (parts is None or self.node_part[i] in parts) and (not want or self.node_type[i] == want)]
        if len(cands) < count:
            return None
        # one group (partition x type): best fit inside the first group that holds the job
        by: dict = {}
        for i in cands:
            by.setdefault((self.node_part[i], self.node_type[i]), []).append(i)
        for group in by.values():
            if len(group) >= count:
                group.sort(key=lambda i: (self.free[i], i))
                return group[:count]
        return None

    def drain(self, name: str) -> None:
        """Take a node out of scheduling (Slurm's DRAIN): what runs there runs on, nothing new starts."""
        i = self.node_names.index(name)
        self.drained.add(i)
        self._node_recs[i] = None
        self._nodes_cache = None

    def _get(self, job_id: int) -> SimJob:
        j = self.active.get(job_id)
        if j is None:
            raise SlurmError(f"Invalid job id specified: {job_id}")
        return j

    # ---- SlurmBackend ----
    def list_jobs(self) -> list[JobRecord]:
        out = []
        for j in self.active.values():
            if j.record is None:
                j.record = JobRecord(
                    job_id=j.job_id,
                    name=j.name,
                    user=j.user,
                    account=j.account,
                    partition=j.partition,
                    gpu_type=j.gpu_type,
                    state=j.state,
                    state_reason=j.hold_reason if j.held else "",
                    gpus_per_node=j.gpus_per_node,
                    gpus_total=j.gpus,
                    node_count=j.num_nodes,
                    nodes=tuple(self.node_names[n] for n in j.nodes),
                    comment=j.comment,
                    admin_comment=j.admin_comment,
                    restart_count=j.restart_count,
                    priority=0 if j.held else None,
                    held=j.held,
                    requeueable=j.requeueable,
                    submit_time=int(j.submit_time),
                    start_time=int(j.run_start) if j.state == RUNNING else None,
                )
            out.append(j.record)
        return out

    def get_job(self, job_id: int, include_finished: bool = False) -> JobRecord | None:
        j = self.active.get(job_id)
        if j is None:
            return None
        if j.record is None:
            self.list_jobs()
        return j.record

    def list_nodes(self) -> list[NodeRecord]:
        if self._nodes_cache is None:
            recs = self._node_recs
            for i, rec in enumerate(recs):
                if rec is None:
                    size = self.node_size[i]
                    used = size - self.free[i]
                    state = "IDLE" if used == 0 else ("ALLOCATED" if used == size else "MIXED")
                    recs[i] = NodeRecord(self.node_names[i], state, ("DRAIN",) if i in self.drained else (), size,
                                         used, 0, (self.node_part[i],), self.node_type[i])
            self._nodes_cache = list(recs)
        return list(self._nodes_cache)

    def hold(self, job_id: int) -> None:
        j = self._get(job_id)
        if j.state != PENDING:
            raise SlurmError(f"job {job_id} is not pending")
        self._changed(j)
        j.held = True
        j.hold_reason = "JobHeldAdmin"

    def release(self, job_id: int) -> None:
        j = self._get(job_id)
        if j.state != PENDING:
            raise SlurmError(f"job {job_id} is not pending")
        self._changed(j)
        if j.held:
            j.held = False
            self._queue.append(job_id)
        self._dirty = True
        self._schedule()

    requeue_settles_at_once = True

    def requeue_hold(self, job_id: int, *, wait: bool = True) -> None:  # done at once: nothing to wait for
        j = self._get(job_id)
        if j.state != RUNNING:
            raise SlurmError(f"job {job_id} is not running")
        if not j.requeueable:
            raise JobNotRequeueable(f"job {job_id} is not requeueable")
        self._accrue(j)
        if j.elastic:
            j.processed = j.checkpointed  # work since the last checkpoint is lost
        self._free_nodes(j)
        self._changed(j)
        j.state = PENDING
        j.phase = ""
        j.held = True
        j.hold_reason = "JobHeldUser"  # as Slurm shows a requeuehold, whoever ran it
        j.acked = False
        j.rate = 0.0
        j.restart_count += 1
        j.rescales += 1
        self._schedule()

    def update_job(
        self,
        job_id: int,
        *,
        gpus_per_node: int | None = None,
        num_nodes: int | None = None,
        num_tasks: int | None = None,
        start_now: bool = False,
        admin_comment: str | None = None,
        partition: str | None = None,
        gpu_type: str | None = None,
        exclude_nodes: tuple[str, ...] | None = None,
    ) -> None:
        j = self._get(job_id)
        if j.state != PENDING:
            raise SlurmError(f"job {job_id} is not pending; cannot change its size")
        if gpus_per_node is not None and not 1 <= gpus_per_node <= self.node_gpus:
            raise SlurmError(f"job {job_id}: {gpus_per_node} GPUs per node on nodes of {self.node_gpus}")
        if num_nodes is not None and not 1 <= num_nodes <= len(self.node_names):
            raise SlurmError(f"job {job_id}: {num_nodes} nodes on a cluster of {len(self.node_names)}")
        self._changed(j)
        if gpus_per_node is not None:
            j.gpus_per_node = gpus_per_node
        if num_nodes is not None:
            j.num_nodes = num_nodes
        if admin_comment is not None:
            j.admin_comment = admin_comment
        if partition is not None:
            j.partition = partition
        if gpu_type is not None:
            j.gpu_type = gpu_type
        if exclude_nodes is not None:
            j.excluded = frozenset(self.node_names.index(n) for n in exclude_nodes if n in self.node_names)

    def signal(self, job_id: int, signal: str = "USR2", *, batch_only: bool = False) -> None:
        j = self._get(job_id)
        if j.state != RUNNING:
            raise SlurmError(f"job {job_id} is not running")
        if signal != "USR2" or not j.elastic or j.phase in (CHECKPOINTING, ACKED):
            return
        self._accrue(j)
        self._changed(j)
        j.phase = CHECKPOINTING
        j.rate = 0.0
        j.lost_gpu_s += j.checkpoint_s * j.gpus
        self._push(self.now + j.checkpoint_s, j, "ack")

    def checkpoint_acked(self, job_id: int) -> bool:
        j = self.active.get(job_id)
        return j is not None and j.acked

    def version(self) -> str:
        return "simulated"

    # ---- for the simulator ----
    def elastic_active(self) -> Iterable[SimJob]:
        return (j for j in self.active.values() if j.elastic)
