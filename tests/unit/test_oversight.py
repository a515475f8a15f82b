"""Operators win and what cannot restart is never stopped: daemon/oversight.py and the requeue rule,
through the daemon itself over the simulated backend (the live rows are in tests/faults/test_operators.py)."""

from slurm_elastic.backends.base import JobRecord
from slurm_elastic.backends.simulated import SimulatedSlurm
from slurm_elastic.daemon.config import config_from_dict
from slurm_elastic.daemon.loop import Daemon
from slurm_elastic.daemon.oversight import held_by_daemon, review
from slurm_elastic.profiles import load_profile

SPEC = "elastic:min_gpus=1,max_gpus=8,min_batch=128,max_batch=4096,max_local_batch=512,batch=256,profile=cifar10"


def _daemon(sim, state_dir):
    cfg = config_from_dict({"state_dir": str(state_dir), "metrics_address": "", "cooldown_s": 0,
                            "restart_cost_s": 5, "ack_timeout_s": 600})
    d = Daemon(cfg, backend=sim, ack=sim, clock=lambda: sim.now)
    d.open()
    return d


def _run(sim, d, until, step=20.0):
    while sim.now < until:
        d.cycle()
        sim.advance_to(sim.now + step)


def _rec(jid, **kw):
    base = dict(job_id=jid, name="j", user="u", partition="gpu", state="PENDING", comment=SPEC)
    base.update(kw)
    return JobRecord(**base)


def test_whose_hold_is_it():
    submit = _rec(1, held=True, state_reason="JobHeldUser")
    admin = _rec(2, held=True, state_reason="JobHeldUser", restart_count=1)  # an admin's requeuehold
    ours = _rec(3, held=True, state_reason="JobHeldAdmin", restart_count=1)
    again = _rec(4, held=True, state_reason="JobHeldAdmin", restart_count=2)  # requeueheld again after ours
    marks = {3: 1, 4: 1}
    assert held_by_daemon(submit, marks) and held_by_daemon(ours, marks)
    assert not held_by_daemon(admin, marks) and not held_by_daemon(again, marks)
    assert held_by_daemon(admin, marks, open_intents={2})
    r = review([submit, admin, ours, again], marks, was_elastic={1, 2, 3, 4})
    assert set(r.left_alone) == {2, 4} and "operator" in r.left_alone[2]


def test_comment_edits_after_submit_are_named_and_never_leave_a_job_held_forever():
    plain_now = _rec(5, held=True, state_reason="JobHeldUser", comment="my run")
    became = _rec(6, state="RUNNING", comment=SPEC)
    released = _rec(7, state="RUNNING", comment=SPEC)
    r = review([plain_now, became, released], {7: 1}, was_elastic={5, 7})
    assert r.release == {5: "no longer elastic: released to run as a plain job"}
    assert "stopped being elastic" in r.notes[5] and "became elastic" in r.notes[6]
    assert "released by someone else" in r.notes[7] and 7 in r.forget
    # First cycle after a start (nothing known yet): no false "became elastic" note.
    assert review([became], {}, was_elastic=set()).notes == {}


def test_an_admin_requeuehold_is_never_released_and_a_manual_release_is_replanned(tmp_path):
    sim = SimulatedSlurm(nodes=2, gpus_per_node=4, checkpoint_s=5, restart_s=10)
    model = load_profile("cifar10")
    a = sim.submit(name="A", gpus_per_node=1, comment=SPEC, total_samples=1e9, model=model)
    b = sim.submit(name="B", gpus_per_node=1, comment=SPEC, total_samples=1e9, model=model)
    d = _daemon(sim, tmp_path)
    _run(sim, d, 60)
    assert sim.get_job(a).is_running and sim.get_job(b).is_running
    sim.requeue_hold(a)  # the operator's, not the daemon's: no mark in the state DB
    _run(sim, d, 400)
    job = sim.get_job(a)
    assert job.is_pending and job.held, "the daemon released an operator's hold"
    assert "operator" in d.db.job_views()[a]["reason"]
    assert sim.get_job(b).is_running and sim.get_job(b).gpus_total == 8, "the other job was not re-planned"
    sim.release(a)  # the operator releases it: planned again, not fought
    _run(sim, d, 800)
    assert sim.get_job(a).is_running and not sim.get_job(a).held
    assert "operator" not in (d.db.job_views()[a]["reason"] or "")
    d.close()


