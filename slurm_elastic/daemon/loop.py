"""The daemon: every ``poll_interval_s`` read Slurm, solve, plan, enact; durable and single-instance.

It drives :func:`slurm_elastic.enact.run_cycle` (the simulator drives the same function) over the CLI
backend, with three things the simulator does not need, each in its own module:

- a **journal** (``journal.py``: :class:`DBJournal`) that writes an intent to SQLite before every step
  of every action, and :func:`reconcile` that finishes or rolls back open intents at start and every cycle;
- a **checkpoint-ack source** (``acks.py``: :class:`CheckpointDirAck`): a job's stop acknowledgement is
  the file the in-job library writes in its ``ckpt_dir`` (``stop-ack.<job>.<restart>.json``);
- **learned job models** (``models.py``: :class:`ModelRegistry`): what a job reports in its ``ckpt_dir``
  (throughput, gradient noise scale, first step after each restart) updates its model from the first
  report on, over a prior (its named profile, its declared points, or a conservative default);
  measured restart costs go to the decision log.

Failures of Slurm (a timeout, garbled JSON, slurmctld down) skip the cycle with a log line and back
off; nothing is acted on from a partial read. The daemon never cancels a job.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

from slurm_elastic import planner as pl
from slurm_elastic.backends.base import (
    ACTIVE_STATES,
    JobRecord,
    SlurmBackend,
    SlurmError,
    SlurmParseError,
    preemption_refusal,
)
from slurm_elastic.claims import ClaimBook
from slurm_elastic.daemon.acks import CheckpointDirAck
from slurm_elastic.daemon.caps import CappedPolicy
from slurm_elastic.daemon.config import ConfigError, DaemonConfig, check_managed_partitions, load_config
from slurm_elastic.daemon.journal import DBJournal, reconcile
from slurm_elastic.daemon.logfmt import event, log, setup_logging
from slurm_elastic.daemon.metrics import Metrics, MetricsServer
from slurm_elastic.daemon.models import MAX_RATIO_JOBS, ModelRegistry
from slurm_elastic.daemon.oom import OomBook
from slurm_elastic.daemon.reports import RunEvidence
from slurm_elastic.daemon.siterules import SiteRules
from slurm_elastic.daemon.state import DaemonLock, StateDB
from slurm_elastic.daemon.watchdog import Watchdog, sd_notify
from slurm_elastic.enact import CycleState, Enactor, run_cycle
from slurm_elastic.profiles.base import ThroughputModel
from slurm_elastic.spec import ElasticSpec, SpecError

LEARNED_SAVE_S = 300.0  # how often what the policy learned is saved (Daemon._save_learned)

__all__ = ["Daemon", "default_state_dir_for", "setup_logging"]


class Daemon:
    """One daemon instance: config, backend, state, enactor; :meth:`cycle` runs one cycle."""

    def __init__(self, config: DaemonConfig, backend: SlurmBackend | None = None, *, config_path=None,
                 dry_run: bool = False, ack=None, clock=time.monotonic):
        from slurm_elastic.backends.choose import make_backend
        from slurm_elastic.policies import get_policy

        self.config = config
        self.config_path = config_path
        self.dry_run = dry_run
        self.backend = backend or make_backend(config)
        self.metrics = Metrics()
        self.lock = DaemonLock(config.state_dir)
        self.db: StateDB | None = None
        self.models = ModelRegistry()
        self._learned_saved: bytes | None = None  # digest of what the policy and the type ratios had learned when last saved
        self._learned_saved_at: float | None = None  # when (self.clock)
        self.models.ratios.speeds.update(config.gpu_speed)  # the site's measured GPU speeds (issue 23)
        self.rules = SiteRules(config.max_weight, config.state_dir)
        self.watchdog = Watchdog(config.watchdog_s)
        self.records: dict[int, JobRecord] = {}
        self.ack = ack if ack is not None else CheckpointDirAck(lambda: self.records,
                                                                lambda j: self.state.spec_cache.last_valid.get(j))
        self.clock = clock
        self.cycle_no = 0
        self._limits: tuple[float, dict] | None = None  # (when read, partition -> PartitionRecord)
        self.policy = CappedPolicy(get_policy(config.policy), config.max_gpus_per_job, config.max_gpus_per_user,
                                   weight_grants=config.weight_grants)
        self.state = CycleState()
        self.enactor: Enactor | None = None
        self.journal: DBJournal | None = None
        self.stop_event = threading.Event()
        self.reload_requested = False
        self._stop_asked = False
        self.server: MetricsServer | None = None
        self.backoff_s = 0.0
        self.last_results: list = []
        self._was_elastic: set[int] = set()  # elastic jobs of the last cycle (oversight)
        self._config_unchecked = False  # the managed partitions could not be checked against Slurm yet
        self.lease = None
        if config.lease_ttl_s > 0:
            from slurm_elastic.daemon.lease import Lease

            self.lease = Lease(self.backend, config.state_dir, max(config.lease_ttl_s, 3 * config.poll_interval_s),
                               config.partitions[0] if config.partitions else None)
        self.refused_by: str | None = None  # why this daemon does not act (another daemon's lease)
        self._notes: dict[int, str] = {}  # job -> last logged oversight note
        self._crash_requeued: set[int] = set()  # jobs the crash policy requeued (held) this cycle
        self._final_states: dict[int, str] = {}  # job -> the ended state Slurm listed this cycle (status --history)
        self._left: dict[int, str] = {}  # job -> why it was left alone last cycle
        self._degraded: dict[int, str] = {}  # job -> why its Comment is invalid (on its last valid spec)
        self._saved_specs: dict[str, str] = {}  # job -> last valid spec's Comment, as saved in the DB

    # ----- lifecycle ---------------------------------------------------------------------------
    def open(self) -> None:
        """Take the lock, check the config against Slurm, open the state, restore books, reconcile open
        intents, start metrics. Raises ConfigError for a configuration that manages nothing."""
        self.lock.acquire()
        try:
            self._check_config(self.config)
        except ConfigError:
            self.lock.release()
            raise
        self.db = StateDB(self.config.state_dir)
        self.journal = DBJournal(self.db, self)
        self.enactor = Enactor(self.backend, self.ack, clock=self.clock, ack_timeout_s=self.config.ack_timeout_s,
                               signal=self.config.signal, journal=None if self.dry_run else self.journal)
        self.state.books = self.db.load_books()
        # jobs whose ExcNodeList the daemon set: cleared at their next start or resize (enact._exclude_reserved)
        self.enactor.excluded.update(j for j, b in self.state.books.items() if b.excluded)
        self.models.evidence = RunEvidence.from_json(self.db.get_meta("run_evidence", {}))
        self.models.claims = ClaimBook.from_json(self.db.get_meta("claims", {}))
        self.models.oom = OomBook.from_json(self.db.get_meta("oom_limits", {}))
        # what the policy and the type ratios learned from jobs that ended (a restart used to forget it)
        learned = self.db.get_meta("policy_learned", {})
        if isinstance(learned, dict) and learned.get("policy") == self.config.policy:
            self.policy.restore(learned.get("state", {}))
        self.models.ratios.load_json(self.db.get_meta("type_ratios", []), MAX_RATIO_JOBS)
        self._saved_specs = self.db.get_meta("valid_specs", {})
        self.state.spec_cache.last_valid.update(_restore_specs(self._saved_specs))
        self._was_elastic = set(self.db.job_views())
        if not self.dry_run:
            self.watchdog.progress("reconcile at start")
            try:
                records = self.backend.list_jobs()
                self.records = {j.job_id: j for j in records}
                if self._lease_refuses(records):
                    raise SlurmError("another daemon holds this cluster; reconcile waits")
                reconcile(self.db, self.backend, self.enactor, self.journal)
            except SlurmError as e:
                event(logging.ERROR, "cannot reconcile at start; will retry next cycle", error=str(e))
        if self.config.metrics_address and not self.dry_run:
            try:
                self.server = MetricsServer(self.metrics, self.config.metrics_address, self.config.metrics_port)
                self.server.start()
                event(logging.INFO, "metrics listening", address=f"{self.server.address[0]}:{self.server.address[1]}")
            except OSError as e:
                # Issue 21: a second daemon on the host (another cluster) finds the port taken; it runs on
                # without metrics rather than failing, and says which address to change.
                event(logging.ERROR, "metrics endpoint not started; running without metrics",
                      address=f"{self.config.metrics_address}:{self.config.metrics_port}",
                      error=("port taken (another daemon on this host?): set metrics_port in the configuration"
                             if e.errno == errno.EADDRINUSE else str(e)))
        event(logging.INFO, "daemon started", policy=self.config.policy, state_dir=self.config.state_dir,
              partitions=",".join(self.config.partitions) or "all", dry_run=self.dry_run)

    def _lease_refuses(self, records) -> bool:
        """One daemon per cluster (daemon/lease.py): True (logged loudly) when this one must not act."""
        if self.lease is None or self.dry_run:
            return False  # `plan` and --dry-run act on nothing: the running daemon holds the lease
        try:
            why = self.lease.check(records)
        except SlurmError as e:
            why = f"cannot write this daemon's lease into Slurm ({e}); not acting without it"
        if self.lease.unsupported and self.refused_by is None and self.cycle_no <= 1:
            event(logging.WARNING, "this backend keeps no lease: a second daemon would not be detected")
        if why:
            self.metrics.inc("slurm_elastic_errors_total", kind="second_daemon")
            self.metrics.inc("slurm_elastic_cycles_skipped_total", reason="second_daemon")
            event(logging.CRITICAL, "refusing to act", reason=why)
        elif self.refused_by:
            event(logging.WARNING, "this daemon holds the cluster again", lease_job=self.lease.job_id)
        self.refused_by = why
        if self.db is not None:
            self.db.set_meta("refused", why)
        return why is not None

    def _save_learned(self, force: bool = False) -> None:
        """Save what the policy and the type ratios learned, at most every ``LEARNED_SAVE_S`` (and at close):
        at a large site the ended-size history is megabytes (10,000 (user, model) keys x 200 sizes) and the
        jobs seen change every cycle, so saving every cycle cost a full build, compare and write each poll.
        A crash loses at most that long of learning; what was learned is statistics, never a job's state."""
        now = self.clock()
        if not force and self._learned_saved_at is not None and now - self._learned_saved_at < LEARNED_SAVE_S:
            return
        learned = {"policy": self.config.policy, "state": self.policy.learned()}
        ratios = self.models.ratios.to_json()
        # a digest, not a copy: at the bound the history is ~30 MB of JSON and hundreds of MB as objects
        digest = hashlib.sha256(json.dumps([learned, ratios]).encode()).digest()
        if digest != self._learned_saved:
            self.db.set_meta("policy_learned", learned)
            self.db.set_meta("type_ratios", ratios)
            self._learned_saved = digest
        self._learned_saved_at = now

    def close(self) -> None:
        self.watchdog.close()
        if self.db is not None and self._learned_saved_at is not None:
            try:
                self._save_learned(force=True)
            except Exception as e:  # closing must not fail on it: the books are saved each cycle
                event(logging.ERROR, "could not save what the policy learned at close", error=str(e))
        if self.lease is not None and not self.dry_run:
            self.lease.release()
        if self.server:
            self.server.stop()
            self.server = None
        if self.db:
            self.db.close()
            self.db = None
        self.lock.release()

    def _check_config(self, cfg: DaemonConfig, *, quiet: bool = False) -> bool:
        """Check the managed partitions against Slurm's nodes; False when Slurm cannot be read now (the
        check is then repeated at the first cycle that reads Slurm)."""
        try:
            nodes = self.backend.list_nodes()
            slurm_conf = self.backend.slurm_config()
        except SlurmError as e:
            if not quiet:
                event(logging.ERROR, "cannot check the managed partitions against Slurm; will check at the "
                      "next cycle", error=str(e))
            self._config_unchecked = True
            return False
        why = preemption_refusal(slurm_conf)  # issue 13: never next to Slurm's own preemption
        if why:
            raise ConfigError(why)
        check_managed_partitions(cfg, nodes)
        self._config_unchecked = False
        return True

    def reload(self) -> None:
        from slurm_elastic.policies import get_policy

        try:
            cfg = load_config(self.config_path)
            if not self._check_config(cfg, quiet=True) and cfg.partitions != self.config.partitions:
                raise ConfigError("Slurm cannot be read to check the new managed partitions")
        except Exception as e:
            event(logging.ERROR, "reload failed; keeping the old configuration", error=str(e))
            return
        learned = self.policy.learned() if cfg.policy == self.config.policy else {}
        self.config = cfg
        self.policy = CappedPolicy(get_policy(cfg.policy), cfg.max_gpus_per_job, cfg.max_gpus_per_user,
                                   weight_grants=cfg.weight_grants)
        self.policy.restore(learned)  # the same policy reloaded keeps what it learned
        self.rules = SiteRules(cfg.max_weight, cfg.state_dir)
        self.models.ratios.set_speeds(cfg.gpu_speed)
        self.watchdog.limit_s = cfg.watchdog_s
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
        self.watchdog.progress(f"cycle {self.cycle_no}")
        t0 = time.perf_counter()
        self.metrics.inc("slurm_elastic_cycles_total")
        if self._config_unchecked:
            try:
                if not self._check_config(cfg, quiet=True):
                    return self._skip_cycle(SlurmError("cannot read Slurm's nodes to check the managed partitions"))
            except ConfigError as e:
                event(logging.CRITICAL, "configuration refused; the daemon stops", error=str(e))
                self._stop_asked = True
                self.stop_event.set()
                return None
        if not self.dry_run and self.enactor is not None:
            # Finish acknowledged resizes *before* the cycle's read, so that the read shows their result.
            try:
                self.enactor.poll()
            except SlurmError as e:
                event(logging.ERROR, "cannot poll in-flight resizes", error=str(e))
        try:
            records, finished = self._read_jobs()
        except SlurmError as e:
            return self._skip_cycle(e)
        self._crash_requeued = set()
        self._final_states = {j.job_id: j.state for j in finished or () if j.state not in ACTIVE_STATES}
        if not self.dry_run and self.db is not None and finished is not None:
            self._crash_policy(finished)
        self.records = {j.job_id: j for j in records}
        self.policy.user_of = {j.job_id: j.user for j in records}
        self.policy.account_of = {j.job_id: j.account for j in records}
        if self._lease_refuses(records):
            return None
        if not self.dry_run and reconcile(self.db, self.backend, self.enactor, self.journal):
            try:  # reconcile acted: read again rather than plan on what it changed
                records = self.backend.list_jobs()
            except SlurmError as e:
                return self._skip_cycle(e)
            self.records = {j.job_id: j for j in records}
        left_alone, records = self._oversee(records)
        now = self.clock()
        wall = time.time()
        for r in records:
            if r.is_running:
                self.models.evidence.observe(r.job_id, r.restart_count, r.gpus_total, r.start_time, wall)
        backend = _Snapshotted(self.backend, records)
        try:
            result = run_cycle(
                backend, self.policy, _NoPoll(self.enactor) if not self.dry_run else _DryEnactor(self.enactor), self.state,
                model_for=self._model_for, now=now, job_info=lambda r: self.models.progress.get(r.job_id),
                planner_config=pl.PlannerConfig(cooldown_s=cfg.cooldown_s, max_in_flight=cfg.max_in_flight,
                                                allow_preemption=cfg.allow_preemption),
                partitions=cfg.partitions or None, default_restart_s=cfg.restart_cost_s,
                restart_claim_max_s=cfg.restart_claim_max_s, horizon_s=cfg.horizon_s,
                left_alone=left_alone, partition_limits=self._partition_limits(),
                model_for_type=self.models.model_for_type, note_nodes=self.models.note_nodes,
            )
        except SlurmError as e:
            return self._skip_cycle(e)
        self.backoff_s = 0.0
        elapsed = time.perf_counter() - t0
        self._after_cycle(result, records, elapsed)
        return result

    LIMITS_TTL_S = 60.0

    def _partition_limits(self) -> dict:
        """Partitions' MaxNodes etc. (``scontrol -o show partition``), read once a minute: they change
        only when a sysadmin reconfigures Slurm. A failed read keeps the last ones (logged)."""
        now = time.monotonic()
        cached = self._limits
        if cached is not None and now - cached[0] < self.LIMITS_TTL_S:
            return cached[1]
        try:
            limits = {p.name: p for p in self.backend.list_partitions()}
        except SlurmError as e:
            event(logging.WARNING, "cannot read partition limits; keeping the last ones", error=str(e))
            limits = cached[1] if cached is not None else {}
        self._limits = (now, limits)
        return limits

    def _model_for(self, job: JobRecord, spec: ElasticSpec) -> ThroughputModel:
        """The site's rules for this job (weight, ckpt_dir), then its throughput model; any failure is
        this job's error (a SpecError naming it), never the cycle's."""
        try:
            self.rules.check(job, spec)
            return self.models(job, spec)
        except SpecError:
            raise
        except Exception as e:  # a bug or an odd file system must not stop the cycle for the others
            log.exception("cannot vet this job", extra={"kv": {"job": job.job_id, "error": str(e)}})
            raise SpecError(f"cannot read the job's files: {e}", job_id=job.job_id, field="ckpt_dir") from None

    def _oversee(self, records) -> tuple[dict[int, str], list[JobRecord]]:
        """Yield to operators, close the paths around the hold (daemon/oversight.py): returns the jobs to
        leave alone this cycle, and the records to plan on (a job held here is shown held)."""
        from dataclasses import replace as _replace

        from slurm_elastic.daemon.oversight import review

        if self.db is None:
            return {}, records
        r = review(records, self.db.held_marks(), self._was_elastic,
                   open_intents={i["job_id"] for i in self.db.open_intents()},
                   in_flight=set(self.enactor.in_flight) if self.enactor else (),
                   placed=self.db.placed_marks())
        for jid, note in r.notes.items():
            if self._notes.get(jid) != note:
                event(logging.WARNING, "job changed outside the daemon", job=jid, detail=note)
        self._notes = dict(r.notes)
        self.policy.limit = dict(r.limit)
        for job in records:  # a job restarting after running out of memory: not a fresh admission (daemon/oom.py)
            most = self.models.oom.most_gpus(job)
            if most is not None:
                self.policy.limit[job.job_id] = min(most, self.policy.limit.get(job.job_id, most))
        if self.dry_run:
            return r.left_alone, records
        for jid, at in r.accept.items():
            self.db.mark_placed(jid, at)
        for jid in r.forget_placed:
            self.db.unmark_placed(jid)
        held_now = set()
        by_id = {j.job_id: j for j in records}
        for jid, why in r.hold.items():
            job = by_id[jid]
            try:
                self.db.mark_held(jid, job.restart_count)  # before the step: the hold is the daemon's
                self.backend.hold(jid)
                held_now.add(jid)
                self.metrics.inc("slurm_elastic_actions_total", kind="hold", outcome="done")
                self.db.log_decision(self.cycle_no, jid, "hold", "done", reason="went around the hold", message=why)
                event(logging.WARNING, "held a job that went around the daemon", job=jid, reason=why)
            except SlurmError as e:
                self.db.unmark_held(jid)
                self.metrics.inc("slurm_elastic_errors_total", kind="action")
                event(logging.ERROR, "cannot hold a job that went around the daemon; will retry", job=jid,
                      error=str(e))
        if held_now:
            records = [_replace(j, held=True, priority=0) if j.job_id in held_now else j for j in records]
            self.records = {j.job_id: j for j in records}
        # A job the crash policy requeued this cycle was FAILED in this cycle's read (so not among the
        # active records): its fresh hold mark is the daemon's own and must survive until the next read.
        for jid in r.forget - self._crash_requeued:
            self.db.unmark_held(jid)
        for jid, why in r.release.items():
            try:
                self.backend.release(jid)
                self.db.unmark_held(jid)
                event(logging.WARNING, "released a job the daemon held", job=jid, reason=why)
            except SlurmError as e:
                self.metrics.inc("slurm_elastic_errors_total", kind="action")
                event(logging.ERROR, "cannot release a job that is no longer elastic; will retry", job=jid,
                      error=str(e))
        return r.left_alone, records

    def _read_jobs(self) -> tuple[list[JobRecord], list[JobRecord] | None]:
        """The cycle's ONE read of the queue: (active jobs, every listed job incl. finished ones for the
        crash policy, or None where the backend lists active jobs only, e.g. the simulator)."""
        import inspect

        try:
            lists_finished = "include_finished" in inspect.signature(self.backend.list_jobs).parameters
        except (TypeError, ValueError):
            lists_finished = False
        if not lists_finished:
            return self.backend.list_jobs(), None
        everything = self.backend.list_jobs(include_finished=True)
        return [j for j in everything if j.state in ACTIVE_STATES], everything

    def _crash_policy(self, finished: list[JobRecord]) -> None:
        """Requeue failed jobs that have failures left (``max_failures=`` in their spec; daemon/crash.py),
        from the cycle's own read (no second squeue: with slurmctld down that doubled every skipped cycle)."""
        from slurm_elastic.daemon.crash import apply_crash_policy

        before = set(self.db.held_marks())
        apply_crash_policy(finished, self.backend, self.db, event, self.cycle_no)
        self._crash_requeued = set(self.db.held_marks()) - before

    def _skip_cycle(self, e: SlurmError) -> None:
        """Slurm could not be read (or answered garbage): act on nothing, log it, back off."""
        kind = "parse" if isinstance(e, SlurmParseError) else "slurm"
        self.metrics.inc("slurm_elastic_errors_total", kind=kind)
        self.metrics.inc("slurm_elastic_cycles_skipped_total", reason=kind)
        self.backoff_s = min(max(2 * self.backoff_s, self.config.poll_interval_s), 300.0)
        event(logging.ERROR, "cycle skipped: cannot read Slurm", error=str(e), retry_in_s=self.backoff_s)
        return None

    def _after_cycle(self, result, records, elapsed: float) -> None:
        snap = result.snapshot
        for jid, err in snap.errors.items():
            self.metrics.inc("slurm_elastic_errors_total", kind="spec")
            event(logging.WARNING, "bad elastic spec; job not managed", job=jid, error=str(err))
        if not self.dry_run and self.db is not None:
            self._hold_unvalidated(snap, records)
        for jid, err in snap.degraded.items():
            if self._degraded.get(jid) != str(err):
                event(logging.WARNING, "elastic spec turned invalid; kept on its last valid spec (may shrink, "
                      "never grow)", job=jid, error=str(err))
        self._degraded = {j: str(e) for j, e in snap.degraded.items()}
        for jid, why in snap.unmanaged.items():
            if self._left.get(jid) != why:
                event(logging.WARNING, "elastic job left alone", job=jid, reason=why)
        for jid in snap.records:
            if jid in self._left:
                event(logging.INFO, "elastic job managed again", job=jid, was=self._left[jid])
        self._left = dict(snap.unmanaged)
        self.metrics.set("slurm_elastic_cycle_seconds", elapsed)
        self.metrics.set("slurm_elastic_solve_seconds", result.allocation.solve_s)
        self.metrics.set("slurm_elastic_gpus_available", snap.capacity)
        self.metrics.clear("slurm_elastic_jobs")
        # every state, 0 included: a query for one state (a dashboard's "waiting") never finds no series
        counts: dict[str, int] = dict.fromkeys((pl.PENDING, pl.STARTING, pl.RUNNING, pl.IN_FLIGHT), 0)
        for v in snap.views:
            counts[v.status] = counts.get(v.status, 0) + 1
        counts["bad_spec"] = len(snap.errors)
        for state, n in counts.items():
            self.metrics.set("slurm_elastic_jobs", n, state=state)
        self.metrics.set("slurm_elastic_gpus_allocated", sum(v.gpus for v in snap.views if v.status == pl.RUNNING))
        self.metrics.set("slurm_elastic_last_cycle_timestamp_seconds", time.time())
        self.metrics.clear("slurm_elastic_job_gpus")
        self.metrics.clear("slurm_elastic_job_batch")
        records_by_id = {r.job_id: r for r in records}
        for v in snap.views:
            if v.gpus > 0:
                rec = records_by_id.get(v.job_id)
                self.metrics.set("slurm_elastic_job_gpus", v.gpus, job_id=v.job_id, status=v.status,
                                 user=rec.user if rec is not None else "")
            if v.status == pl.RUNNING and v.batch:
                self.metrics.set("slurm_elastic_job_batch", v.batch, job_id=v.job_id)
        if self.dry_run or self.db is None:
            return
        self.db.save_books(self.state.books)
        for jid, restart, fig in self.models.measured:
            used = self.models.restart_cost(jid)
            parts = [f"{who} {fig[k]:.1f} s" for k, who in (("daemon_s", "signal->first step (daemon)"),
                                                              ("job_s", "stop->first step (job)")) if fig[k] is not None]
            msg = f"restart {restart}: " + ", ".join(parts) + (f"; planning with {used:.1f} s" if used else "")
            self.db.log_decision(self.cycle_no, int(jid), "measure", "restart-cost", reason=f"restart {restart}",
                                 message=msg)
            event(logging.INFO, "restart cost measured", job=jid, restart=restart, daemon_s=fig["daemon_s"],
                  job_s=fig["job_s"], planning_s=used)
        self.models.measured.clear()
        self.models.forget({j.job_id for j in records})
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
            m = req.model if req is not None else None
            if getattr(m, "provenance", None) == "prior":
                sps = eff = None  # a guess of the default model is not shown as the job's throughput
            rows.append({
                "model": getattr(m, "provenance", None), "model_uncertainty": getattr(m, "uncertainty", None),
                "noise_scale": getattr(m, "noise_scale", None), "restart_s": req.restart_s if req else None,
                "restart_from": v.restart_from or None,
                "job_id": v.job_id, "gpus": v.gpus, "target_gpus": a.gpus if a else None, "batch": v.batch,
                "samples_per_s": sps, "efficiency": eff, "rescales": book.rescales if book else 0,
                "last_change": (time.time() - (self.clock() - book.last_change_s))
                if book and book.last_change_s is not None else None,
                "reason": (f"spec invalid ({snap.degraded[v.job_id]}): kept on its last valid spec, may shrink, "
                           f"never grow; " if v.job_id in snap.degraded else "")
                + self.policy.noted(v.job_id, plan_reason.get(v.job_id) or (a.reason if a else "")),
            })
        active = {j.job_id for j in records}
        self.models.evidence.forget_except(active, self.models.owners)
        self.models.owners = {j: o for j, o in self.models.owners.items() if j in active}
        for d in (self.models.sources, self.models.problems):
            for jid in [j for j in d if j not in active]:
                del d[jid]
        self.db.set_meta("run_evidence", self.models.evidence.to_json())
        self.db.set_meta("claims", self.models.claims.to_json())
        if self.models.oom.changed:
            self.db.set_meta("oom_limits", self.models.oom.to_json())
            self.models.oom.changed = False
        self._save_learned()
        # The last valid spec of each job holding GPUs (what it falls back to if its Comment turns invalid)
        held = {str(v.job_id): snap.specs[v.job_id].to_comment() for v in snap.views
                if v.gpus and v.job_id in snap.specs and v.job_id not in snap.degraded}
        held.update({k: c for k, c in self._saved_specs.items() if int(k) in snap.degraded})
        if held != self._saved_specs:
            self.db.set_meta("valid_specs", held)
            self._saved_specs = held
        self.db.set_meta("models", {str(j): {"model": src, "report_error": self.models.problems.get(j),
                                             "limits": self.models.oom.notes(j)}
                                    for j, src in self.models.sources.items()})
        for jid, err in snap.errors.items():
            rows.append({"job_id": jid, "reason": f"bad spec: {err}"})
        for jid, why in snap.unmanaged.items():
            rows.append({"job_id": jid, "reason": f"left alone: {why}"})
        named = {j.job_id: j for j in records}
        for r in rows:  # kept for status --history once Slurm forgets the job
            if r["job_id"] in named:
                rec = named[r["job_id"]]
                r.update(name=rec.name, user=rec.user, partition=rec.partition)
        self.db.save_job_views(rows)
        # An elastic job Slurm no longer lists has ended: logged once, so the decision log alone tells
        # when each job held its GPUs (slurm-elastic report draws the timeline from it).
        for jid in sorted(self._was_elastic - active):
            self.db.log_decision(self.cycle_no, int(jid), "end", "done", gpus_to=0,
                                 reason="ended: no longer in Slurm's queue")
        self._was_elastic = {r["job_id"] for r in rows}
        self.db.forget_jobs({j.job_id for j in records}, self._final_states)
        self.db.set_meta("last_cycle", {"ts": time.time(), "cycle": self.cycle_no, "seconds": elapsed,
                                        "policy": self.config.policy, "capacity": snap.capacity})

    def _hold_unvalidated(self, snap, records) -> None:
        """A waiting elastic job with a spec the daemon refuses, that no operator left alone and that the
        daemon never validated, is held (marked as the daemon's hold, released once its spec is fixed and
        the daemon places it): Slurm must not start what the daemon cannot manage."""
        by_id = {j.job_id: j for j in records}
        for jid, err in snap.errors.items():
            job = by_id.get(jid)
            if job is None or not job.is_pending or job.held or jid in self.state.spec_cache.last_valid:
                continue
            try:
                self.db.mark_held(jid, job.restart_count)
                self.backend.hold(jid)
                self.db.log_decision(self.cycle_no, jid, "hold", "done", reason="bad elastic spec",
                                     message=f"held until its spec is fixed: {err}")
                event(logging.WARNING, "held a job whose elastic spec the daemon refuses", job=jid, error=str(err))
            except SlurmError as e:
                self.db.unmark_held(jid)
                event(logging.ERROR, "cannot hold a job with a bad elastic spec; will retry", job=jid, error=str(e))

    # ----- the loop ------------------------------------------------------------------------------
    def install_signals(self) -> None:
        def on_term(signum, _frame):
            if self._stop_asked:  # a second TERM/INT: do not wait for the cycle to end
                self.watchdog.stop_grace_s = 0
            self._stop_asked = True
            self.watchdog.stop_requested()
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
                self.watchdog.progress("between cycles")
                if self.enactor and self.enactor.in_flight and not self.dry_run:
                    try:
                        self.records = {j.job_id: j for j in self.backend.list_jobs()}
                        self.enactor.poll()
                        self.db.save_books(self.state.books)
                    except SlurmError as e:
                        event(logging.ERROR, "cannot poll in-flight resizes", error=str(e))
                self.stop_event.wait(min(poll_actions_s, max(0.0, deadline - time.monotonic())))
        sd_notify("STOPPING=1")
        event(logging.INFO, "daemon stopping", in_flight=len(self.enactor.in_flight) if self.enactor else 0)


