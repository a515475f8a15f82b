"""The crash policy (daemon/crash.py): requeue a failed job up to max_failures times, then give up."""

from __future__ import annotations

import logging

from slurm_elastic.backends.base import JobRecord, SlurmError
from slurm_elastic.daemon.crash import apply_crash_policy
from slurm_elastic.daemon.state import StateDB

SPEC = "elastic:min_gpus=1,max_gpus=4,min_batch=8,max_batch=64,max_local_batch=32,max_failures=2"


class FakeBackend:
    def __init__(self, fail_on=()):
        self.requeued: list[int] = []
        self.fail_on = set(fail_on)

    def requeue_failed(self, job_id):
        if job_id in self.fail_on:
            raise SlurmError("scontrol failed")
        self.requeued.append(job_id)


def job(state, restart, comment=SPEC, jid=5):
    return JobRecord(job_id=jid, name="j", user="u", partition="p", state=state, restart_count=restart,
                     comment=comment)


def test_requeued_twice_then_gives_up_each_failure_counted_once(tmp_path):
    db = StateDB(tmp_path)
    be = FakeBackend()
    events = []

    def ev(level, msg, **kv):
        events.append((level, msg, kv))

    assert apply_crash_policy([job("FAILED", 0)], be, db, ev, 1)
    assert db.held_marks() == {5: 1}  # the daemon's own hold: placed again, not taken for an operator's
    assert apply_crash_policy([job("FAILED", 0)], be, db, ev, 2) == []  # the same failure again: nothing
    assert apply_crash_policy([job("RUNNING", 1)], be, db, ev, 3) == []
    assert apply_crash_policy([job("NODE_FAIL", 1)], be, db, ev, 4)
    lines = apply_crash_policy([job("FAILED", 2)], be, db, ev, 5)
    assert be.requeued == [5, 5]
    assert "max_failures=2 reached" in lines[0]
    assert apply_crash_policy([job("FAILED", 2)], be, db, ev, 6) == []  # logged once
    assert [(lv, m) for lv, m, _ in events] == [
        (logging.WARNING, "crash policy: requeued"), (logging.WARNING, "crash policy: requeued"),
        (logging.ERROR, "crash policy: giving up")]
    log = [(d["action"], d["status"]) for d in db.decisions(5)]
    assert log == [("requeue-failed", "done"), ("requeue-failed", "done"), ("requeue-failed", "gave-up")]


def test_not_for_cancelled_non_elastic_or_no_policy_and_a_failing_requeue_is_retried(tmp_path):
    db = StateDB(tmp_path)
    be = FakeBackend(fail_on={7})
    ev = lambda *a, **k: None  # noqa: E731
    plain = SPEC.replace(",max_failures=2", "")
    assert apply_crash_policy([job("CANCELLED", 0), job("FAILED", 0, comment="x", jid=6),
                               job("FAILED", 0, comment=plain, jid=8)], be, db, ev, 1) == []
    assert db.decisions(8) == []  # max_failures=0 (the default): a failure ends the job, as in plain Slurm
    assert apply_crash_policy([job("FAILED", 0, jid=7)], be, db, ev, 2) == []
    be.fail_on.clear()
    assert apply_crash_policy([job("FAILED", 0, jid=7)], be, db, ev, 3)  # counted only once it worked
    assert be.requeued == [7]