def test_the_daemons_own_holds_are_marked_and_released(tmp_path):
    sim = SimulatedSlurm(nodes=1, gpus_per_node=4, checkpoint_s=5, restart_s=10)
    model = load_profile("cifar10")
    a = sim.submit(name="A", gpus_per_node=1, comment=SPEC, total_samples=1e9, model=model)
    d = _daemon(sim, tmp_path)
    _run(sim, d, 40)
    b = sim.submit(name="B", gpus_per_node=1, comment=SPEC, total_samples=1e9, model=model)
    _run(sim, d, 600)
    # A was shrunk by the daemon (requeuehold + release): its own hold, marked and released again.
    assert sim.get_job(a).is_running and sim.get_job(b).is_running
    assert sim.get_job(a).restart_count >= 1 and d.db.held_marks() == {}
    d.close()


def test_a_job_slurm_will_not_requeue_is_never_signalled(tmp_path):
    sim = SimulatedSlurm(nodes=1, gpus_per_node=4, checkpoint_s=5, restart_s=10)
    model = load_profile("cifar10")
    a = sim.submit(name="A", gpus_per_node=1, comment=SPEC, total_samples=1e9, model=model, requeueable=False)
    d = _daemon(sim, tmp_path)
    _run(sim, d, 60)
    assert sim.get_job(a).is_running and sim.get_job(a).gpus_total == 4  # it may be started
    b = sim.submit(name="B", gpus_per_node=1, comment=SPEC, total_samples=1e9, model=model)
    _run(sim, d, 600)
    # Without the rule the daemon shrinks A for B (seen: it signals A, which stops and cannot come back).
    assert sim.get_job(a).is_running and sim.get_job(a).gpus_total == 4 and sim.get_job(a).restart_count == 0
    assert "not requeueable" in d.db.job_views()[a]["reason"]
    assert not [r for r in d.db.decisions(a) if r["action"] in ("resize", "preempt")]
    assert sim.get_job(b).is_pending and b in d.db.job_views()  # the cycle goes on for B, which waits
    d.close()


def test_the_enactor_checks_the_requeue_flag_before_the_signal():
    from slurm_elastic import planner as pl
    from slurm_elastic.enact import Enactor
    from slurm_elastic.spec import Decision

    sim = SimulatedSlurm(nodes=1, gpus_per_node=4)
    model = load_profile("cifar10")
    a = sim.submit(name="A", gpus_per_node=2, comment=SPEC, total_samples=1e9, model=model, requeueable=False,
                   held=False)
    sim.advance_to(1)
    assert sim.get_job(a).is_running
    e = Enactor(sim)
    (r,) = e.apply([pl.Resize(a, 2, 1, 1, 1, Decision(1, 1, 256, 256))])
    assert r.status == "error" and "not requeueable" in r.message and not e.in_flight
    assert sim.get_job(a).is_running and sim.get_job(a).restart_count == 0


def test_a_configuration_that_manages_nothing_is_refused_at_start_and_at_reload(tmp_path):
    import pytest

    from slurm_elastic.daemon.config import ConfigError

    sim = SimulatedSlurm(nodes=1, gpus_per_node=4)
    cfg = config_from_dict({"state_dir": str(tmp_path / "s"), "metrics_address": "", "partitions": ["gpux"]})
    with pytest.raises(ConfigError, match="'gpux' not found in Slurm"):
        Daemon(cfg, backend=sim, ack=sim).open()
    conf = tmp_path / "d.toml"
    conf.write_text(f'state_dir = "{tmp_path / "s"}"\nmetrics_address = ""\npartitions = ["gpu"]\n')
    good = config_from_dict({"state_dir": str(tmp_path / "s"), "metrics_address": "", "partitions": ["gpu"]})
    d = Daemon(good, backend=sim, ack=sim, config_path=conf)
    d.open()  # the lock was released by the refused start
    conf.write_text(f'state_dir = "{tmp_path / "s"}"\nmetrics_address = ""\npartitions = ["gpu", "typo"]\n')
    d.reload()
    assert d.config.partitions == ("gpu",)  # the old configuration is kept
    d.close()


