"""The enactor: the order of backend calls for starts and resizes, acks, timeouts, errors."""

from __future__ import annotations

import pytest

from slurm_elastic import planner as pl
from slurm_elastic.backends.base import JobNotRequeueable, SlurmBackend, SlurmError
from slurm_elastic.enact import Enactor
from slurm_elastic.spec import Decision


class Recorder(SlurmBackend):
    def __init__(self):
        self.calls = []
        self.acked = set()
        self.fail = {}

    def _call(self, name, *args, **kw):
        self.calls.append((name, *args, *sorted(kw.items())))
        if name in self.fail:
            raise self.fail[name]

    def list_jobs(self):
        return []

    def list_nodes(self):
        return []

    def hold(self, job_id):
        self._call("hold", job_id)

    def release(self, job_id):
        self._call("release", job_id)

    def requeue_hold(self, job_id):
        self._call("requeue_hold", job_id)

    def update_job(self, job_id, **kw):
        self._call("update_job", job_id, **kw)

    def signal(self, job_id, signal="USR2", *, batch_only=False):
        self._call("signal", job_id, signal)

    def checkpoint_acked(self, job_id):
        return job_id in self.acked


D = Decision(gpus=8, nodes=2, batch=64, local_batch=8, seq=3)


def test_start_is_update_then_release():
    b = Recorder()
    e = Enactor(b, clock=lambda: 0.0)
    res = e.apply([pl.Start(7, 8, 2, 4, D), pl.Leave(8)])
    assert [r.status for r in res] == ["done"]
    assert b.calls == [
        ("update_job", 7, ("admin_comment", D.to_admin_comment()), ("gpus_per_node", 4), ("num_nodes", 2),
         ("num_tasks", 8), ("start_now", True)),
        ("release", 7),
    ]


def test_resize_waits_for_ack_then_requeue_update_release():
    b = Recorder()
    now = [0.0]
    e = Enactor(b, clock=lambda: now[0])
    res = e.apply([pl.Resize(7, 4, 8, 2, 4, D)])
    assert [r.status for r in res] == ["begun"] and b.calls == [("signal", 7, "USR2")]
    assert e.in_flight_targets() == {7: 8}
    assert e.poll() == [] and len(b.calls) == 1
    b.acked.add(7)
    now[0] = 12.0
    res = e.poll()
    assert [r.status for r in res] == ["done"] and not e.in_flight
    assert [c[0] for c in b.calls] == ["signal", "requeue_hold", "update_job", "release"]


def test_unacked_resize_times_out_and_leaves_the_job_running():
    b = Recorder()
    now = [0.0]
    e = Enactor(b, clock=lambda: now[0], ack_timeout_s=60.0)
    e.apply([pl.Resize(7, 4, 8, 2, 4, D)])
    now[0] = 59.0
    assert e.poll() == []
    now[0] = 60.0
    res = e.poll()
    assert res[0].status == "timeout" and "left running" in res[0].message
    assert [c[0] for c in b.calls] == ["signal"] and not e.in_flight


def test_preempt_requeues_and_stays_held():
    b = Recorder()
    b.acked.add(7)
    e = Enactor(b, clock=lambda: 0.0)
    res = e.apply([pl.Preempt(7, 4)])
    assert [r.status for r in res] == ["begun", "done"]
    assert [c[0] for c in b.calls] == ["signal", "requeue_hold"]


def test_errors_are_reported_not_raised():
    b = Recorder()
    b.fail["update_job"] = SlurmError("boom")
    e = Enactor(b, clock=lambda: 0.0)
    res = e.apply([pl.Start(7, 8, 2, 4, D)])
    assert res[0].status == "error" and "boom" in res[0].message
    assert [c[0] for c in b.calls] == ["update_job"]  # never released with a stale size
    b2 = Recorder()
    b2.acked.add(7)
    b2.fail["requeue_hold"] = JobNotRequeueable("no")
    res = Enactor(b2, clock=lambda: 0.0).apply([pl.Resize(7, 4, 8, 2, 4, D)])
    assert res[-1].status == "error" and "not requeueable" in res[-1].message


def test_a_second_resize_of_an_in_flight_job_is_refused():
    b = Recorder()
    e = Enactor(b, clock=lambda: 0.0)
    e.apply([pl.Resize(7, 4, 8, 2, 4, D)])
    res = e.apply([pl.Resize(7, 4, 2, 1, 2, D)])
    assert res[0].status == "error" and len(b.calls) == 1


