"""Issue 23 item 2: per-GPU batch limits learned from out-of-memory failures.

The report's parser (train/protocol.parse_oom), the daemon's book (daemon/oom.py: checked against the
start's decision, lower only, bounded, persisted), the cap as the spec's own local_batch_by_type
(problem.capped_spec: the candidate tables), the planner's restart, and the in-job side (train/oom.py).
"""

from __future__ import annotations

import json
import os

import pytest

from slurm_elastic.backends.base import JobRecord, NodeRecord
from slurm_elastic.daemon.oom import OomBook
from slurm_elastic.problem import JobInfo, build_problem, capped_spec
from slurm_elastic.spec import Decision, parse_spec
from slurm_elastic.train.protocol import oom_path, parse_oom

SPEC = "elastic:min_gpus=1,max_gpus=8,min_batch=32,max_batch=1024,max_local_batch=128,batch=256,profile=cifar10"


def _report(**kw):
    r = {"format": 1, "job_id": "7", "restart_count": 2, "local_batch": 64, "accum": 1, "world_size": 4,
         "global_batch": 256}
    r.update(kw)
    return r


def test_parse_oom_takes_only_this_job_and_start_with_int_counts_in_range():
    assert parse_oom(_report(), 7, 2) == {"local_batch": 64, "accum": 1, "world_size": 4, "global_batch": 256}
    assert parse_oom(_report(), 8, 2) is None  # another job's
    assert parse_oom(_report(), 7, 1) is None  # an earlier start's
    assert parse_oom(_report(restart_count=True), 7, 1) is None
    assert parse_oom(_report(restart_count=2.0), 7, 2) is None and parse_oom(_report(restart_count="2"), 7, 2) is None
    for bad in (0, -1, True, 63.5, 64.0, "64", None, 1 << 40, float("nan")):
        assert parse_oom(_report(local_batch=bad), 7, 2) is None, bad
    assert parse_oom(_report(world_size=2 ** 21), 7, 2) is None
    assert parse_oom([_report()], 7, 2) is None and parse_oom(None, 7, 2) is None


def _job(tmp_path, *, restart=2, gpus=4, local=64, accum=1, batch=256, state="RUNNING", spec=SPEC):
    d = Decision(gpus=gpus, nodes=1, batch=batch, local_batch=local, accum=accum, seq=3)
    ckpt = tmp_path / "ck"
    ckpt.mkdir(exist_ok=True)
    comment = f"{spec},ckpt_dir={ckpt}"
    rec = JobRecord(job_id=7, name="x", user="u", partition="gpu", state=state, gpus_per_node=gpus, gpus_total=gpus,
                    node_count=1, nodes=("n1",), comment=comment, admin_comment=d.to_admin_comment(),
                    restart_count=restart, user_id=os.getuid())
    return rec, parse_spec(comment), str(ckpt)


def _write(ckpt, restart=2, **kw):
    oom_path(ckpt, 7, restart).write_text(json.dumps(_report(restart_count=restart, **kw)))


def test_book_learns_below_the_decided_local_batch_on_the_type_slurm_shows_and_only_lowers(tmp_path):
    job, spec, ckpt = _job(tmp_path)
    book = OomBook()
    book.observe(job, spec, ckpt, "t4")
    assert book.of(7) == () and book.restart_reason(job) == ("", 0)  # nothing reported
    _write(ckpt)
    book.observe(job, spec, ckpt, "t4")
    assert book.of(7) == (("t4", 63),) and book.changed
    assert book.restart_reason(job) == ("out of memory at local batch 64 on t4", 64)
    assert book.notes(7) == ["local batch <= 63 on t4: out of memory at 64"]
    # the next start (restart 3) at 32 ran out too: lower; its restart is no longer the old one's
    job3, _, _ = _job(tmp_path, restart=3, local=32, gpus=8)
    book.observe(job3, spec, ckpt, "t4")
    assert book.restart_reason(job3) == ("", 0)  # restart 3 has not reported
    _write(ckpt, restart=3, local_batch=32, world_size=8)
    book.observe(job3, spec, ckpt, "t4")
    assert book.of(7) == (("t4", 31),)
    # a report can never raise a limit: restart 4 "out of memory" at 100 is not its decision anyway, and
    # a decision of 100 (an old one) would give min(99, 31)
    job4, _, _ = _job(tmp_path, restart=4, local=100, batch=400)
    _write(ckpt, restart=4, local_batch=100, global_batch=400)
    book.observe(job4, spec, ckpt, "t4")
    assert book.of(7) == (("t4", 31),)
    # another type is its own limit
    job5, _, _ = _job(tmp_path, restart=5)
    _write(ckpt, restart=5)
    book.observe(job5, spec, ckpt, "a100")
    assert book.of(7) == (("a100", 63), ("t4", 31))