class _LeaseSlurm:
    """Just enough of a backend for the lease: held placeholder jobs with an AdminComment."""

    def __init__(self):
        self.jobs: dict[int, JobRecord] = {}
        self.next_id = 100

    def submit_lease(self, name, partition, admin_comment):
        self.next_id += 1
        self.jobs[self.next_id] = _rec(self.next_id, name=name, comment="", held=True, admin_comment=admin_comment)
        return self.next_id

    def update_job(self, job_id, admin_comment=None, **_):
        from dataclasses import replace

        self.jobs[job_id] = replace(self.jobs[job_id], admin_comment=admin_comment)

    def cancel_lease(self, job_id):
        del self.jobs[job_id]

    def list_jobs(self):
        return list(self.jobs.values())


def test_a_second_daemon_with_its_own_state_dir_is_told_by_the_lease_in_slurm(tmp_path):
    from slurm_elastic.daemon.lease import Lease

    slurm = _LeaseSlurm()
    now = [1000.0]
    alive = {1, 2, 3}
    mk = lambda d, host, pid: Lease(slurm, str(tmp_path / d), 60, clock=lambda: now[0], host=host, pid=pid,  # noqa: E731
                                    pid_alive=lambda p: p in alive)
    first, second, remote = mk("a", "h", 1), mk("b", "h", 2), mk("c", "h2", 3)
    assert first.check(slurm.list_jobs()) is None
    why = second.check(slurm.list_jobs())
    assert why and f"lease job {first.job_id}" in why and "host h," in why and "pid 1" in why  # refused, named
    assert remote.check(slurm.list_jobs())  # another host too
    now[0] += 30
    assert first.check(slurm.list_jobs()) is None and second.check(slurm.list_jobs())  # renewed: still refused
    # A user's job with a lease-looking *Comment* is no lease (only the AdminComment counts).
    slurm.jobs[1] = _rec(1, comment="elastic-lease:key=x,host=z,pid=9,ts=1030,ttl=60")
    assert first.check(slurm.list_jobs()) is None
    # The first daemon is SIGKILLed: on its host, the pid in its lease is gone, so it is stale at once.
    alive.discard(1)
    assert second.check(slurm.list_jobs()) is None
    # On another host only the ttl tells: refused until the dead lease is 60 s old; the live one is older.
    assert remote.check(slurm.list_jobs())
    alive.discard(2)
    now[0] += 61
    assert remote.check(slurm.list_jobs()) is None
    # A restarted daemon on the same host and state dir adopts its own lease (no second placeholder).
    again = mk("c", "h2", 4)
    assert again.check(slurm.list_jobs()) is None and again.job_id == remote.job_id
    again.release()
    assert again.job_id is None and remote.job_id not in slurm.jobs


# ----- no path around the hold (issue 24 item 4) ------------------------------------------------------
DECIDED = "elastic-decision:gpus=2,nodes=1,batch=256,local_batch=128,accum=1,seq=1"


def test_a_job_pending_without_a_hold_that_ran_before_is_held_again():
    owner_requeue = _rec(1, restart_count=1, admin_comment=DECIDED)  # placed at restart 0, requeued by its owner
    finished_requeue = _rec(2, restart_count=1, admin_comment=DECIDED)  # finished, forgotten, requeued
    slurms_requeue = _rec(3, restart_count=2, admin_comment=DECIDED)  # node failure after a resize (placed at 1)
    starting = _rec(4, restart_count=1, admin_comment=DECIDED)  # the daemon released it at 1: Slurm starts it
    submit_released = _rec(5)  # an operator released the plugin's submit hold: not fought
    ending = _rec(6, restart_count=1, admin_comment=DECIDED, state_flags=("COMPLETING",))
    ops_release = _rec(7, restart_count=1, admin_comment=DECIDED)  # an operator released the daemon's hold
    placed = {1: 0, 3: 1, 4: 1, 7: 0}
    recs = [owner_requeue, finished_requeue, slurms_requeue, starting, submit_released, ending, ops_release]
    r = review(recs, {7: 1}, was_elastic={1, 3, 4, 5, 6, 7}, placed=placed)
    assert set(r.hold) == {1, 2, 3}, r.hold
    assert "became elastic" not in r.notes.get(2, "") and "went around" in r.notes[2]
    assert 7 in r.forget and r.accept == {7: 1}  # accepted at its count: not held next cycle
    assert review([ops_release], {}, was_elastic={7}, placed={**placed, **r.accept}).hold == {}
    assert r.forget_placed == set()
    assert review([], {}, was_elastic=set(), placed=placed).forget_placed == set(placed)
    # Without the placed marks (an old caller) nothing is held: the old behaviour.
    assert review(recs, {7: 1}, was_elastic={1, 3, 4, 5, 6, 7}).hold == {}
    # Operators win still: held without a mark of the daemon's is left alone, never held "again".
    admin = _rec(8, held=True, state_reason="JobHeldUser", restart_count=1, admin_comment=DECIDED)
    r = review([admin], {}, was_elastic={8}, placed={8: 0})
    assert 8 in r.left_alone and not r.hold