def test_backend_without_ack_needs_an_ack_source():
    class NoAck(Recorder):
        checkpoint_acked = None

    with pytest.raises(TypeError):
        Enactor(NoAck())


def test_hold_re_holds_a_released_job():
    b = Recorder()
    res = Enactor(b, clock=lambda: 0.0).apply([pl.Hold(7, 8, "cannot place")])
    assert [r.status for r in res] == ["done"] and b.calls == [("hold", 7)]


def test_a_cycle_with_no_node_reporting_gpus_is_skipped_not_planned_on_an_empty_cluster():
    """Right after a slurmctld restart Slurm lists nodes before they register, with 0 GPUs (seen live:
    the spec's placement rule then divided by a node size of 0 and the cycle failed)."""
    from slurm_elastic.backends.base import JobRecord, NodeRecord
    from slurm_elastic.enact import CycleState, run_cycle
    from slurm_elastic.policies.dp import DPPolicy

    class Restarted(Recorder):
        def list_jobs(self):
            return [JobRecord(job_id=5, name="a", user="u", partition="gpu", state="RUNNING", gpus_total=4,
                              gpus_per_node=4, node_count=1, nodes=("n1",),
                              comment="elastic:min_gpus=1,max_gpus=8,min_batch=32,max_batch=256,max_local_batch=64")]

        def list_nodes(self):
            return [NodeRecord("n1", "UNKNOWN", (), 0, 0, 8, ("gpu",))]

    be = Restarted()
    with pytest.raises(SlurmError, match="no node reports GPUs"):
        run_cycle(be, DPPolicy(), Enactor(be), CycleState(), model_for=lambda j, s: None, now=0.0)
    assert be.calls == []  # nothing enacted

    class NotYetUsable(Restarted):  # seen live with pyslurm: GPUs listed, the node not usable yet
        usable = True

        def list_nodes(self):
            return [NodeRecord("n1", "MIXED" if self.usable else "DOWN", (), 8, 4, 8, ("gpu",))]

    from slurm_elastic.profiles import load_profile

    be, state = NotYetUsable(), CycleState()
    run_cycle(be, DPPolicy(), Enactor(be), state, model_for=lambda j, s: load_profile("cifar10"), now=0.0)
    assert 5 in state.spec_cache.last_valid  # validated on 8-GPU nodes: its fallback if its spec fails
    be.usable, be.calls = False, []
    with pytest.raises(SlurmError, match="no managed node is usable yet"):  # was: modulo by zero
        run_cycle(be, DPPolicy(), Enactor(be), state, model_for=lambda j, s: load_profile("cifar10"), now=1.0)
    assert be.calls == []


def test_a_job_that_ends_between_the_read_and_the_signal_is_skipped_not_an_error():
    """Seen live with pyslurm: 'Job/step already completing or completed' for a job that just finished."""
    from slurm_elastic.backends.base import JobRecord

    class Ended(Recorder):
        def __init__(self, state):
            super().__init__()
            self.state = state
            self.fail = {"signal": SlurmError("signal job 7 failed", stderr="Job/step already completing or completed")}

        def get_job(self, job_id, include_finished=False):
            return JobRecord(job_id=7, name="a", user="u", partition="p", state=self.state, gpus_total=4,
                             nodes=("n1",) if self.state == "RUNNING" else ())

    b = Ended("COMPLETED")
    e = Enactor(b, clock=lambda: 0.0)
    res = e.apply([pl.Resize(7, 4, 8, 2, 4, D)])
    assert [(r.status, r.message) for r in res] == [("skipped", "the job ended before the resize signal")]
    assert not e.in_flight
    b = Ended("RUNNING")  # still running: the failed signal is a real error
    res = Enactor(b, clock=lambda: 0.0).apply([pl.Resize(7, 4, 8, 2, 4, D)])
    assert [r.status for r in res] == ["error"]


