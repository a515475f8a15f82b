"""The discrete-event simulator: a workload through the daemon's own cycle on a simulated Slurm.

Each scheduling cycle (every ``interval_s`` of virtual time) is :func:`slurm_elastic.enact.run_cycle`:
``backend.list_jobs()/list_nodes() -> problem.build_problem -> policy.allocate -> planner.plan ->
Enactor.apply``, the same function the daemon runs, over :class:`SimulatedSlurm` instead of the CLI
backend. Between cycles the engine moves the virtual clock from event to event (arrival, start-up
done, checkpoint acknowledged, job complete); after every event it lets the enactor finish
acknowledged resizes, as the daemon's poll would.

Work model (``work_model="samples"``, the default): a job completes when it has processed its total
samples (the paper's model). With ``work_model="goodput"`` progress accrues at samples/s x the app's
statistical efficiency at the job's batch (``profiles.goodput``; 1 for profiles without such data), and
the total is the work in samples at the app's initial batch: larger batches then need more samples.
Throughput at the (GPUs, batch) a job runs comes from its measured throughput model, which is also the
model the policy sees. A rescale costs ``checkpoint_s`` (job stopped, GPUs held, then it
acknowledges) plus ``restart_s`` after the release (GPUs held at the new size, no progress): with the
defaults 1.5 + 10.5 = 12 s, the real path measured on the local cluster (docs/MEASUREMENTS.md: decision
to training again 12.2 s median, of which 1.3 s signal -> ack -> requeue); a GPU job with a large
checkpoint pays more (set ``restart_s`` in its spec, or the options; see the sensitivity study). The
policy is told the same total as each job's ``restart_s``. A job whose spec gives its own ``restart_s``
pays that total instead, split between checkpoint and restart in the same proportion.

Elastic jobs are submitted held (as the submit plugin holds them); non-elastic jobs are submitted
released and Slurm's own backfill in the simulated backend starts them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from zlib import crc32

from slurm_elastic import enact
from slurm_elastic.backends.base import JobRecord
from slurm_elastic.backends.simulated import SimJob, SimulatedSlurm
from slurm_elastic.claims import ClaimBook, Evidence
from slurm_elastic.enact import CycleState, Enactor
from slurm_elastic.planner import PlannerConfig
from slurm_elastic.policies.base import Policy
from slurm_elastic.problem import JobInfo
from slurm_elastic.profiles import model_for_spec
from slurm_elastic.profiles.base import ThroughputModel
from slurm_elastic.sim.checks import CycleChecks
from slurm_elastic.sim.workloads import WorkloadJob
from slurm_elastic.spec import ElasticSpec, parse_spec


@dataclass(frozen=True)
class SimConfig:
    nodes: int = 16
    gpus_per_node: int = 4
    interval_s: float = 60.0  # scheduling interval (the daemon's polling period)
    checkpoint_s: float = 1.5  # USR2 -> checkpoint written and acknowledged (measured: docs/MEASUREMENTS.md)
    restart_s: float = 10.5  # release -> training again at the new size (measured: docs/MEASUREMENTS.md)
    startup_s: float = 0.0  # first start -> training (the same for every policy)
    horizon_s: float | None = None  # stop the clock here (None: run until every job is done)
    max_time_s: float = 90 * 86400.0  # safety stop for a run that cannot finish
    plan_horizon_s: float = 3600.0  # restart costs are amortised over this (AllocationProblem.horizon_s)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    ack_timeout_s: float = 600.0
    work_model: str = "samples"  # "samples" (the paper's) or "goodput" (Pollux statistical efficiency)
    report_progress: bool = True  # jobs report the work they have left (JobRequest.remaining_samples)
    # of those, this share (picked by a stable hash of the job's name) report none: a site where some
    # users' loops say their dataset size and epochs and others' do not
    silent_share: float = 0.0
    trust_claims: bool = True  # the daemon's trust rule over what jobs report (slurm_elastic.claims)
    # Issue 13: node groups (count, GPUs per node, partition, GPU type) instead of nodes x gpus_per_node
    # in one partition (gpus_per_node still shapes rigid jobs); see backends/simulated.py.
    groups: tuple[tuple[int, int, str, str], ...] | None = None
    # Issue 23: the first start costs the job's rescale total (no progress on its GPUs), as in Pollux's
    # and Sia's simulators; False: it costs ``startup_s`` (0 by default: free).
    first_start_charge: bool = False
    # Issue 23: track running elastic jobs held short of the size their true gain says pays while GPUs
    # sit idle (see ``held_short``); None: not tracked.
    held_bound_s: float | None = None

    @property
    def rescale_cost_s(self) -> float:
        return self.checkpoint_s + self.restart_s

    @property
    def total_gpus(self) -> int:
        if self.groups:
            return sum(c * g for c, g, _, _ in self.groups)
        return self.nodes * self.gpus_per_node


@dataclass
class JobOutcome:
    name: str
    elastic: bool
    arrival_s: float
    start_s: float | None
    end_s: float | None
    total_samples: float
    processed: float
    rescales: int
    lost_gpu_s: float
    gpu_s: float
    sizes: list[tuple[float, int, int]]
    moves: int = 0  # starts on another GPU type than the job's last start
    gpu_s_by_type: dict = field(default_factory=dict)
    held_short_s: float = 0.0  # longest stretch held short of what its true gain pays (held_bound_s runs)

    @property
    def jct_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.arrival_s


@dataclass
class SimResult:
    policy: str
    config: SimConfig
    jobs: list[JobOutcome]
    timeline: list[tuple[float, int]]  # (time, GPUs in use) sampled at every cycle
    end_s: float
    busy_gpu_s: float
    peak_gpus_in_use: int
    cycles: int
    solve_s: float
    wall_s: float
    stopped: str  # "done", "horizon", "stuck", "max_time"
    actions: dict[str, int] = field(default_factory=dict)
    planned_gpu_s: float = 0.0  # GPU-seconds the policy allocated (per cycle, until the next)
    placed_gpu_s: float = 0.0  # of those, GPU-seconds the planner could carry out (placement, cooldown)
    checks: dict = field(default_factory=dict)  # sim.checks: idle GPUs while a job waited, held at a wrong size


class Simulation:
    """One workload under one policy. ``run()`` returns a :class:`SimResult`; same inputs, same result."""

    def __init__(
        self,
        workload: Sequence[WorkloadJob],
        policy: Policy,
        config: SimConfig = SimConfig(),
        *,
        model_for_job: Callable[[WorkloadJob], ThroughputModel] | None = None,
        type_models_for_job: Callable[[WorkloadJob, ThroughputModel], dict] | None = None,
        model_for_type=None,
        model_now=None,
    ):
        """``model_for_job``: the job's model (what the policy sees, and its speed on untyped nodes);
        ``type_models_for_job``: its true model per GPU type (what it runs at there); ``model_for_type``:
        what the policy is told per type (problem.build_problem's rule; None: the daemon's default);
        ``model_now``: ``(record, model, backend) -> model`` each cycle, what the job's reports so far
        make of its model (sim/hetero.py: the type it runs on, what it measured there; None: ``model``)."""
        self.workload = sorted(workload, key=lambda j: j.arrival_s)
        self.policy = policy
        if getattr(policy, "rigid", False) and config.planner.start_smaller:
            # rigid policies (static, tiresias) gang-schedule at the requested size: they wait for their GPUs.
            config = replace(config, planner=replace(config.planner, start_smaller=False))
        if getattr(policy, "preemptive", False) and not config.planner.allow_preemption:
            config = replace(config, planner=replace(config.planner, allow_preemption=True))
        self.config = config
        self._model_for_job = model_for_job or (lambda w: model_for_spec(w.spec, config.gpus_per_node))
        self._type_models_for_job = type_models_for_job
        self._model_for_type = model_for_type
        self._model_now = model_now

    @staticmethod
    def _grad_trace(model: ThroughputModel):
        """The Pollux gradient statistics over training for a model's app (None: efficiency 1)."""
        from slurm_elastic.profiles.goodput import pollux_grad_trace
        from slurm_elastic.profiles.measured import POLLUX_APPS

        app = getattr(model, "app", None)
        return pollux_grad_trace(app) if app in POLLUX_APPS else None

    def run(self, progress: Callable[[int], None] | None = None) -> SimResult:
        cfg = self.config
        wall0 = time.perf_counter()
        backend = SimulatedSlurm(
            cfg.nodes, cfg.gpus_per_node, checkpoint_s=cfg.checkpoint_s, restart_s=cfg.restart_s,
            startup_s=cfg.startup_s, groups=cfg.groups,
        )
        enactor = Enactor(backend, clock=lambda: backend.now, ack_timeout_s=cfg.ack_timeout_s)
        state = CycleState()
        models: dict[int, ThroughputModel] = {}
        by_job: dict[int, WorkloadJob] = {}

        def model_for(record: JobRecord, spec: ElasticSpec) -> ThroughputModel:
            if self._model_now is not None:
                return self._model_now(record, models[record.job_id], backend)
            return models[record.job_id]

        claims = ClaimBook()

        def silent(name: str) -> bool:
            return crc32(name.encode()) % 10000 < cfg.silent_share * 10000

        def job_info(record: JobRecord) -> JobInfo | None:
            """What the simulated job reports, as the in-job library would: its noise scale (while it
            trains), the GPU-seconds it has had and the work it has left; with ``trust_claims``, through
            the daemon's trust rule (slurm_elastic.claims), its true speed standing for the verified one."""
            j = backend.jobs[record.job_id]
            if not j.elastic:
                return None
            trace = j.grad_trace
            ns = backend.noise_scale(j)
            left = max(0.0, j.total_samples - backend.progress(j)) if cfg.report_progress and not silent(j.name) \
                else None
            if cfg.trust_claims:
                spec = parse_spec(j.comment, j.job_id)
                rate = j.rate if j.nodes and j.rate > 0 else None
                t = claims.update(j.job_id, j.user, Evidence(backend.running_s(j), j.gpus if j.nodes else 0, rate,
                                                             max(rate or 0.0, best_rate.get(j.job_id, 0.0)) or None),
                                  seen=backend.progress(j) if left is not None else None,
                                  total=j.total_samples if left is not None else None, noise_scale=ns,
                                  max_batch=spec.max_batch)
                if rate:
                    best_rate[j.job_id] = max(rate, best_rate.get(j.job_id, 0.0))
                ns, left = t.noise_scale, t.remaining_samples
            return JobInfo(
                noise_scale=ns, base_batch=int(trace.b0) if trace is not None else None,
                attained_gpu_s=backend.attained_gpu_s(j), remaining_samples=left,
            )

        best_rate: dict[int, float] = {}

        done_count = 0

        def on_complete(j: SimJob) -> None:
            nonlocal done_count
            done_count += 1
            if j.job_id in claims.jobs:  # it ended: its claim, borne out, credits its user
                claims.forget(set(claims.jobs) - {j.job_id})
            if progress is not None:
                progress(1)

        backend.on_complete = on_complete
        arrivals = self.workload
        ai = 0
        next_tick = 0.0
        cycles = 0
        solve_s = 0.0
        timeline: list[tuple[float, int]] = []
        actions: dict[str, int] = {}
        stopped = "done"
        stop_at = min(cfg.horizon_s if cfg.horizon_s is not None else math.inf, cfg.max_time_s)
        idle_cycles = 0
        held: dict[int, list[float]] = {}  # job -> [stretch start, longest stretch] (held_bound_s runs)
        planned_gpu_s = placed_gpu_s = 0.0
        last_cycle = None
        checks = CycleChecks()

        def true_life(jid, rate: float) -> float | None:
            j = backend.jobs.get(jid)
            return max(0.0, j.total_samples - backend.progress(j)) / rate if j is not None and rate > 0 else None

        while True:
            t_arr = arrivals[ai].arrival_s if ai < len(arrivals) else math.inf
            t = min(t_arr, backend.next_event_time(), next_tick)
            if t > stop_at:
                backend.advance_to(stop_at)
                stopped = "horizon" if cfg.horizon_s is not None and stop_at == cfg.horizon_s else "max_time"
                break
            backend.advance_to(t)
            while ai < len(arrivals) and arrivals[ai].arrival_s <= t:
                w = arrivals[ai]
                ai += 1
                if w.spec is not None:
                    spec = w.spec
                    k = spec.requested_gpus
                    nodes, gpn = spec.placement(k, cfg.gpus_per_node)
                    model = self._model_for_job(w)
                    ck = rs = None
                    if spec.restart_s is not None:  # the job's own rescale cost, split as the defaults are
                        share = cfg.checkpoint_s / cfg.rescale_cost_s if cfg.rescale_cost_s > 0 else 0.0
                        ck, rs = spec.restart_s * share, spec.restart_s * (1.0 - share)
                    first = None
                    if cfg.first_start_charge:  # the first start pays the job's whole rescale cost
                        first = spec.restart_s if spec.restart_s is not None else cfg.rescale_cost_s
                    jid = backend.submit(
                        name=w.name, gpus_per_node=gpn, num_nodes=nodes, comment=spec.to_comment(), user=w.user,
                        total_samples=w.total_samples, model=model, checkpoint_s=ck, restart_s=rs,
                        grad_trace=self._grad_trace(model) if cfg.work_model == "goodput" else None,
                        startup_s=first,
                        type_models=self._type_models_for_job(w, model) if self._type_models_for_job else None,
                    )
                    models[jid] = model
                else:
                    gpn = min(w.gpus, cfg.gpus_per_node)
                    nodes = -(-w.gpus // cfg.gpus_per_node)
                    jid = backend.submit(name=w.name, gpus_per_node=gpn, num_nodes=nodes, user=w.user,
                                         duration_s=w.duration_s)
                by_job[jid] = w
            if enactor.in_flight:
                enactor.poll()
            if t >= next_tick:
                res = enact.run_cycle(  # the daemon's cycle
                    backend, self.policy, enactor, state, model_for=model_for, now=backend.now,
                    planner_config=cfg.planner, default_restart_s=cfg.rescale_cost_s,
                    horizon_s=cfg.plan_horizon_s, job_info=job_info, model_for_type=self._model_for_type,
                )
                if cfg.held_bound_s is not None:
                    held_short(backend, held, cfg)
                if last_cycle is not None:
                    dt = backend.now - last_cycle[0]
                    planned_gpu_s += last_cycle[1] * dt
                    placed_gpu_s += last_cycle[2] * dt
                last_cycle = (backend.now, *_planned_placed(res))
                checks.cycle(res, backend.now, true_life)
                cycles += 1
                solve_s += res.allocation.solve_s
                for r in res.results:
                    key = f"{r.action.kind}:{r.status}"
                    actions[key] = actions.get(key, 0) + 1
                timeline.append((backend.now, backend.in_use))
                next_tick = t + cfg.interval_s
                # A run that cannot progress: nothing arrives, nothing runs, nothing changes.
                if ai >= len(arrivals) and backend.in_use == 0 and not enactor.in_flight and not res.plan.changes:
                    idle_cycles += 1
                    if not backend.active:
                        stopped = "done"
                        break
                    if idle_cycles >= 3:
                        stopped = "stuck"
                        break
                else:
                    idle_cycles = 0
        outcomes = []
        for jid, w in sorted(by_job.items()):
            j = backend.jobs[jid]
            processed = j.processed
            if j.phase == "training" and j.end_time is None:
                processed += j.rate * (backend.now - j.last_update)
            outcomes.append(
                JobOutcome(
                    name=w.name, elastic=w.elastic, arrival_s=w.arrival_s, start_s=j.first_start, end_s=j.end_time,
                    total_samples=w.total_samples, processed=processed, rescales=j.rescales,
                    lost_gpu_s=j.lost_gpu_s, gpu_s=j.gpu_s + (j.gpus * (backend.now - j.run_start) if j.nodes else 0.0),
                    sizes=list(j.size_history), moves=j.moves,
                    gpu_s_by_type=_by_type(backend, j), held_short_s=_longest(held.get(jid), j.end_time or backend.now),
                )
            )
        for w in arrivals[ai:]:
            outcomes.append(JobOutcome(w.name, w.elastic, w.arrival_s, None, None, w.total_samples, 0.0, 0, 0.0, 0.0, []))
        last_end = max((o.end_s for o in outcomes if o.end_s is not None), default=backend.now)
        end = backend.now if stopped != "done" else last_end
        return SimResult(
            policy=getattr(self.policy, "name", type(self.policy).__name__),
            config=cfg,
            jobs=outcomes,
            timeline=timeline,
            end_s=end,
            busy_gpu_s=backend.busy_gpu_s,
            peak_gpus_in_use=backend.peak_in_use,
            cycles=cycles,
            solve_s=solve_s,
            wall_s=time.perf_counter() - wall0,
            stopped=stopped,
            actions=actions,
            planned_gpu_s=planned_gpu_s,
            placed_gpu_s=placed_gpu_s,
            checks=checks.summary(),
        )


def _planned_placed(res) -> tuple[int, int]:
    """GPUs the policy allocated this cycle, and of those the GPUs the planner could carry out (per job,
    the smaller of the allocation and what the job holds or is given after this cycle's actions)."""
    planned = placed = 0
    acts = {a.job_id: a for a in res.plan.actions}
    for v in res.snapshot.views:
        a = res.allocation.jobs.get(v.job_id)
        if a is None or a.gpus <= 0:
            continue
        act = acts.get(v.job_id)
        if act is None:
            got = v.gpus
        elif act.kind in ("start", "resize"):
            got = act.gpus
        elif act.kind in ("preempt", "hold"):
            got = 0
        else:
            got = v.gpus
        planned += a.gpus
        placed += min(a.gpus, got)
    return planned, placed


def _by_type(backend: SimulatedSlurm, j: SimJob) -> dict:
    out = dict(j.gpu_s_by_type)
    if j.nodes:  # still running at the end of the run
        t = backend.node_type[j.nodes[0]]
        out[t] = out.get(t, 0.0) + j.gpus * (backend.now - j.run_start)
    return out


def _longest(h: list[float] | None, now: float) -> float:
    if not h:
        return 0.0
    return max(h[1], (now - h[0]) if h[0] >= 0 else 0.0)


def held_short(backend: SimulatedSlurm, held: dict[int, list[float]], cfg: SimConfig) -> None:
    """Per cycle: which running elastic jobs are held short of the size their true gain says pays.

    By the simulator's truth (the job's true per-type speed), not by what the policy could know: the
    other measure, ``sim/checks.held_wrong``, asks the same of the job's own measured model. A job is
    *held short* while GPUs of its type sit idle and growing onto them (up to its maximum, at
    the batch that scales with it, on its true per-type speed and statistical efficiency) would save
    more of its remaining time than one rescale costs: ``remaining / rate x (1 - rate / rate_grown) >
    restart``. ``held[job] = [start of the current stretch (-1: none), longest stretch]``; a run counts
    the jobs whose longest stretch exceeds ``cfg.held_bound_s`` (metrics)."""
    idle_by_type: dict[str, int] = {}
    for i, f in enumerate(backend.free):
        if i not in backend.drained:
            idle_by_type[backend.node_type[i]] = idle_by_type.get(backend.node_type[i], 0) + f
    now = backend.now
    for j in backend.elastic_active():
        h = held.setdefault(j.job_id, [-1.0, 0.0])
        wrong = False
        if j.nodes and j.phase == "training" and j.rate > 0:
            t = backend.node_type[j.nodes[0]]
            idle = idle_by_type.get(t, 0)
            if idle > 0:
                wrong = _grow_pays(backend, j, t, idle)
        if wrong and h[0] < 0:
            h[0] = now
        elif not wrong and h[0] >= 0:
            h[1] = max(h[1], now - h[0])
            h[0] = -1.0


@lru_cache(maxsize=4096)
def _spec_of(comment: str, job_id: int) -> ElasticSpec:
    return parse_spec(comment, job_id)


def _grow_pays(backend: SimulatedSlurm, j: SimJob, t: str, idle: int) -> bool:
    spec = _spec_of(j.comment, j.job_id)
    k = min(spec.max_gpus, j.gpus + idle)
    if k <= j.gpus:
        return False
    model = backend.true_model(j, t)
    size = max(backend.node_size[i] for i in range(len(backend.node_type)) if backend.node_type[i] == t)
    best = 0.0
    for b in {j.batch, min(spec.max_batch, j.batch * k // max(1, j.gpus))}:
        split = spec.split_batch(k, b)
        if split is None:
            continue
        try:
            nodes = spec.placement(k, size)[0]
        except ValueError:
            continue
        if model.max_gpus is not None and k > model.max_gpus:
            continue
        r = model.samples_per_s(k, nodes, split[0], split[1])
        if j.grad_trace is not None:
            r *= j.grad_trace.efficiency(b, backend.progress(j))
        best = max(best, r)
    if best <= j.rate:
        return False
    left = max(0.0, j.total_samples - backend.progress(j)) / j.rate
    return left * (1.0 - j.rate / best) > j.checkpoint_s + j.restart_s
