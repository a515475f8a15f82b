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

No path around the hold (issue 24 item 4). The daemon records the restart count at which it last let
each job go (its release: ``placed``). An elastic job found **pending without any hold** that ran
before (its restart count is past ``placed``; or, with no such record, it has a restart count or a
decision of the daemon's) went back to the queue around the daemon: an owner's ``scontrol requeue``
of her running or finished job, Slurm's own requeue after a node failure, an admin's release of his
own requeuehold, a restore. It is **held** (the daemon's hold, marked) in the same cycle and planned
like any held job, under the caps. The plugin's submit hold released by an operator (restart count
0, no decision) and a daemon hold released by an operator (a hold mark) stay not fought. A job found
**running at a size the daemon did not decide** (its AdminComment decision says another GPU count,
or it restarted past ``placed``: Slurm started it before the daemon saw it pending) is managed with
its ``max_gpus`` limited to the decided count (never grown past it by its own doing), so it is shrunk
under the per-job and per-user caps like a job over its cap.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from slurm_elastic.backends.base import JobRecord
from slurm_elastic.spec import DECISION_PREFIX, SpecError, is_elastic_comment, parse_decision

SUBMIT_HOLD_REASON = "JobHeldUser"


@dataclass
class Review:
    left_alone: dict[int, str] = field(default_factory=dict)  # operator-held elastic jobs -> why
    release: dict[int, str] = field(default_factory=dict)  # daemon-held jobs no longer elastic -> why
    forget: set[int] = field(default_factory=set)  # hold marks to drop
    notes: dict[int, str] = field(default_factory=dict)  # job -> what changed (for the log)
    hold: dict[int, str] = field(default_factory=dict)  # pending jobs that went around the hold -> why
    limit: dict[int, int] = field(default_factory=dict)  # running at a size not decided -> its max GPUs
    accept: dict[int, int] = field(default_factory=dict)  # placed marks to set (an operator's release)
    forget_placed: set[int] = field(default_factory=set)  # placed marks of jobs Slurm no longer lists


def _decided_gpus(r: JobRecord) -> int | None:
    try:
        d = parse_decision(r.admin_comment, r.job_id)
    except SpecError:
        return None
    return d.gpus if d is not None else None


def went_around(r: JobRecord, placed: Mapping[int, int]) -> bool:
    """Did this job (pending without a hold, or running) get back to the queue around the daemon?"""
    at = placed.get(r.job_id)
    if at is not None:
        return r.restart_count > at
    return r.restart_count > 0 or _decided_gpus(r) is not None


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
           open_intents: Iterable[int] = (), in_flight: Iterable[int] = (),
           placed: Mapping[int, int] | None = None) -> Review:
    """Classify this cycle's jobs. ``marks``: job -> restart count after the daemon's own hold;
    ``was_elastic``: jobs the daemon saw as elastic last cycle (empty on a first start); ``placed``:
    job -> restart count at the daemon's last release of it (None: not checked, the old behaviour)."""
    out = Review()
    check = placed is not None
    placed = placed or {}
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
                out.accept[jid] = r.restart_count  # an operator's release is not fought
                out.notes[jid] = (f"released by someone else while the daemon held it; planned again from its "
                                  f"current state ({r.state})")
            elif check and r.is_pending and not r.held and not r.is_completing and went_around(r, placed):
                out.hold[jid] = (f"pending without the daemon's hold at restart {r.restart_count} (requeued or "
                                 f"released outside the daemon); held to be placed under the caps")
                out.notes[jid] = f"went around the daemon's hold (pending, restart {r.restart_count}); held again"
            elif check and r.is_running and (decided := _decided_gpus(r)) is not None and (
                    decided != r.gpus_total or went_around(r, placed) and jid in placed):
                out.limit[jid] = decided
                out.notes[jid] = (f"running at {r.gpus_total} GPUs, restart {r.restart_count}, which the daemon "
                                  f"did not decide ({decided} GPUs); managed with at most {decided}")
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
    out.forget_placed = {j for j in placed if j not in seen}
    return out