class _Snapshotted(SlurmBackend):
    """The backend with ``list_jobs`` answered from this cycle's one read (one read per cycle)."""

    def __init__(self, inner: SlurmBackend, jobs):
        self.inner, self.jobs = inner, jobs

    def list_jobs(self):
        return list(self.jobs)

    def list_nodes(self):
        return self.inner.list_nodes()

    def list_partitions(self):
        return self.inner.list_partitions()

    def slurm_config(self):
        return self.inner.slurm_config()

    def hold(self, job_id):
        return self.inner.hold(job_id)

    def release(self, job_id):
        return self.inner.release(job_id)

    def requeue_hold(self, job_id, **kw):
        return self.inner.requeue_hold(job_id, **kw)

    def update_job(self, job_id, **kw):
        return self.inner.update_job(job_id, **kw)

    def signal(self, job_id, signal="USR2", *, batch_only=False):
        return self.inner.signal(job_id, signal, batch_only=batch_only)


class _NoPoll:
    """The enactor as run_cycle sees it: the daemon polls before its one read, so the snapshot stays true."""

    def __init__(self, real: Enactor):
        self.real = real
        self.in_flight = real.in_flight
        self.excluded = real.excluded

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
        self.excluded = set(real.excluded) if real else set()
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


def _restore_specs(saved) -> dict[int, ElasticSpec]:
    """The saved last valid specs (daemon's own DB); anything that no longer parses is dropped."""
    from slurm_elastic.spec import parse_spec

    out = {}
    for k, comment in (saved.items() if isinstance(saved, dict) else ()):
        try:
            out[int(k)] = parse_spec(comment, k)
        except (SpecError, ValueError, TypeError):
            continue
    return out


def default_state_dir_for(config_path: str | os.PathLike | None) -> Path:
    return Path(load_config(config_path).state_dir)
