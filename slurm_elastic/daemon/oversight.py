"""Operators win: what others did to elastic jobs, and how the daemon yields to it. Pure: no I/O.

Slurm cannot say *who* set a hold, so the daemon tells its own holds apart by what it knows:

- the plugin's submit hold: a pending job that never ran (restart count 0) held with reason
  ``JobHeldUser`` (the plugin sets priority 0 at submit; users cannot hold or release elastic jobs, the
  plugin refuses it). ``scontrol requeuehold`` also shows ``JobHeldUser`` (seen on 22.05), whoever
  runs it, but it raises the restart count, so an admin's requeuehold is never taken for this;
- its own ``requeuehold``/``hold``: a **hold mark** in the state DB, written before the step with the
  restart count the job will have after it, cleared when the daemon releases the job;
- a job with an open intent (a step under way or left by a crash; reconcile finishes it).

Any other hold (an admin's ``scontrol hold``/``requeuehold``: reason ``JobHeldAdmin``, no mark) is an
operator's: the job is *left alone* (never released, resized or started) until an operator releases
it. A job the daemon held that is no longer held was released by someone else: its mark is dropped and
it is planned again from what Slurm shows (never held again for that). A job whose Comment stopped or
started being elastic after submit (an admin's edit; the plugin refuses users) is named in the log; a
job the daemon itself holds that stopped being elastic is released to run as a plain job, so that it is
never held forever by a daemon that no longer manages it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from slurm_elastic.backends.base import JobRecord
from slurm_elastic.spec import DECISION_PREFIX, is_elastic_comment

SUBMIT_HOLD_REASON = "JobHeldUser"


@dataclass
class Review:
    left_alone: dict[int, str] = field(default_factory=dict)  # operator-held elastic jobs -> why
    release: dict[int, str] = field(default_factory=dict)  # daemon-held jobs no longer elastic -> why
    forget: set[int] = field(default_factory=set)  # hold marks to drop
    notes: dict[int, str] = field(default_factory=dict)  # job -> what changed (for the log)


def held_by_daemon(r: JobRecord, marks: Mapping[int, int], open_intents: Iterable[int] = ()) -> bool:
    """Is this held job held by the plugin at submit or by the daemon itself?"""
    if not r.held:
        return False
    if r.is_pending and r.state_reason == SUBMIT_HOLD_REASON and r.restart_count == 0:
        return True  # never ran: the plugin's submit hold (a requeuehold also says JobHeldUser, but counts)
    if r.job_id in open_intents:
        return True
    mark = marks.get(r.job_id)
    return mark is not None and r.restart_count <= mark


def review(records: Iterable[JobRecord], marks: Mapping[int, int], was_elastic: Iterable[int],
           open_intents: Iterable[int] = (), in_flight: Iterable[int] = ()) -> Review:
    """Classify this cycle's jobs. ``marks``: job -> restart count after the daemon's own hold;
    ``was_elastic``: jobs the daemon saw as elastic last cycle (empty on a first start)."""
    out = Review()
    intents, flying, before = set(open_intents), set(in_flight), set(was_elastic)
    seen = set()
    for r in records:
        if not r.is_active:
            continue
        jid = r.job_id
        seen.add(jid)
        elastic = is_elastic_comment(r.comment)
        ours = held_by_daemon(r, marks, intents)
        if jid in flying or jid in intents:
            continue  # the enactor / reconcile owns it this cycle
        if elastic:
            if r.held and not ours:
                reason = r.state_reason or "held"
                out.left_alone[jid] = (f"held by an operator ({reason}); left held until an operator releases it")
                out.notes[jid] = "held by an operator: the daemon leaves it alone"
            elif jid in marks and not r.held:
                out.forget.add(jid)
                out.notes[jid] = (f"released by someone else while the daemon held it; planned again from its "
                                  f"current state ({r.state})")
            elif r.is_running and not r.admin_comment.startswith(DECISION_PREFIX) and jid in before:
                out.notes[jid] = ("released by someone else before the daemon placed it (running without a "
                                  "decision); planned again from its current size")
            elif before and jid not in before and not (r.is_pending and r.held):
                out.notes[jid] = f"became elastic after submit (comment changed, {r.state}); managed from now on"
        else:
            if jid in before:
                out.notes[jid] = "stopped being elastic (comment changed); no longer managed"
                if r.is_pending and ours:
                    out.release[jid] = "no longer elastic: released to run as a plain job"
            if jid in marks and (not r.held or jid in out.release):
                out.forget.add(jid)
    out.forget |= {j for j in marks if j not in seen}
    return out