@pytest.mark.parametrize("claim,why", [
    ({"local_batch": 32}, "not this start's decision"),  # a batch it was not given
    ({"world_size": 8}, "not this start's decision"),
    ({"global_batch": 512}, "not this start's decision"),
    ({"job_id": "8"}, "not a report for this job"),
    ({"local_batch": 1e9}, "not a report for this job"),
])
def test_book_refuses_a_claim_that_is_not_the_starts_decision(tmp_path, claim, why):
    job, spec, ckpt = _job(tmp_path)
    _write(ckpt, **claim)
    book = OomBook()
    book.observe(job, spec, ckpt, "t4")
    assert book.of(7) == () and book.restart_reason(job) == ("", 0)
    assert why in book.problems[7]


def test_book_refuses_at_min_local_batch_without_a_decision_and_unsafe_files(tmp_path):
    job, spec, ckpt = _job(tmp_path, spec=SPEC.replace("max_local_batch=128", "max_local_batch=128,min_local_batch=64"))
    _write(ckpt)
    book = OomBook()
    book.observe(job, spec, ckpt, "t4")
    assert book.of(7) == () and "min_local_batch" in book.problems[7]
    job, spec, ckpt = _job(tmp_path)
    book.observe(JobRecord(**{**job.__dict__, "admin_comment": ""}), spec, ckpt, "t4")
    assert book.of(7) == () and "no daemon decision" in book.problems[7]
    # a symlink in place of the report is refused unopened (the daemon runs as root)
    p = oom_path(ckpt, 7, 2)
    target = tmp_path / "elsewhere.json"
    target.write_text(p.read_text())
    p.unlink()
    p.symlink_to(target)
    book.observe(job, spec, ckpt, "t4")
    assert book.of(7) == () and book.problems[7]
    # a pending job's report is not read (its start is over)
    p.unlink()
    _write(ckpt)
    book.observe(JobRecord(**{**job.__dict__, "state": "PENDING"}), spec, ckpt, "t4")
    assert book.of(7) == ()


def test_book_round_trips_through_json_and_skips_junk():
    book = OomBook()
    from slurm_elastic.daemon.oom import OomLimit

    book.limits = {7: {"t4": OomLimit(63, 64, 2), "": OomLimit(10, 11, 0)}, 9: {"a100": OomLimit(1, 2, 5)}}
    again = OomBook.from_json(json.loads(json.dumps(book.to_json())))
    assert again.limits == book.limits
    junk = {"7": {"t4": [63, 64, 2], "x": [64, 63, 1], "y": [1.5, 2, 0], "z": [True, 2, 0], "w": "no"},
            "abc": {"t4": [1, 2, 0]}, "8": [], "9": {"t": [0, 1, 0]}, "10": {"t": [1, 1 << 40, 0]}}
    assert OomBook.from_json(junk).limits == {7: {"t4": OomLimit(63, 64, 2)}}
    assert OomBook.from_json(["x"]).limits == {} and OomBook.from_json(None).limits == {}
    many = {"7": {f"t{i}": [1, 2, 0] for i in range(100)}}
    assert len(OomBook.from_json(many).limits[7]) == 16  # bounded per job
    book.forget({9})
    assert set(book.limits) == {9}