def test_starts_and_resizes_exclude_nodes_kept_for_a_rigid_job_and_clear_it_after():
    """The daemon's reservation for a rigid job is told to Slurm as ExcNodeList (a restarted job is placed
    by Slurm); once nothing is reserved, the next start/resize of a job excluded before clears it."""
    from slurm_elastic import planner as pl
    from slurm_elastic.enact import _exclude_reserved
    from slurm_elastic.spec import Decision

    class E:
        excluded: set = set()

    e = E()
    e.excluded = set()
    d = Decision(gpus=3, nodes=1, batch=48, local_batch=16, accum=1, seq=1)
    acts = (pl.Resize(1, 5, 3, 1, 3, d), pl.Start(2, 3, 1, 3, d), pl.Leave(3, "same GPU count"))
    out = _exclude_reserved(pl.Plan(actions=acts, committed_gpus=0, deferred=0), {"v1": 8, "v2": 0}, e)
    assert [getattr(a, "exclude_nodes", None) for a in out.actions] == [("v1",), ("v1",), None]
    assert e.excluded == {1, 2}
    later = (pl.Resize(1, 3, 4, 1, 4, d), pl.Start(4, 3, 1, 3, d))
    out = _exclude_reserved(pl.Plan(actions=later, committed_gpus=0, deferred=0), {}, e)
    assert [a.exclude_nodes for a in out.actions] == [(), None] and e.excluded == {2}


def test_a_daemon_restart_keeps_whom_it_excluded_and_still_clears_the_list_at_the_next_start(tmp_path):
    """A job pinned away from nodes (ExcNodeList) before the daemon restarted gets its list cleared at its
    next start: the books keep it. Before, the new daemon forgot it and the stale list kept Slurm from
    placing the job where the planner placed it. An unreadable stored list still counts as one."""
    import sqlite3

    from slurm_elastic.daemon.state import UNKNOWN_EXCLUDED, StateDB
    from slurm_elastic.enact import _exclude_reserved

    d = Decision(gpus=3, nodes=1, batch=48, local_batch=16, accum=1, seq=1)
    pinned = pl.Start(2, 3, 1, 3, d, exclude_nodes=("a1", "a2"))
    books = pl.update_books({}, [pinned, pl.Start(4, 3, 1, 3, d)], 100.0)
    assert books[2].excluded == ("a1", "a2") and books[4].excluded == ()
    db = StateDB(tmp_path)
    db.save_books(books)
    db.conn.execute("INSERT INTO books(job_id, rescales, seq, excluded) VALUES (9, 0, 0, '{\"not\": 1}')")
    db.close()
    loaded = StateDB(tmp_path).load_books()
    assert loaded[2].excluded == ("a1", "a2") and loaded[4].excluded == () and loaded[9].excluded == UNKNOWN_EXCLUDED
    con = sqlite3.connect(tmp_path / "state.sqlite3")
    assert con.execute("SELECT excluded FROM books WHERE job_id = 4").fetchone()[0] is None
    con.close()

    class E:  # what Daemon.open restores into its Enactor
        excluded = {j for j, b in loaded.items() if b.excluded}

    again = (pl.Start(2, 3, 1, 3, d), pl.Start(4, 3, 1, 3, d), pl.Resize(9, 3, 4, 1, 4, d))
    out = _exclude_reserved(pl.Plan(actions=again, committed_gpus=0, deferred=0), {}, E)
    assert [a.exclude_nodes for a in out.actions] == [(), None, ()] and E.excluded == set()


def test_daemon_open_restores_the_excluded_jobs_from_its_books(tmp_path):
    from slurm_elastic.backends.simulated import SimulatedSlurm
    from slurm_elastic.daemon.config import config_from_dict
    from slurm_elastic.daemon.loop import Daemon
    from slurm_elastic.daemon.state import StateDB

    db = StateDB(tmp_path / "state")
    db.save_books({5: pl.JobBook(last_change_s=1.0, excluded=("n1",)), 6: pl.JobBook(last_change_s=1.0)})
    db.close()
    sim = SimulatedSlurm(groups=[(1, 4, "gpu", "t4")])
    cfg = config_from_dict({"state_dir": str(tmp_path / "state"), "metrics_address": ""})
    dm = Daemon(cfg, backend=sim, ack=sim, clock=lambda: sim.now)
    dm.open()
    try:
        assert dm.enactor.excluded == {5}
    finally:
        dm.close()