def test_a_job_running_at_a_size_the_daemon_did_not_decide_is_limited_to_the_decided_size():
    grown = _rec(1, state="RUNNING", gpus_total=4, gpus_per_node=4, admin_comment=DECIDED)
    restarted = _rec(2, state="RUNNING", gpus_total=2, restart_count=2, admin_comment=DECIDED)  # Slurm started it
    placed_ok = _rec(3, state="RUNNING", gpus_total=2, restart_count=1, admin_comment=DECIDED)
    no_decision = _rec(4, state="RUNNING", gpus_total=1)
    r = review([grown, restarted, placed_ok, no_decision], {}, was_elastic={1, 2, 3, 4}, placed={2: 1, 3: 1})
    assert r.limit == {1: 2, 2: 2} and not r.hold
    assert "did not decide" in r.notes[1]


def test_the_capped_policy_shrinks_a_job_over_its_decided_size():
    from slurm_elastic.daemon.caps import CappedPolicy
    from slurm_elastic.policies import get_policy
    from slurm_elastic.policies.base import AllocationProblem, JobRequest
    from slurm_elastic.spec import parse_spec

    spec = parse_spec(SPEC, 1)
    model = load_profile("cifar10")
    running = JobRequest(job_id=1, spec=spec, model=model, running_gpus=4, running_batch=256, restart_s=5.0)
    pol = CappedPolicy(get_policy("dp"))
    problem = AllocationProblem(total_gpus=8, node_size=4, jobs=(running,), horizon_s=3600)
    assert pol.allocate(problem).jobs[1].gpus >= 4
    pol.limit = {1: 2}
    assert pol.allocate(problem).jobs[1].gpus <= 2


def test_an_owners_requeue_is_held_in_the_same_cycle_and_placed_under_the_user_cap(tmp_path):
    sim = SimulatedSlurm(nodes=2, gpus_per_node=4, checkpoint_s=5, restart_s=10)
    model = load_profile("cifar10")
    spec4 = SPEC.replace("max_gpus=8", "max_gpus=4")
    a = sim.submit(name="A", gpus_per_node=1, comment=spec4, total_samples=1e9, model=model, user="ann")
    cfg = config_from_dict({"state_dir": str(tmp_path), "metrics_address": "", "cooldown_s": 0,
                            "restart_cost_s": 5, "ack_timeout_s": 600, "max_gpus_per_user": 4})
    d = Daemon(cfg, backend=sim, ack=sim, clock=lambda: sim.now)
    d.open()
    _run(sim, d, 60)
    assert sim.get_job(a).is_running and d.db.placed_marks().get(a) is not None
    # The owner's `scontrol requeue`: back to the queue without a hold (simulated: requeuehold + release,
    # which the simulator starts at once, so the daemon first finds it pending only if Slurm waits).
    sim.requeue_hold(a)
    job = sim.get_job(a)
    sim._get(a).held = False  # pending, not held, restart count up: what `scontrol requeue` leaves
    sim._changed(sim._get(a))
    assert job.restart_count == 1
    b = sim.submit(name="B", gpus_per_node=1, comment=spec4, total_samples=1e9, model=model, user="ann")
    d.cycle()
    rows = [x for x in d.db.decisions() if x["job_id"] == a and x["action"] == "hold"]
    assert rows and rows[0]["reason"] == "went around the hold"
    _run(sim, d, 400)
    ann = sum(sim.get_job(j).gpus_total for j in (a, b) if sim.get_job(j).is_running)
    assert ann <= 4, ann
    assert sim.get_job(a).is_running and not sim.get_job(a).held
    d.close()