def test_capped_spec_is_the_specs_own_per_type_limit():
    spec = parse_spec(SPEC + ",local_batch_by_type=t4:48|v100:100")
    c = capped_spec(spec, (("t4", 63), ("a100", 90), ("v100", 70)))
    assert dict(c.local_batch_by_type) == {"t4": 48, "a100": 90, "v100": 70} and c.max_local_batch == 128
    assert c.on_type("a100").max_local_batch == 90 and c.on_type("k80").max_local_batch == 128
    u = capped_spec(spec, (("", 40),))  # untyped GPUs: the limit everywhere; per-type ones kept under it
    assert u.max_local_batch == 40 and dict(u.local_batch_by_type) == {"t4": 40, "v100": 40}
    low = capped_spec(parse_spec(SPEC + ",min_local_batch=16"), (("t4", 3),))
    assert dict(low.local_batch_by_type) == {"t4": 16}  # never below min_local_batch
    assert capped_spec(spec, ()) is spec


def _node(name, t, used=0):
    return NodeRecord(name, "MIXED" if used else "IDLE", (), 4, used, 8, ("gpu",), gpu_type=t)


def test_candidates_stay_below_the_limit_and_the_planner_restarts_the_job_at_once(tmp_path):
    """One type (t4): the running job at 4 x 64 ran out of memory. The policy never chooses a local batch
    above 63 for it on t4 (accumulation or more GPUs instead), and the planner restarts it now, although
    it is at the same GPU count, has not reported a step and changed a moment ago."""
    from slurm_elastic import planner as pl
    from slurm_elastic.policies import get_policy
    from slurm_elastic.profiles import load_profile

    model = load_profile("cifar10")
    for accum in (1, 4):  # more GPUs, or accumulation
        spec_text = SPEC.replace("max_gpus=8", f"max_gpus=8,max_accum={accum}")
        job, spec, _ = _job(tmp_path, gpus=4, local=64, spec=spec_text)
        info = JobInfo(local_batch_limits=(("t4", 63),), restart_now="out of memory at local batch 64 on t4",
                       restart_below=64)
        nodes = [_node("n1", "t4", used=4), _node("n2", "t4")]
        snap = build_problem([job], nodes, model_for=lambda r, s: model, now=100.0, job_info=lambda r, i=info: i)
        req = snap.problem.jobs[0]
        assert req.spec.max_local_batch == 63  # one type: its limit is the spec's
        assert snap.views[0].restart and snap.views[0].spec.max_local_batch == 63
        alloc = get_policy("dp").allocate(snap.problem)
        a = alloc.jobs[7]
        assert a.gpus > 0 and 0 < a.local_batch <= 63, a
        books = {7: pl.JobBook(last_change_s=99.0, rescales=1, seq=3)}
        plan = pl.plan(alloc, snap.views, books, 100.0, capacity=snap.capacity, node_size=4,
                       node_free=snap.node_free)
        act = {x.job_id: x for x in plan.actions}[7]
        assert act.kind == "resize" and act.decision.local_batch <= 63, act
        assert act.reason.startswith("out of memory at local batch 64 on t4: restarted"), act.reason
        # without the claim the same job is left alone (cooldown, stability guard)
        plain = [pl.JobView(**{**snap.views[0].__dict__, "restart": ""})]
        act = {x.job_id: x for x in pl.plan(alloc, plain, books, 100.0, capacity=snap.capacity, node_size=4,
                                            node_free=snap.node_free).actions}[7]
        assert act.kind == "leave"