def test_freeze_tells_the_policy_how_long_each_running_job_has_held_its_size():
    from slurm_elastic import planner as pl
    from slurm_elastic.enact import _freeze
    from slurm_elastic.policies.base import AllocationProblem, JobRequest
    from slurm_elastic.problem import Snapshot
    from slurm_elastic.spec import ElasticSpec

    s = ElasticSpec(1, 8, 32, 1024, 256)
    reqs = (JobRequest(1, s, None, 2, 64), JobRequest(2, s, None, 2, 64), JobRequest(3, s, None, 0))
    views = (pl.JobView(1, pl.RUNNING, 2), pl.JobView(2, pl.RUNNING, 2), pl.JobView(3, pl.PENDING))
    snap = Snapshot(AllocationProblem(8, 4, reqs), views, {}, {}, {}, 8, 8, 0, 4)
    books = {1: pl.JobBook(last_change_s=1000.0), 2: pl.JobBook(last_change_s=1900.0)}
    out = _freeze(snap, books, 2000.0, pl.PlannerConfig(cooldown_s=300.0))
    j1, j2, j3 = out.problem.jobs
    assert (j1.held_s, j1.frozen) == (1000.0, False)
    assert (j2.held_s, j2.frozen) == (100.0, True)  # in its cooldown: frozen, and 100 s at its size
    assert j3.held_s is None  # pending: no size held


def test_a_jobs_age_counts_from_its_first_submission_not_slurms_requeue_reset(tmp_path):
    # Slurm resets SubmitTime when a resize requeues a job (22.05.8: 17:45:30 before `scontrol requeue`,
    # 17:45:34 after). The books keep the submit time seen before the daemon's first action on the job,
    # and the policy's age (Pollux's re-allocation factor) counts from it, and survives a daemon restart.
    import sqlite3

    from slurm_elastic.daemon.state import StateDB
    from slurm_elastic.enact import _freeze
    from slurm_elastic.policies.base import AllocationProblem, JobRequest
    from slurm_elastic.problem import Snapshot
    from slurm_elastic.spec import ElasticSpec

    books = pl.update_books({}, [pl.Start(7, 2, 1, 2, D)], 1000.0, {7: 400.0, 8: 900.0})
    assert books[7].submitted_s == 400.0 and 8 not in books
    books = pl.update_books(books, [pl.Resize(7, 2, 4, 1, 4, D)], 5000.0, {7: 4990.0})  # Slurm's, after a requeue
    assert books[7].submitted_s == 400.0 and books[7].rescales == 1

    s = ElasticSpec(1, 8, 32, 1024, 256)
    reqs = (JobRequest(7, s, None, 4, 64, age_s=10.0), JobRequest(9, s, None, 4, 64, age_s=50.0))
    views = (pl.JobView(7, pl.RUNNING, 4), pl.JobView(9, pl.RUNNING, 4))
    snap = Snapshot(AllocationProblem(8, 4, reqs), views, {}, {}, {}, 8, 8, 0, 4)
    j7, j9 = _freeze(snap, books, 6000.0, pl.PlannerConfig(cooldown_s=300.0)).problem.jobs
    assert j7.age_s == 5600.0 and j9.age_s == 50.0  # no book: Slurm's own age

    # a state database from before the column existed is migrated, and the time survives a restart
    old = tmp_path / "state"
    old.mkdir()
    con = sqlite3.connect(old / "state.sqlite3")
    con.execute("CREATE TABLE books (job_id INTEGER PRIMARY KEY, last_change REAL, rescales INTEGER NOT NULL, "
                "seq INTEGER NOT NULL)")
    con.execute("INSERT INTO books VALUES (5, 10.0, 2, 1)")
    con.commit()
    con.close()
    db = StateDB(old)
    assert db.load_books()[5] == pl.JobBook(last_change_s=10.0, rescales=2, seq=1)
    db.save_books(books)
    db.close()
    assert StateDB(old).load_books()[7].submitted_s == 400.0


# ----- a job that will not die does not stall the cycle (issue 24 item 7) ---------------------------------
class SlowRequeue(Recorder):
    """requeue_hold returns at once (wait=False); Slurm shows the job COMPLETING until ``ends[job]`` polls
    of get_job have passed (a job that ignores TERM: KillWait)."""

    def __init__(self, ends):
        super().__init__()
        self.ends = dict(ends)
        self.requeued = set()

    def requeue_hold(self, job_id, *, wait=True):
        assert not wait, "the enactor must not wait inside the cycle"
        self._call("requeue_hold", job_id)
        self.requeued.add(job_id)

    def get_job(self, job_id, include_finished=False):
        from slurm_elastic.backends.base import JobRecord

        if job_id in self.requeued and self.ends.get(job_id, 0) > 0:
            self.ends[job_id] -= 1
            return JobRecord(job_id, "j", "u", "gpu", "PENDING", state_flags=("COMPLETING",), held=True)
        state = "PENDING" if job_id in self.requeued else "RUNNING"
        return JobRecord(job_id, "j", "u", "gpu", state, held=job_id in self.requeued)


