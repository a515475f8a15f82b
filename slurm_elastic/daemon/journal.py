"""Durability of the daemon's actions: an intent before every step, and reconcile() after a crash."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from slurm_elastic import planner as pl
from slurm_elastic.backends.base import SlurmBackend, SlurmError
from slurm_elastic.daemon.logfmt import event
from slurm_elastic.daemon.state import StateDB, action_from_json
from slurm_elastic.enact import Enactor

if TYPE_CHECKING:
    from slurm_elastic.daemon.loop import Daemon


class DBJournal:
    """Intents before every step; the decision log after every outcome."""

    def __init__(self, db: StateDB, daemon: Daemon):
        self.db = db
        self.daemon = daemon

    def step(self, action: pl.Action, step: str) -> None:
        job = self.daemon.records.get(int(action.job_id))
        self.db.write_intent(action, step, job.restart_count if job else None)
        if step == "signal" and job is not None:
            self.daemon.models.note_signal(job.job_id, job.restart_count, time.time())
        # The daemon's own holds, told apart from an operator's (daemon/oversight.py).
        if step == "requeue_hold":
            self.db.mark_held(action.job_id, job.restart_count + 1 if job else 1 << 30)
        elif step == "hold":
            self.db.mark_held(action.job_id, job.restart_count if job else 1 << 30)
        elif step == "release":
            # The restart count the job runs at once released: a job later found pending or running at a
            # higher one went around the daemon (an owner's requeue, Slurm's own; daemon/oversight.py).
            mark = self.db.held_marks().get(int(action.job_id))
            at = mark if mark is not None else (job.restart_count if job else None)
            if at is not None:
                self.db.mark_placed(action.job_id, at)
            self.db.unmark_held(action.job_id)
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
            if enactor.in_flight[jid].requeued_at is not None:
                continue  # requeue sent, Slurm still finishing it: the enactor's poll places the job
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
        if isinstance(action, pl.Hold):
            db.close_intent(jid)  # a hold is one call: done or not, the next cycle's plan covers it
            done.append(f"job {jid}: hold intent closed ({'held' if job.held else job.state})")
            continue
        if isinstance(action, pl.Start) or (isinstance(action, pl.Resize) and step in ("update", "release")):
            if held_by_us:
                enactor._place(action)  # update (idempotent) + release
                db.close_intent(jid)
                journal.daemon.record_result(action, "done", "finished after a daemon restart")
                done.append(f"job {jid}: {action.kind} finished after restart (placed at {action.gpus} GPUs)")
            elif job.is_completing or not job.is_active:
                # Cancelled (or ended) while it was being placed: nothing to place, never "completed".
                db.close_intent(jid)
                journal.daemon.record_result(action, "skipped", f"the job is ending ({job.state}): not placed")
                done.append(f"job {jid}: {action.kind} dropped, the job is ending ({job.state})")
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
            # requeue_hold was done: the job is pending, or still ending (Slurm finishes the requeue once its
            # processes are gone, up to KillWait later): wait for that, an update before it is overwritten.
            if job.is_completing and job.is_active:
                continue
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