def test_a_limit_on_one_type_leaves_the_other_types_batches():
    """Two types: the t4 limit goes to the t4 pool's spec only; the a100 pool keeps max_local_batch."""
    from slurm_elastic.profiles import load_profile

    model = load_profile("cifar10")
    spec = SPEC
    rec = JobRecord(job_id=7, name="x", user="u", partition="gpu", state="PENDING", comment=spec, held=True,
                    priority=0)
    nodes = [_node("n1", "t4"), _node("n2", "a100")]
    info = JobInfo(local_batch_limits=(("t4", 20),))
    snap = build_problem([rec], nodes, model_for=lambda r, s: model, now=100.0, job_info=lambda r: info)
    req = snap.problem.jobs[0]
    pools = {p.name: p.gpu_type for p in snap.problem.pools}
    by_type = {pools[n]: s.max_local_batch for n, s in req.pool_specs}
    assert by_type == {"t4": 20}  # a100's pool uses req.spec
    assert req.spec.max_local_batch == 128


@pytest.mark.parametrize("policy,accum,kind", [("static", 1, "preempt"), ("static", 4, "resize"),
                                               ("tiresias", 1, "preempt"), ("fixed-batch", 1, "resize")])
def test_a_policy_that_keeps_the_failed_batch_gets_the_job_held_not_restarted_into_the_same_error(
        tmp_path, policy, accum, kind):
    """static keeps a running job as it runs: at 4 x 64 with no accumulation allowed it would restart the
    job into the same out-of-memory error (a loop of restarts); the job is requeued and held instead,
    and as a pending job no policy starts it at a batch its limit refuses."""
    from slurm_elastic import planner as pl
    from slurm_elastic.policies import get_policy
    from slurm_elastic.profiles import load_profile

    model = load_profile("cifar10")
    job, _, _ = _job(tmp_path, spec=SPEC.replace("max_gpus=8", f"max_gpus=8,max_accum={accum}"))
    info = JobInfo(local_batch_limits=(("t4", 63),), restart_now="out of memory at local batch 64 on t4",
                   restart_below=64)
    nodes = [_node("n1", "t4", used=4), _node("n2", "t4")]
    snap = build_problem([job], nodes, model_for=lambda r, s: model, now=100.0, job_info=lambda r: info)
    alloc = get_policy(policy).allocate(snap.problem)
    act = {x.job_id: x for x in pl.plan(alloc, snap.views, {}, 100.0, capacity=snap.capacity, node_size=4,
                                        node_free=snap.node_free).actions}[7]
    assert act.kind == kind, (act, alloc.jobs[7])
    if kind == "resize":
        assert act.decision.local_batch <= 63
    else:
        assert "requeued and held" in act.reason
        held = JobRecord(**{**job.__dict__, "state": "PENDING", "held": True, "gpus_total": 0, "nodes": ()})
        snap = build_problem([held], [_node("n1", "t4"), _node("n2", "t4")], model_for=lambda r, s: model,
                             now=200.0, job_info=lambda r: JobInfo(local_batch_limits=(("t4", 63),)))
        a = get_policy(policy).allocate(snap.problem).jobs[7]
        assert a.gpus == 0 or a.local_batch <= 63, a


def test_planner_preempts_a_job_whose_start_cannot_go_on_when_the_policy_has_no_gpus_for_it():
    from slurm_elastic import planner as pl
    from slurm_elastic.policies.base import Allocation, JobAllocation

    v = pl.JobView(7, pl.RUNNING, gpus=4, batch=256, nodes=("n1",), gpus_per_node=4, stepped=False,
                   restart="out of memory at local batch 64 on t4")
    alloc = Allocation({7: JobAllocation(7, 0, 0, 0.0, reason="no room")})
    plan = pl.plan(alloc, [v], {}, 10.0, capacity=4, node_size=4)  # preemption off in the config
    (act,) = plan.actions
    assert act.kind == "preempt" and "requeued and held" in act.reason