def test_a_job_slow_to_end_delays_only_itself(monkeypatch):
    import slurm_elastic.enact as enact

    wall = [1000.0]
    monkeypatch.setattr(enact.time, "time", lambda: wall[0])
    b = SlowRequeue({7: 50})  # job 7 ignores TERM: COMPLETING for 50 looks
    now = [0.0]
    e = Enactor(b, clock=lambda: now[0], requeue_timeout_s=300)
    e.apply([pl.Resize(7, 4, 2, 1, 2, D), pl.Resize(8, 4, 2, 1, 2, D)])
    b.acked |= {7, 8}
    assert e.poll() == []  # both requeues sent; Slurm's credential second not over yet
    assert [c[0] for c in b.calls].count("requeue_hold") == 2 and set(e.in_flight) == {7, 8}
    wall[0] += 2
    now[0] = 2.0
    res = e.poll()  # job 8 is pending: placed; job 7 still ending: left for a later poll, no wait
    assert [(r.action.job_id, r.status) for r in res] == [(8, "done")]
    assert set(e.in_flight) == {7} and e.in_flight_targets() == {7: 2}
    assert [c[:2] for c in b.calls if c[0] in ("update_job", "release")] == [("update_job", 8), ("release", 8)]
    # Starts in the same cycle go ahead while 7 ends.
    res = e.apply([pl.Start(9, 2, 1, 2, D)])
    assert ("release", 9) in b.calls and [r.status for r in res if r.action.job_id == 9] == ["done"]
    for t in range(3, 60):
        wall[0] += 1
        now[0] = float(t)
        res = e.poll()
        if res:
            break
    assert [(r.action.job_id, r.status) for r in res] == [(7, "done")] and not e.in_flight
    assert b.calls[-1] == ("release", 7)


def test_a_requeue_that_never_finishes_times_out_without_blocking(monkeypatch):
    import slurm_elastic.enact as enact

    monkeypatch.setattr(enact.time, "time", lambda: 5000.0)
    b = SlowRequeue({7: 10**6})
    now = [0.0]
    e = Enactor(b, clock=lambda: now[0], requeue_timeout_s=60)
    e.apply([pl.Resize(7, 4, 2, 1, 2, D)])
    b.acked.add(7)
    e.poll()
    now[0] = 61.0
    res = e.poll()
    assert [r.status for r in res] == ["error"] and "after requeuehold" in res[0].message and not e.in_flight
    assert not any(c[0] == "release" for c in b.calls)


def test_a_cancelled_job_still_completing_is_never_planned():
    from slurm_elastic.backends.base import JobRecord, NodeRecord
    from slurm_elastic.problem import build_problem

    spec = "elastic:min_gpus=1,max_gpus=4,min_batch=32,max_batch=512,max_local_batch=32,batch=64"
    nodes = [NodeRecord("n1", "MIXED", gpus_total=4, gpus_used=2, partitions=("gpu",))]
    cancelled = JobRecord(1, "j", "u", "gpu", "COMPLETING", comment=spec, gpus_per_node=2, gpus_total=2,
                          node_count=1, nodes=("n1",))
    cancelled_24 = JobRecord(2, "j", "u", "gpu", "PENDING", state_flags=("COMPLETING",), comment=spec)
    waiting = JobRecord(3, "j", "u", "gpu", "PENDING", comment=spec, held=True)
    from slurm_elastic.profiles import load_profile

    snap = build_problem([cancelled, cancelled_24, waiting], nodes, model_for=lambda r, s: load_profile("cifar10"),
                         now=0.0)
    assert [j.job_id for j in snap.problem.jobs] == [3]
    assert "ending" in snap.unmanaged[1] and "ending" in snap.unmanaged[2]
    assert snap.capacity == 2  # the GPUs the cancelled job still holds are not offered


