"""The daemon: every ``poll_interval_s`` read Slurm, solve, plan, enact; durable and single-instance.

It drives :func:`slurm_elastic.enact.run_cycle` (the simulator drives the same function) over the CLI
backend, with three things the simulator does not need:

- a **journal** (:class:`DBJournal`) that writes an intent to SQLite before every step of every
  action, and :func:`reconcile` that finishes or rolls back open intents at start and every cycle;
- a **checkpoint-ack source** (:class:`CheckpointDirAck`): a job's stop acknowledgement is the file
  the in-job library writes in its ``ckpt_dir`` (``stop-ack.<job>.<restart>.json``);
- **online profiles** (:class:`ModelRegistry`): the throughput a job reports in its ``ckpt_dir``
  refits its parametric model, falling back to its named profile, its declared points, or a default.

Failures of Slurm (a timeout, garbled JSON, slurmctld down) skip the cycle with a log line and back
off; nothing is acted on from a partial read. The daemon never cancels a job.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from slurm_elastic import planner as pl
from slurm_elastic.backends.base import JobRecord, SlurmBackend, SlurmError, SlurmParseError
from slurm_elastic.daemon.caps import CappedPolicy
from slurm_elastic.daemon.config import DaemonConfig, load_config
from slurm_elastic.daemon.metrics import Metrics, MetricsServer
from slurm_elastic.daemon.state import DaemonLock, StateDB, action_from_json
from slurm_elastic.enact import CycleState, Enactor, run_cycle
from slurm_elastic.profiles import Observation, ParametricModel, model_for_spec
from slurm_elastic.profiles.base import ThroughputModel
from slurm_elastic.spec import ElasticSpec, SpecError, parse_spec

log = logging.getLogger("slurm_elastic.daemon")


class LogfmtFormatter(logging.Formatter):
    """``ts=... level=info event=... job=12 reason="..."``: one line per decision or action."""

    def format(self, record: logging.LogRecord) -> str:
        fields = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created)),
                  "level": record.levelname.lower(), "msg": record.getMessage()}
        fields.update(getattr(record, "kv", {}) or {})
        out = []
        for k, v in fields.items():
            s = str(v)
            if s == "" or any(c in s for c in ' "=\\\n'):
                s = '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
            out.append(f"{k}={s}")
        return " ".join(out)


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(LogfmtFormatter())
    root = logging.getLogger("slurm_elastic")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def event(level: int, msg: str, **kv) -> None:
    log.log(level, msg, extra={"kv": kv})


# Assumed until a job reports throughput or names a profile: ~0.1 s compute per 100 samples per GPU,
# all-reduce 10 ms + 2 ms per extra GPU, 20 ms more across nodes (about 85% efficiency at 8 GPUs).
DEFAULT_MODEL = ParametricModel([0.01, 0.001, 0.01, 0.002, 0.02, 0.005], name="default")


MIN_FIT_GPU_COUNTS = 3


@dataclass
class ModelRegistry:
    """Throughput model per job: online fit of reported points, else profile/points, else default."""

    node_size: int = 4
    _fits: dict = field(default_factory=dict)
    sources: dict = field(default_factory=dict)  # job id -> "reported (n points)" | "profile" | ...

    def reported(self, job: JobRecord, spec: ElasticSpec) -> list[Observation]:
        d = spec.checkpoint_dir(job.job_id, job.work_dir)
        if not d:
            return []
        from slurm_elastic.train.protocol import read_throughput

        try:
            points = read_throughput(d)
        except (OSError, ValueError):
            return []
        obs = []
        for p in points:
            try:
                k, b, sps = int(p["gpus"]), int(p["batch"]), float(p["samples_per_s"])
            except (TypeError, ValueError):
                continue
            split = spec.split_batch(k, b)
            if split is None or sps <= 0:
                continue
            nodes = 1 if k <= self.node_size else -(-k // self.node_size)
            obs.append(Observation(k, nodes, split[0], split[1], sps))
        return obs

    def __call__(self, job: JobRecord, spec: ElasticSpec) -> ThroughputModel:
        obs = self.reported(job, spec)
        # A six-term fit from reports at one or two GPU counts extrapolates wildly to the others (seen
        # on the local cluster: a 4x error), so the job's prior stays in charge until it has reported
        # at three or more GPU counts.
        if len({o.gpus for o in obs}) >= MIN_FIT_GPU_COUNTS:
            key = (job.job_id, tuple(obs))
            model = self._fits.get(key)
            if model is None:
                model = ParametricModel.fit(obs, name=f"job{job.job_id}")
                self._fits = {k: v for k, v in self._fits.items() if k[0] != job.job_id}
                self._fits[key] = model
            self.sources[job.job_id] = f"reported ({len(obs)} points)"
            return model
        if spec.profile or spec.points:
            self.sources[job.job_id] = f"profile {spec.profile}" if spec.profile else "declared points"
            return model_for_spec(spec, self.node_size, job.job_id)
        self.sources[job.job_id] = "default"
        return DEFAULT_MODEL


class CheckpointDirAck:
    """A job acknowledged a stop when its ``stop-ack.<job>.<restart>.json`` is in its ckpt_dir."""

    def __init__(self, records):
        self.records = records  # callable: job id -> JobRecord of the latest read

    def checkpoint_acked(self, job_id: int) -> bool:
        from slurm_elastic.train.protocol import read_ack

        job = self.records().get(int(job_id))
        if job is None:
            return False
        try:
            spec = parse_spec(job.comment, job.job_id)
        except SpecError:
            return False
        d = spec.checkpoint_dir(job.job_id, job.work_dir)
        if not d:
            return False
        try:
            return read_ack(d, job.job_id, job.restart_count) is not None
        except (OSError, ValueError):
            return False


class DBJournal:
    """Intents before every step; the decision log after every outcome."""

    def __init__(self, db: StateDB, daemon: Daemon):
        self.db = db
        self.daemon = daemon

    def step(self, action: pl.Action, step: str) -> None:
        job = self.daemon.records.get(int(action.job_id))
        self.db.write_intent(action, step, job.restart_count if job else None)
        event(logging.INFO, "action step", job=action.job_id, action=action.kind, step=step)

    def finish(self, action: pl.Action, status: str, message: str) -> None:
        intent = {i["job_id"]: i for i in self.db.open_intents()}.get(int(action.job_id))
        if status == "error" and intent and intent["step"] in ("update", "release"):
            # The job may be held by us: keep the intent so reconcile() releases it.
            event(logging.ERROR, "action failed after requeue; will retry placing", job=action.job_id,
                  action=action.kind, error=message)
        else:
            self.db.close_intent(action.job_id)
        self.daemon.record_result(action, status, message)


def reconcile(db: StateDB, backend: SlurmBackend, enactor: Enactor, journal: DBJournal) -> list[str]:
    """Finish or roll back every open intent against what Slurm says now. Returns what it did."""
    done = []
    for intent in db.open_intents():
        jid = intent["job_id"]
        if jid in enactor.in_flight:
            try:
                job = backend.get_job(jid)
            except SlurmError:
                continue
            if job is None or not (job.is_running or job.is_completing):
                # It ended (or Slurm requeued it) while we waited for its ack: nothing left to resize.
                del enactor.in_flight[jid]
                db.close_intent(jid)
                done.append(f"job {jid}: in-flight resize dropped, the job is {job.state if job else 'gone'}")
            continue
        try:
            action = action_from_json(intent["action"])
        except (ValueError, TypeError) as e:
            db.close_intent(jid)
            done.append(f"job {jid}: unreadable intent dropped ({e})")
            continue
        step = intent["step"]
        try:
            job = backend.get_job(jid)
        except SlurmError as e:
            done.append(f"job {jid}: cannot read it ({e}); intent kept")
            continue
        if job is None:
            db.close_intent(jid)
            done.append(f"job {jid}: gone from Slurm; intent closed")
            continue
        held_by_us = job.is_pending and job.held
        if isinstance(action, pl.Start) or (isinstance(action, pl.Resize) and step in ("update", "release")):
            if held_by_us:
                enactor._place(action)  # update (idempotent) + release
                db.close_intent(jid)
                journal.daemon.record_result(action, "done", "finished after a daemon restart")
                done.append(f"job {jid}: {action.kind} finished after restart (placed at {action.gpus} GPUs)")
            else:
                db.close_intent(jid)
                journal.daemon.record_result(action, "done", "had completed before a daemon restart")
                done.append(f"job {jid}: {action.kind} had completed ({job.state})")
            continue
        if isinstance(action, (pl.Resize, pl.Preempt)):
            if step == "signal" or (step == "requeue_hold" and job.is_running):
                if job.is_running and (intent["restart_count"] is None or job.restart_count == intent["restart_count"]):
                    if step == "signal" and not enactor.ack.checkpoint_acked(jid):
                        # The crash may have come before the signal went out: send it again (a second
                        # USR2 only sets the job's stop flag again). Never once the job has acked: its
                        # tasks are exiting with their handlers gone, and a second USR2 kills them
                        # (exit 140 instead of 75: the job fails instead of waiting for the requeue;
                        # seen on the local cluster by tests/faults).
                        backend.signal(jid, enactor.signal_name)
                    enactor.adopt(action, signalled_at=enactor.clock() - max(0.0, time.time() - intent["updated"]))
                    done.append(f"job {jid}: resize re-adopted, waiting for its checkpoint ack")
                else:
                    db.close_intent(jid)
                    done.append(f"job {jid}: signalled resize no longer applies ({job.state}); dropped")
                continue
            # requeue_hold was done: the job is pending.
            if isinstance(action, pl.Resize):
                if held_by_us:
                    enactor._place(action)
                db.close_intent(jid)
                journal.daemon.record_result(action, "done", "finished after a daemon restart")
                done.append(f"job {jid}: resize finished after restart")
            else:
                db.close_intent(jid)
                done.append(f"job {jid}: preemption finished (job stays held for the daemon)")
    for line in done:
        event(logging.WARNING, "reconcile", detail=line)
    return done


class Daemon:
    """One daemon instance: config, backend, state, enactor; :meth:`cycle` runs one cycle."""

    def __init__(self, config: DaemonConfig, backend: SlurmBackend | None = None, *, config_path=None,
                 dry_run: bool = False, ack=None, clock=time.monotonic):
        from slurm_elastic.backends.cli import CliBackend
        from slurm_elastic.policies import get_policy

        self.config = config
        self.config_path = config_path
        self.dry_run = dry_run
        self.backend = backend or CliBackend(bin_dir=config.slurm_bin, timeout=config.slurm_timeout_s)
        self.metrics = Metrics()
        self.lock = DaemonLock(config.state_dir)
        self.db: StateDB | None = None
        self.models = ModelRegistry()
        self.records: dict[int, JobRecord] = {}
        self.ack = ack if ack is not None else CheckpointDirAck(lambda: self.records)
        self.clock = clock
        self.cycle_no = 0
        self.policy = CappedPolicy(get_policy(config.policy), config.max_gpus_per_job, config.max_gpus_per_user)
        self.state = CycleState()
        self.enactor: Enactor | None = None
        self.journal: DBJournal | None = None
        self.stop_event = threading.Event()
        self.reload_requested = False
        self._stop_asked = False
        self.server: MetricsServer | None = None
        self.backoff_s = 0.0
        self.last_results: list = []

    # ----- lifecycle ---------------------------------------------------------------------------
    def open(self) -> None:
        """Take the lock, open the state, restore books, reconcile open intents, start metrics."""
        self.lock.acquire()
        self.db = StateDB(self.config.state_dir)
        self.journal = DBJournal(self.db, self)
        self.enactor = Enactor(self.backend, self.ack, clock=self.clock, ack_timeout_s=self.config.ack_timeout_s,
                               signal=self.config.signal, journal=None if self.dry_run else self.journal)
        self.state.books = self.db.load_books()
        if not self.dry_run:
            try:
                self.records = {j.job_id: j for j in self.backend.list_jobs()}
                reconcile(self.db, self.backend, self.enactor, self.journal)
            except SlurmError as e:
                event(logging.ERROR, "cannot reconcile at start; will retry next cycle", error=str(e))
        if self.config.metrics_address and not self.dry_run:
            try:
                self.server = MetricsServer(self.metrics, self.config.metrics_address, self.config.metrics_port)
                self.server.start()
                event(logging.INFO, "metrics listening", address=f"{self.server.address[0]}:{self.server.address[1]}")
            except OSError as e:
                event(logging.ERROR, "metrics endpoint not started", error=str(e))
        event(logging.INFO, "daemon started", policy=self.config.policy, state_dir=self.config.state_dir,
              partitions=",".join(self.config.partitions) or "all", dry_run=self.dry_run)

    def close(self) -> None:
        if self.server:
            self.server.stop()
            self.server = None
        if self.db:
            self.db.close()
            self.db = None
        self.lock.release()

    def reload(self) -> None:
        from slurm_elastic.policies import get_policy

        try:
            cfg = load_config(self.config_path)
        except Exception as e:
            event(logging.ERROR, "reload failed; keeping the old configuration", error=str(e))
            return
        self.config = cfg
        self.policy = CappedPolicy(get_policy(cfg.policy), cfg.max_gpus_per_job, cfg.max_gpus_per_user)
        if self.enactor:
            self.enactor.ack_timeout_s = cfg.ack_timeout_s
            self.enactor.signal_name = cfg.signal
        logging.getLogger("slurm_elastic").setLevel(cfg.log_level.upper())
        event(logging.INFO, "configuration reloaded", policy=cfg.policy)

    # ----- one cycle -----------------------------------------------------------------------------
    def record_result(self, action, status: str, message: str) -> None:
        gpus_from = getattr(action, "from_gpus", None)
        gpus_to = getattr(action, "gpus", 0 if action.kind == "preempt" else None)
        decision = getattr(action, "decision", None)
        if self.db:
            self.db.log_decision(self.cycle_no, int(action.job_id), action.kind, status, gpus_from=gpus_from,
                                 gpus_to=gpus_to, batch=decision.batch if decision else None,
                                 reason=getattr(action, "reason", ""), message=message)
        if status == "done" and action.kind in ("resize", "preempt"):
            # The cooldown counts from when the job runs at its new size, not from the signal.
            from dataclasses import replace as _replace

            book = self.state.books.get(action.job_id, pl.JobBook())
            self.state.books[action.job_id] = _replace(book, last_change_s=self.clock())
        self.metrics.inc("slurm_elastic_actions_total", kind=action.kind, outcome=status)
        if action.kind == "resize" and status == "done":
            self.metrics.inc("slurm_elastic_rescales_total", direction="shrink" if action.is_shrink else "grow")
        if status == "error":
            self.metrics.inc("slurm_elastic_errors_total", kind="action")
        event(logging.WARNING if status in ("error", "timeout") else logging.INFO, "action",
              job=action.job_id, action=action.kind, status=status, gpus_from=gpus_from, gpus_to=gpus_to,
              batch=decision.batch if decision else "", reason=getattr(action, "reason", ""), detail=message)

    def cycle(self):
        """Run one cycle; returns the CycleResult, or None when Slurm could not be read."""
        cfg = self.config
        self.cycle_no += 1
        t0 = time.perf_counter()
        self.metrics.inc("slurm_elastic_cycles_total")
        if not self.dry_run and self.enactor is not None:
            # Finish acknowledged resizes *before* the cycle's read, so that the read shows their result.
            try:
                self.enactor.poll()
            except SlurmError as e:
                event(logging.ERROR, "cannot poll in-flight resizes", error=str(e))
        if not self.dry_run and self.db is not None:
            self._crash_policy()
        try:
            records = self.backend.list_jobs()
        except SlurmError as e:
            return self._skip_cycle(e)
        self.records = {j.job_id: j for j in records}
        self.policy.user_of = {j.job_id: j.user for j in records}
        if not self.dry_run and reconcile(self.db, self.backend, self.enactor, self.journal):
            try:  # reconcile acted: read again rather than plan on what it changed
                records = self.backend.list_jobs()
            except SlurmError as e:
                return self._skip_cycle(e)
            self.records = {j.job_id: j for j in records}
        now = self.clock()
        backend = _Snapshotted(self.backend, records)
        try:
            result = run_cycle(
                backend, self.policy, _NoPoll(self.enactor) if not self.dry_run else _DryEnactor(self.enactor), self.state,
                model_for=self.models, now=now,
                planner_config=pl.PlannerConfig(cooldown_s=cfg.cooldown_s, max_in_flight=cfg.max_in_flight,
                                                allow_preemption=cfg.allow_preemption),
                partitions=cfg.partitions or None, default_restart_s=cfg.restart_cost_s, horizon_s=cfg.horizon_s,
            )
        except SlurmError as e:
            return self._skip_cycle(e)
        self.backoff_s = 0.0
        elapsed = time.perf_counter() - t0
        self._after_cycle(result, records, elapsed)
        return result

    def _crash_policy(self) -> None:
        """Requeue failed jobs that have failures left (``max_failures=`` in their spec; daemon/crash.py)."""
        from slurm_elastic.daemon.crash import apply_crash_policy

        try:
            finished = self.backend.list_jobs(include_finished=True)
        except TypeError:  # a backend that does not list finished jobs (simulator, stand-ins)
            return
        except SlurmError as e:
            event(logging.ERROR, "crash policy skipped: cannot read finished jobs", error=str(e))
            return
        apply_crash_policy(finished, self.backend, self.db, event, self.cycle_no)

    def _skip_cycle(self, e: SlurmError) -> None:
        """Slurm could not be read (or answered garbage): act on nothing, log it, back off."""
        kind = "parse" if isinstance(e, SlurmParseError) else "slurm"
        self.metrics.inc("slurm_elastic_errors_total", kind=kind)
        self.backoff_s = min(max(2 * self.backoff_s, self.config.poll_interval_s), 300.0)
        event(logging.ERROR, "cycle skipped: cannot read Slurm", error=str(e), retry_in_s=self.backoff_s)
        return None

    def _after_cycle(self, result, records, elapsed: float) -> None:
        snap = result.snapshot
        for jid, err in snap.errors.items():
            self.metrics.inc("slurm_elastic_errors_total", kind="spec")
            event(logging.WARNING, "bad elastic spec; job not managed", job=jid, error=str(err))
        self.metrics.set("slurm_elastic_cycle_seconds", elapsed)
        self.metrics.set("slurm_elastic_solve_seconds", result.allocation.solve_s)
        self.metrics.set("slurm_elastic_gpus_available", snap.capacity)
        self.metrics.clear("slurm_elastic_jobs")
        counts: dict[str, int] = {}
        for v in snap.views:
            counts[v.status] = counts.get(v.status, 0) + 1
        counts["bad_spec"] = len(snap.errors)
        for state, n in counts.items():
            self.metrics.set("slurm_elastic_jobs", n, state=state)
        self.metrics.set("slurm_elastic_gpus_allocated", sum(v.gpus for v in snap.views if v.status == pl.RUNNING))
        if self.dry_run or self.db is None:
            return
        self.db.save_books(self.state.books)
        rows = []
        plan_reason = {a.job_id: a.reason for a in result.plan.actions}
        problem_jobs = {j.job_id: j for j in snap.problem.jobs}
        for v in snap.views:
            a = result.allocation.jobs.get(v.job_id)
            req = problem_jobs.get(v.job_id)
            sps = eff = None
            if req is not None and v.gpus:
                rec = snap.records.get(v.job_id)
                spec = snap.specs.get(v.job_id)
                batch = v.batch or (spec.requested_batch if spec else None)
                if spec and batch and spec.split_batch(v.gpus, batch):
                    local, accum = spec.split_batch(v.gpus, batch)
                    nodes, _ = spec.placement(v.gpus, snap.node_size)
                    sps = req.model.samples_per_s(v.gpus, nodes, local, accum)
                    one = spec.split_batch(1, batch) or spec.split_batch(1, local)
                    base = req.model.samples_per_s(1, 1, *one) if one else None
                    eff = sps / (v.gpus * base) if base else None
                del rec
            book = self.state.books.get(v.job_id)
            rows.append({
                "job_id": v.job_id, "gpus": v.gpus, "target_gpus": a.gpus if a else None, "batch": v.batch,
                "samples_per_s": sps, "efficiency": eff, "rescales": book.rescales if book else 0,
                "last_change": (time.time() - (self.clock() - book.last_change_s))
                if book and book.last_change_s is not None else None,
                "reason": plan_reason.get(v.job_id) or (a.reason if a else "") or "",
            })
        for jid, err in snap.errors.items():
            rows.append({"job_id": jid, "reason": f"bad spec: {err}"})
        self.db.save_job_views(rows)
        self.db.forget_jobs({j.job_id for j in records})
        self.db.set_meta("last_cycle", {"ts": time.time(), "cycle": self.cycle_no, "seconds": elapsed,
                                        "policy": self.config.policy, "capacity": snap.capacity})

    # ----- the loop ------------------------------------------------------------------------------
    def install_signals(self) -> None:
        def on_term(*_):
            self._stop_asked = True
            self.stop_event.set()

        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
        def on_hup(*_):
            self.reload_requested = True
            self.stop_event.set()  # wake the wait; run_forever clears it again for a reload

        signal.signal(signal.SIGHUP, on_hup)

    def run_forever(self, *, poll_actions_s: float = 2.0) -> None:
        """Cycle every poll_interval_s; in between, move in-flight resizes on every few seconds."""
        while True:
            if self.reload_requested:
                self.reload_requested = False
                if not self._stop_asked:
                    self.stop_event.clear()
                self.reload()
            if self.stop_event.is_set():
                break
            try:
                self.cycle()
            except Exception as e:  # one bad cycle must never end the daemon
                self.metrics.inc("slurm_elastic_errors_total", kind="internal")
                log.exception("cycle failed", extra={"kv": {"error": str(e)}})
            deadline = time.monotonic() + max(self.config.poll_interval_s, self.backoff_s)
            while not self.stop_event.is_set() and not self.reload_requested and time.monotonic() < deadline:
                if self.enactor and self.enactor.in_flight and not self.dry_run:
                    try:
                        self.records = {j.job_id: j for j in self.backend.list_jobs()}
                        self.enactor.poll()
                        self.db.save_books(self.state.books)
                    except SlurmError as e:
                        event(logging.ERROR, "cannot poll in-flight resizes", error=str(e))
                self.stop_event.wait(min(poll_actions_s, max(0.0, deadline - time.monotonic())))
        event(logging.INFO, "daemon stopping", in_flight=len(self.enactor.in_flight) if self.enactor else 0)


class _Snapshotted(SlurmBackend):
    """The backend with ``list_jobs`` answered from this cycle's one read (one read per cycle)."""

    def __init__(self, inner: SlurmBackend, jobs):
        self.inner, self.jobs = inner, jobs

    def list_jobs(self):
        return list(self.jobs)

    def list_nodes(self):
        return self.inner.list_nodes()

    def hold(self, job_id):
        return self.inner.hold(job_id)

    def release(self, job_id):
        return self.inner.release(job_id)

    def requeue_hold(self, job_id):
        return self.inner.requeue_hold(job_id)

    def update_job(self, job_id, **kw):
        return self.inner.update_job(job_id, **kw)

    def signal(self, job_id, signal="USR2", *, batch_only=False):
        return self.inner.signal(job_id, signal, batch_only=batch_only)


class _NoPoll:
    """The enactor as run_cycle sees it: the daemon polls before its one read, so the snapshot stays true."""

    def __init__(self, real: Enactor):
        self.real = real
        self.in_flight = real.in_flight

    def in_flight_targets(self):
        return self.real.in_flight_targets()

    def poll(self):
        return []

    def apply(self, actions):
        return self.real.apply(actions)


class _DryEnactor:
    """Plans without acting (``--dry-run`` and ``plan``): every action is reported, none is taken."""

    def __init__(self, real: Enactor | None):
        self.in_flight = dict(real.in_flight) if real else {}
        self.planned: list = []

    def in_flight_targets(self):
        return {j: (f.action.gpus if isinstance(f.action, pl.Resize) else 0) for j, f in self.in_flight.items()}

    def poll(self):
        return []

    def apply(self, actions):
        from slurm_elastic.enact import ActionResult

        out = []
        for a in actions:
            if a.kind != "leave":
                self.planned.append(a)
                out.append(ActionResult(a, "planned", "dry run: not enacted", 0.0))
        return out


def default_state_dir_for(config_path: str | os.PathLike | None) -> Path:
    return Path(load_config(config_path).state_dir)