# ---------------------------------------------------------------- the daemon: learn, restart, persist, status
def test_daemon_restarts_the_job_below_the_limit_keeps_it_across_a_restart_and_status_shows_it(tmp_path):
    from slurm_elastic.backends.simulated import SimulatedSlurm
    from slurm_elastic.commands.status import job_row, load_daemon_views, merge_daemon_view
    from slurm_elastic.daemon.config import config_from_dict
    from slurm_elastic.daemon.loop import Daemon
    from slurm_elastic.profiles import load_profile

    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    comment = SPEC.replace("max_gpus=8", "max_gpus=4") + f",ckpt_dir={ckpt}"
    from dataclasses import replace

    class Sim(SimulatedSlurm):  # the job runs as this test's user, so that the daemon reads its files
        def list_jobs(self, *a, **k):
            return [replace(r, user_id=os.getuid()) for r in super().list_jobs(*a, **k)]

    sim = Sim(groups=[(1, 4, "gpu", "t4")], checkpoint_s=5, restart_s=10)
    jid = sim.submit(name="A", gpus_per_node=1, comment=comment, total_samples=1e9, model=load_profile("cifar10"))

    def daemon():
        cfg = config_from_dict({"state_dir": str(tmp_path / "state"), "metrics_address": "", "cooldown_s": 0,
                                "restart_cost_s": 5, "ack_timeout_s": 600})
        d = Daemon(cfg, backend=sim, ack=sim, clock=lambda: sim.now)
        d.open()
        return d

    def decision():
        from slurm_elastic.spec import parse_decision

        return parse_decision(sim.get_job(jid).admin_comment, jid)

    d = daemon()
    for _ in range(3):
        d.cycle()
        sim.advance_to(sim.now + 5)
    job = sim.get_job(jid)
    assert job.is_running, d.db.job_views()[jid]["reason"]
    first = decision()
    restart = job.restart_count
    oom_path(ckpt, jid, restart).write_text(json.dumps(
        {"format": 1, "job_id": str(jid), "restart_count": restart, "local_batch": first.local_batch,
         "accum": first.accum, "world_size": first.gpus, "global_batch": first.batch}))
    for _ in range(6):
        d.cycle()
        sim.advance_to(sim.now + 5)
    job = sim.get_job(jid)
    assert job.is_running and job.restart_count > restart, "the job was not restarted after its out-of-memory"
    assert decision().local_batch < first.local_batch
    text = f"local batch <= {first.local_batch - 1} on t4: out of memory at {first.local_batch}"
    row = merge_daemon_view(job_row(job), load_daemon_views(str(tmp_path / "state")).get(jid))
    assert text in row["reason"] and row["limits"] == text
    log = [r for r in d.db.decisions(jid) if r["action"] == "resize"]
    assert log and log[-1]["reason"].startswith(f"out of memory at local batch {first.local_batch} on t4")
    d.close()
    d = daemon()  # a daemon restart keeps what was learned
    assert d.models.oom.of(jid) == (("t4", first.local_batch - 1),)
    for _ in range(40):  # never tried again: every later decision stays below
        d.cycle()
        sim.advance_to(sim.now + 30)
        dec = decision()
        assert dec is None or dec.local_batch < first.local_batch
    d.close()


# ---------------------------------------------------------------- in the job (train/oom.py)
def test_out_of_memory_errors_are_recognised():
    torch = pytest.importorskip("torch")
    from slurm_elastic.train.oom import is_out_of_memory

    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("x"))
    assert is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert not is_out_of_memory(RuntimeError("CUDA error: an illegal memory access"))
    assert not is_out_of_memory(MemoryError())  # host memory: not a GPU batch limit
    assert not is_out_of_memory(ValueError("out of memory"))


class _FakeJob:
    def __init__(self, tmp_path, *, source="decision", local=64, least=1, job_id="7"):
        from types import SimpleNamespace

        from slurm_elastic.train.assignment import Assignment

        self.assignment = Assignment(256, local, 1, 4, source, 3)
        self.senv = SimpleNamespace(job_id=job_id, restart_count=2)
        self.ckpt_dir = tmp_path
        self.rank, self.world_size, self.min_local_batch = 1, 4, least
        self.said = []

    def log(self, msg, all_ranks=False):
        self.said.append(msg)