def test_a_start_that_follows_resizes_is_released_once_they_are_placed():
    # The planner places starts after the cycle's resizes (a start may get the GPUs a resized job
    # leaves): the enactor releases it only once those resizes are placed, so Slurm places it there too.
    b = Recorder()
    e = Enactor(b, clock=lambda: 0.0)
    res = e.apply([pl.Resize(7, 4, 8, 2, 4, D), pl.Start(9, 1, 1, 1, D, after=(7,)), pl.Start(10, 1, 1, 1, D)])
    assert [r.status for r in res] == ["begun", "begun", "done"]  # 10 follows no resize
    assert [c[:2] for c in b.calls] == [("signal", 7), ("update_job", 10), ("release", 10)]
    assert e.poll() == [] and 9 in e.waiting
    b.acked.add(7)
    res = e.poll()
    assert [(r.action.job_id, r.status) for r in res] == [(7, "done"), (9, "done")]
    assert [c[:2] for c in b.calls[3:]] == [("requeue_hold", 7), ("update_job", 7), ("release", 7),
                                            ("update_job", 9), ("release", 9)]
    # one still waiting when the next plan comes is dropped: the new plan decides about its job
    e.apply([pl.Resize(8, 4, 8, 2, 4, D), pl.Start(11, 1, 1, 1, D, after=(8,))])
    assert set(e.waiting) == {11}
    e.apply([])
    assert not e.waiting


def test_a_grow_with_no_place_is_kept_at_its_size_and_the_cycle_solves_again_for_the_idle_gpus():
    """Issue 23 item 7 (found on Sia's cluster): the allocation grew a job onto GPUs it could not be
    placed on this cycle, and the GPUs it counted on idled while a job that fitted them waited. The cycle
    solves again with that job kept at its size; the second answer is kept when it commits more GPUs."""
    from slurm_elastic.backends.base import JobRecord, NodeRecord
    from slurm_elastic.enact import CycleState, run_cycle
    from slurm_elastic.policies.base import Allocation, JobAllocation, Policy
    from slurm_elastic.profiles import load_profile

    spec = "elastic:min_gpus=1,max_gpus=8,min_batch=32,max_batch=256,max_local_batch=64"

    class Cluster(Recorder):
        def list_jobs(self):
            run = dict(state="RUNNING", gpus_per_node=2, node_count=1, comment=spec, user="u", partition="gpu")
            return [JobRecord(job_id=1, name="a", gpus_total=2, nodes=("n1",), **run),
                    JobRecord(job_id=2, name="c", gpus_total=2, nodes=("n2",), **run),
                    JobRecord(job_id=3, name="b", state="PENDING", user="u", partition="gpu", gpus_total=0,
                              gpus_per_node=0, node_count=1, nodes=(), comment=spec, held=True)]

        def list_nodes(self):
            return [NodeRecord(n, "MIXED", (), 4, 2, 8, ("gpu",)) for n in ("n1", "n2")]

    class Asks(Policy):  # job 1 to 6 GPUs (3 + 3 on two nodes: n2 has 2 free), unless it is kept
        name = "asks"

        def __init__(self):
            self.seen = []

        def allocate(self, problem):
            kept = {r.job_id for r in problem.jobs if r.frozen}
            self.seen.append(kept)
            def a(j, g):
                return JobAllocation(j, g, batch=32 * g, local_batch=32)
            if 1 in kept:
                return Allocation({1: a(1, 2), 2: a(2, 2), 3: a(3, 2)}, policy=self.name)
            return Allocation({1: a(1, 6), 2: a(2, 2), 3: a(3, 0)}, policy=self.name)

    be, pol = Cluster(), Asks()
    res = run_cycle(be, pol, Enactor(be), CycleState(), model_for=lambda j, s: load_profile("cifar10"), now=0.0)
    assert pol.seen == [set(), {1}]
    got = {a.job_id: (a.kind, getattr(a, "gpus", None)) for a in res.plan.actions}
    assert got == {1: ("leave", None), 2: ("leave", None), 3: ("start", 2)}, res.plan.actions
    assert res.plan.committed_gpus == 6 and res.allocation.jobs[3].gpus == 2  # was: 4, with 4 GPUs idle
    assert res.allocation.jobs[1].reason.startswith("kept at its size this cycle: its 6 GPUs had no place on the")
    assert res.plan.actions[[a.job_id for a in res.plan.actions].index(1)].reason == res.allocation.jobs[1].reason
    # a second answer that commits no more is not taken: job 1's grow waits, as the policy chose
    class Stays(Asks):
        def allocate(self, problem):
            self.seen.append({r.job_id for r in problem.jobs if r.frozen})
            a = lambda j, g: JobAllocation(j, g, batch=32 * g, local_batch=32)  # noqa: E731
            return Allocation({1: a(1, 6), 2: a(2, 2), 3: a(3, 0)}, policy=self.name)

    pol = Stays()
    res = run_cycle(be, pol, Enactor(be), CycleState(), model_for=lambda j, s: load_profile("cifar10"), now=0.0)
    assert pol.seen == [set(), {1}] and res.plan.committed_gpus == 4 and res.plan.blocked == {1}

    # the GPUs freed for a second solve go to another grow with no place (found on Sia's cluster, workload 3:
    # two grows on fragmented RTX nodes in turn, two GPUs idle while five jobs waited): that one is kept at
    # its size too, and the third answer, which commits more, is carried out
    class Turns(Asks):
        def allocate(self, problem):
            kept = {r.job_id for r in problem.jobs if r.frozen}
            self.seen.append(kept)
            a = lambda j, g: JobAllocation(j, g, batch=32 * g, local_batch=32)  # noqa: E731
            if {1, 2} <= kept:
                return Allocation({1: a(1, 2), 2: a(2, 2), 3: a(3, 2)}, policy=self.name)
            if 1 in kept:
                return Allocation({1: a(1, 2), 2: a(2, 6), 3: a(3, 0)}, policy=self.name)
            return Allocation({1: a(1, 6), 2: a(2, 2), 3: a(3, 0)}, policy=self.name)

    pol = Turns()
    res = run_cycle(be, pol, Enactor(be), CycleState(), model_for=lambda j, s: load_profile("cifar10"), now=0.0)
    assert pol.seen == [set(), {1}, {1, 2}] and res.plan.committed_gpus == 6, res.plan.actions
    got = {a.job_id: (a.kind, getattr(a, "gpus", None)) for a in res.plan.actions}
    assert got == {1: ("leave", None), 2: ("leave", None), 3: ("start", 2)}
    assert res.allocation.jobs[2].reason.startswith("kept at its size this cycle: its 6 GPUs had no place")

    # a grow that max_in_flight defers leaves its GPUs idle as surely: kept at its size too, and solved again
    class Slots(Asks):
        def allocate(self, problem):
            kept = {r.job_id for r in problem.jobs if r.frozen}
            self.seen.append(kept)
            a = lambda j, g: JobAllocation(j, g, batch=32 * g, local_batch=32)  # noqa: E731
            if 2 in kept:
                return Allocation({1: a(1, 4), 2: a(2, 2), 3: a(3, 2)}, policy=self.name)
            return Allocation({1: a(1, 4), 2: a(2, 4), 3: a(3, 0)}, policy=self.name)

    pol = Slots()
    res = run_cycle(be, pol, Enactor(be), CycleState(), model_for=lambda j, s: load_profile("cifar10"), now=0.0,
                    planner_config=pl.PlannerConfig(max_in_flight=1))
    assert pol.seen == [set(), {2}] and res.plan.committed_gpus == 8, res.plan.actions
    got = {a.job_id: (a.kind, getattr(a, "gpus", None)) for a in res.plan.actions}
    assert got == {1: ("resize", 4), 2: ("leave", None), 3: ("start", 2)}  # was: 6 committed, job 3 waiting
    assert res.allocation.jobs[2].reason.startswith(
        "kept at its size this cycle: its change to 4 GPUs waits for a resize slot (max_in_flight (1) reached)")