def test_handle_writes_the_report_and_the_ack_the_daemon_reads(tmp_path, monkeypatch):
    from slurm_elastic.daemon.acks import CheckpointDirAck
    from slurm_elastic.train import oom

    job = _FakeJob(tmp_path)
    monkeypatch.setattr(oom, "_current", job)
    assert oom.handle(RuntimeError("CUDA out of memory. Tried to allocate 1 GiB"))
    data = json.loads(oom_path(tmp_path, 7, 2).read_text())
    assert parse_oom(data, 7, 2) == {"local_batch": 64, "accum": 1, "world_size": 4, "global_batch": 256}
    rec, spec, _ = _job(tmp_path)
    rec = JobRecord(**{**rec.__dict__, "comment": SPEC + f",ckpt_dir={tmp_path}"})
    assert CheckpointDirAck(lambda: {7: rec}).checkpoint_acked(7)  # the enactor goes straight to the requeue
    book = OomBook()
    book.observe(rec, parse_spec(rec.comment), str(tmp_path), "t4")
    assert book.of(7) == (("t4", 63),)
    assert not oom.handle(ValueError("x"))  # not an out-of-memory error: the task fails as before


@pytest.mark.parametrize("kw,why", [({"source": "spec"}, "without a daemon decision"),
                                    ({"local": 16, "least": 16}, "smallest the spec allows"),
                                    ({"job_id": None}, "without a daemon decision")])
def test_handle_leaves_an_unlearnable_out_of_memory_error_to_fail(tmp_path, monkeypatch, kw, why):
    from slurm_elastic.train import oom

    job = _FakeJob(tmp_path, **kw)
    monkeypatch.setattr(oom, "_current", job)
    assert not oom.handle(RuntimeError("CUDA out of memory."))
    assert not list(tmp_path.iterdir()) and why in job.said[0]
    monkeypatch.setattr(oom, "_current", None)
    assert not oom.handle(RuntimeError("CUDA out of memory."))