def test_a_released_job_held_again_is_left_out_of_a_second_solve_so_its_gpus_do_not_idle():
    """Found on Sia's cluster (workloads 6 and 8): a released job Slurm could not start (its GPUs free in
    total, scattered over nodes) is held again by the planner after ``start_timeout_s``, but the allocation
    had kept its GPUs for it, so they idled for a cycle (5 and 16 GPUs) while jobs that fitted waited. The
    cycle solves again without it; the planner still holds it."""
    from slurm_elastic.backends.base import JobRecord, NodeRecord
    from slurm_elastic.enact import CycleState, run_cycle
    from slurm_elastic.policies.base import Allocation, JobAllocation, Policy
    from slurm_elastic.profiles import load_profile

    spec = "elastic:min_gpus=1,max_gpus=8,min_batch=32,max_batch=256,max_local_batch=64"
    released = Decision(gpus=8, nodes=2, batch=256, local_batch=32, accum=1, seq=1).to_admin_comment()

    class Cluster(Recorder):
        def list_jobs(self):
            common = dict(user="u", partition="gpu", comment=spec)
            return [JobRecord(job_id=1, name="r", state="RUNNING", gpus_per_node=1, gpus_total=2, node_count=2,
                              nodes=("n1", "n2"), **common),
                    JobRecord(job_id=2, name="s", state="PENDING", gpus_per_node=4, gpus_total=8, node_count=2,
                              admin_comment=released, **common),  # released 5 min ago: 2 x 4 fit nowhere
                    JobRecord(job_id=3, name="p", state="PENDING", held=True, **common)]

        def list_nodes(self):
            return [NodeRecord("n1", "MIXED", (), 4, 1, 8, ("gpu",)), NodeRecord("n2", "MIXED", (), 4, 1, 8, ("gpu",)),
                    NodeRecord("n3", "IDLE", (), 4, 0, 8, ("gpu",))]

    class Counts(Policy):  # keeps 8 GPUs for the released job while it is in the problem
        name = "counts"

        def __init__(self):
            self.seen = []

        def allocate(self, problem):
            ids = {r.job_id for r in problem.jobs}
            self.seen.append(ids)
            a = lambda j, g: JobAllocation(j, g, batch=32 * g, local_batch=32)  # noqa: E731
            if 2 in ids:
                return Allocation({1: a(1, 2), 2: a(2, 8), 3: a(3, 1)}, policy=self.name)
            return Allocation({1: a(1, 2), 3: a(3, 4)}, policy=self.name)

    be, pol = Cluster(), Counts()
    state = CycleState(books={2: pl.JobBook(last_change_s=-300.0, seq=1)})
    res = run_cycle(be, pol, Enactor(be), state, model_for=lambda j, s: load_profile("cifar10"), now=0.0)
    assert pol.seen == [{1, 2, 3}, {1, 3}], pol.seen
    got = {a.job_id: (a.kind, getattr(a, "gpus", None)) for a in res.plan.actions}
    assert got == {1: ("leave", None), 2: ("hold", 8), 3: ("start", 4)}, res.plan.actions
    assert res.plan.committed_gpus == 6  # was: 3, job 3 started at 1 and 8 GPUs idle


def test_a_released_job_is_solved_in_the_pool_it_was_pinned_to():
    """Several pools: a released job Slurm has not started is frozen, by the policy, in the pool its
    partition and excluded nodes leave it where it fits on the free GPUs now (``enact._released_to``);
    "" where it fits in none of them, or in several (the policy may then start it elsewhere and
    the planner hold it again at once; seen live: a job released to the busy V100s moved to free A100s)."""
    from dataclasses import replace

    from sim_helpers import toy_spec

    from slurm_elastic.enact import _released_to
    from slurm_elastic.policies.base import JobRequest, Pool

    pools = (Pool("a", "a100", ("gpu",), (("a0", 8),), 8), Pool("r", "rtx", ("gpu",), (("r0", 8), ("r1", 8)), 8),
             Pool("t", "t4", ("t4",), (("t0", 4),), 4))
    spec = toy_spec(max_gpus=8)
    req = JobRequest(job_id=5, spec=spec, model=None, running_gpus=8)
    v = pl.JobView(5, pl.STARTING, 8, 8, 0.0, spec, start_nodes=frozenset({"a0", "r0", "r1"}))
    free = {"a0": 8, "r0": 8, "r1": 2, "t0": 4}

    def to(view, book, r=req, f=free):
        return _released_to(view, book, r, pools, f, 8)

    assert to(v, pl.JobBook(excluded=("a0",))) == "r"  # pinned by ExcNodeList
    assert to(v, pl.JobBook(excluded=("r0", "r1"))) == "a"
    assert to(v, pl.JobBook()) == ""  # partition "gpu" holds two types, and 8 fit in both: not known
    assert to(v, pl.JobBook(), f={**free, "a0": 7}) == "r"  # ... but fit only on the RTX nodes now
    assert to(v, pl.JobBook(), f={**free, "a0": 7, "r0": 7}) == ""  # ... or in neither
    assert to(replace(v, gpus=4, start_nodes=frozenset({"t0"})), None) == "t"  # pinned by partition
    assert to(v, pl.JobBook(excluded=("a0",)), replace(req, pools=("a", "t"))) == ""
    assert to(v, pl.JobBook(excluded=("a0",)), f={**free, "r0": 6}) == ""  # 8 fit on no RTX node now