def test_an_uncaught_out_of_memory_error_exits_75_through_the_hook_and_others_fail_as_before(tmp_path):
    """What a script started by any launcher does: the hook ElasticJob installs turns an uncaught
    out-of-memory error into the report, the ack and exit 75; any other error keeps Python's exit 1."""
    import subprocess
    import sys

    script = tmp_path / "s.py"
    script.write_text(f"""
import sys
from pathlib import Path
from types import SimpleNamespace
from slurm_elastic.train import oom
from slurm_elastic.train.assignment import Assignment
job = SimpleNamespace(assignment=Assignment(256, 64, 1, 4, "decision", 3),
                      senv=SimpleNamespace(job_id="7", restart_count=2), ckpt_dir=Path({str(tmp_path)!r}),
                      rank=0, world_size=4, min_local_batch=1, log=lambda msg, all_ranks=False: print(msg))
oom.register(job)
raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB" if sys.argv[1] == "oom" else "boom")
""")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, str(script), "other"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 1 and "boom" in r.stderr and not oom_path(tmp_path, 7, 2).exists()
    r = subprocess.run([sys.executable, str(script), "oom"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 75, r.stderr
    assert "out of memory at local batch 64" in r.stdout
    assert parse_oom(json.loads(oom_path(tmp_path, 7, 2).read_text()), 7, 2)["local_batch"] == 64
    assert (tmp_path / "stop-ack.7.2.json").exists()


def test_a_job_that_ended_is_no_longer_the_one_reported_for(tmp_path, monkeypatch):
    from slurm_elastic.train import oom

    job = _FakeJob(tmp_path)
    monkeypatch.setattr(oom, "_current", job)
    oom.unregister(object())  # another job: no change
    assert oom._current is job
    oom.unregister(job)
    assert not oom.handle(RuntimeError("CUDA out of memory.")) and not list(tmp_path.iterdir())


def test_a_frozen_job_whose_limit_rules_out_its_count_gets_the_fewest_gpus_that_fit_not_a_free_choice():
    # Running on 1 GPU at 1 x 64, in its cooldown (frozen), when a (possibly forged) out-of-memory report
    # caps its local batch at 63: 1 GPU cannot do batch 64 without accumulation. Found live
    # (tests/faults/test_user_files.py): the policy then chose freely and grew it 1 -> 4 GPUs past its
    # cooldown while its honest twin stayed at 1. It gets the fewest counts that fit (2), as if kept.
    from slurm_elastic.policies import AllocationProblem, get_policy
    from tests.unit.test_policies import job, spec

    capped = spec(min_gpus=1, max_gpus=4, min_batch=64, max_batch=256, max_local=63, batch=64)
    for name in ("dp", "pollux-dp", "sia"):
        frozen = job(0, capped, running=1, batch=64, held_s=5.0, frozen=True)
        a = get_policy(name).allocate(AllocationProblem(8, 4, (frozen,)))
        assert a.jobs[0].gpus == 2 and a.jobs[0].batch <= 2 * 63, (name, a.jobs[0])
        # out of its cooldown the policy chooses freely (here: more)
        free = job(0, capped, running=1, batch=64, held_s=1e5)
        assert get_policy(name).allocate(AllocationProblem(8, 4, (free,))).jobs[0].gpus > 2, name


def test_the_restart_after_out_of_memory_gets_at_most_the_gpus_it_had_or_the_fewest_that_fit(tmp_path):
    # Found live (tests/faults/test_user_files.py): a job in cooldown at 1 GPU whose claim leaves no batch
    # on 1 GPU was requeued and re-admitted on every free GPU, which its twin in cooldown could not take.
    from dataclasses import replace

    narrow = "elastic:min_gpus=1,max_gpus=8,min_batch=256,max_batch=1024,max_local_batch=128,batch=256"
    job, spec, ckpt = _job(tmp_path, spec=narrow)  # 4 x 64: below 64, 4 GPUs cannot run batch 256
    book = OomBook()
    book.observe(job, spec, ckpt, "t4", 4)
    _write(ckpt)
    book.observe(job, spec, ckpt, "t4", 4)
    assert book.of(7) == (("t4", 63),)
    assert book.most_gpus(job) == 8  # 5..7 GPUs are not a shape 4-GPU nodes allow; 8 x 32 is
    requeued = replace(job, state="PENDING", restart_count=3)
    assert book.most_gpus(requeued) == 8  # pending for its next start: still bounded
    assert book.most_gpus(replace(job, restart_count=3)) is None  # its next start runs: no bound any more
    assert book.most_gpus(requeued) is None and 7 not in book.most
    # where a batch still fits on its GPUs (accumulation), the bound is the GPUs it had
    (tmp_path / "b").mkdir()
    job2, spec2, ckpt2 = _job(tmp_path / "b", spec=narrow + ",max_accum=2")
    book2 = OomBook()
    _write(ckpt2)
    book2.observe(job2, spec2, ckpt2, "t4", 4)
    assert book2.of(7) == (("t4", 63),) and book2.most_gpus(job2) == 4
    book2.forget(set())
    assert not book2.most


def test_the_daemon_caps_a_restarting_job_at_what_its_book_allows():
    from slurm_elastic.daemon.caps import CappedPolicy
    from slurm_elastic.policies import AllocationProblem, get_policy
    from tests.unit.test_policies import job, spec

    s = spec(min_gpus=1, max_gpus=8, batch=64)
    p = AllocationProblem(8, 4, (job(0, s),))
    capped = CappedPolicy(get_policy("dp"))
    assert capped.allocate(p).jobs[0].gpus > 2
    capped.limit = {0: 2}
    assert capped.allocate(p).jobs[0].gpus == 2
