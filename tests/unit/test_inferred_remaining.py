"""Remaining work inferred from ended jobs of the same model, for jobs that report none (issue 23 item 7)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from slurm_elastic.policies import AllocationProblem, get_policy
from slurm_elastic.policies._sizes import SizeHistory
from tests.unit.test_policies import job, spec


def _run(i, model, gpu_s):
    return job(i, spec(max_gpus=4, batch=64, profile=model), running=1, batch=64, attained_gpu_s=gpu_s, held_s=1e5)


def test_mean_residual_life_of_ended_jobs_of_the_model():
    h = SizeHistory()
    h.observe([_run(1, "cifar10", 100.0), _run(2, "cifar10", 300.0), _run(3, "imagenet", 9e4)])
    assert h.remaining_gpu_s("", "cifar10", 0.0) is None  # nothing ended yet
    h.observe([_run(3, "imagenet", 9.5e4)])  # 1 and 2 ended at the GPU-seconds last seen
    assert h.remaining_gpu_s("", "cifar10", 50.0) == pytest.approx(150.0)  # mean(100, 300) - 50
    assert h.remaining_gpu_s("", "cifar10", 200.0) == pytest.approx(100.0)  # only 300 is larger
    assert h.remaining_gpu_s("", "cifar10", 400.0) is None  # outlived every ended one: no estimate (LAS then)
    assert h.remaining_gpu_s("", "imagenet", 10.0) is None and h.remaining_gpu_s("", None, 10.0) is None
    # pooled: a model with no ended job falls back to every model's
    p = SizeHistory(pooled=True)
    p.observe([_run(1, "cifar10", 100.0)])
    p.observe([])
    assert p.remaining_gpu_s("", "bert", 40.0) == pytest.approx(60.0)


def test_one_users_ended_jobs_inform_only_that_users_jobs():
    """A user who names a model another user ran short jobs of gets no estimate from them: the history
    is per user (a forging job gains nothing over an honest twin that names no model)."""
    h = SizeHistory(pooled=True)
    h.observe([replace(_run(1, "cifar10", 100.0), user="alice"), replace(_run(2, "cifar10", 300.0), user="alice")])
    h.observe([])
    assert h.remaining_gpu_s("alice", "cifar10", 50.0) == pytest.approx(150.0)
    assert h.remaining_gpu_s("mallory", "cifar10", 50.0) is None
    assert h.remaining_gpu_s("mallory", "bert", 50.0) is None  # pooled is per user too
    assert h.remaining_gpu_s("alice", "bert", 50.0) == pytest.approx(150.0)


def test_a_job_left_out_of_one_call_is_not_an_ended_one():
    h = SizeHistory()
    h.observe([_run(1, "cifar10", 100.0), _run(2, "cifar10", 50.0)])
    h.observe([_run(2, "cifar10", 60.0)])  # 1 left out (e.g. a per-user cap's re-solve)
    assert h.remaining_gpu_s("", "cifar10", 0.0) == pytest.approx(100.0)
    h.observe([_run(1, "cifar10", 110.0), _run(2, "cifar10", 70.0)])  # back: it had not ended
    assert h.remaining_gpu_s("", "cifar10", 0.0) is None
    h2 = SizeHistory(keep=2)
    for i in range(4):
        h2.observe([_run(i, "ncf", 10.0 * (i + 1))])
    # the last 2 ended (20, 30) kept, and job 3 runs at 40 (a size of at least 40): Kaplan-Meier
    # 20 x 1 + 10 x 2/3 + 10 x 1/3 = 30 (25 from the ended two alone)
    assert h2.remaining_gpu_s("", "ncf", 0.0) == pytest.approx(30.0)


def test_running_jobs_of_the_model_count_as_sizes_at_least_their_service():
    """The first jobs of a model to end are its short ones: estimated from them alone, a new job of a
    model whose long jobs are still running looks short. Those jobs count, right-censored at the
    GPU-seconds they have had (Kaplan-Meier); with none running the estimate is the plain mean residual
    life of the ended sizes."""
    h = SizeHistory()
    h.observe([_run(1, "bert", 100.0), _run(2, "bert", 900.0), _run(3, "bert", 900.0)])
    h.observe([_run(2, "bert", 1000.0), _run(3, "bert", 1000.0)])  # 1 ended at 100; 2 and 3 run on
    # S = 2/3 from 100 up to 1000 (the largest observation): 100 + 900 x 2/3 = 700 (100 from job 1 alone)
    assert h.remaining_gpu_s("", "bert", 0.0) == pytest.approx(700.0)
    assert h.remaining_gpu_s("", "bert", 50.0) == pytest.approx(650.0)  # 50 + 900 x 2/3
    assert h.remaining_gpu_s("", "bert", 400.0) is None  # past every ended size: ranked by its service
    h.observe([_run(3, "bert", 1100.0)])  # 2 ended at 1000
    # ended 100, 1000; 3 at >= 1100: S = 2/3 on [100, 1000), 1/3 on [1000, 1100]
    assert h.remaining_gpu_s("", "bert", 0.0) == pytest.approx(100 + 900 * 2 / 3 + 100 / 3)
    assert h.remaining_gpu_s("", "bert", 1000.0) is None  # outlived every ended one: no estimate (LAS then)
    h.observe([])  # 3 ended at 1100: every size seen, the plain mean
    assert h.remaining_gpu_s("", "bert", 0.0) == pytest.approx((100 + 1000 + 1100) / 3)
    # another user's running jobs are not this user's sizes (the history and its censoring are per user)
    h.observe([replace(_run(4, "bert", 5e4), user="bob")])
    assert h.remaining_gpu_s("", "bert", 0.0) == pytest.approx((100 + 1000 + 1100) / 3)


def test_dp_ranks_jobs_that_report_nothing_by_what_their_models_ran():
    pol = get_policy("dp")
    first = AllocationProblem(8, 4, (_run(1, "cifar10", 200.0), _run(2, "imagenet", 4e5)))
    pol.allocate(first)
    short, long_ = _run(3, "cifar10", 20.0), _run(4, "imagenet", 20.0)
    second = AllocationProblem(8, 4, (long_, short))  # both ended; two new jobs, no one reports work left
    assert pol.objective_for(second) == "pnorm"  # before the history has them: the p-norm fallback
    pol.allocate(AllocationProblem(8, 4, (_run(5, "bert", 10.0),)))  # 1 and 2 gone: ended
    assert pol.objective_for(second) == "completion"
    c = pol.candidates(second)
    assert c.values[c.offsets[1]] > c.values[c.offsets[0]]  # the cifar10 job ranks first
    # fewer than half report: ranks need 3/4 with the inferred ones (an inferred size is an estimate)
    told = replace(_run(6, "bert", 10.0), remaining_samples=1e5)
    four = AllocationProblem(8, 4, (long_, told, _run(7, "bert", 10.0), _run(8, "bert", 10.0)))
    assert pol._known(four) == (1, 1) and pol.objective_for(four) == "pnorm"  # 2 of 4 known, 1 reported
    assert pol.objective_for(AllocationProblem(8, 4, (long_, short, told, _run(7, "bert", 10.0)))) == "completion"
    off = get_policy("dp", infer=0)
    off.allocate(first)
    off.allocate(AllocationProblem(8, 4, (_run(5, "bert", 10.0),)))
    assert off.objective_for(second) == "pnorm"
    with pytest.raises(ValueError, match="infer"):
        get_policy("dp", infer="sometimes")
    # a job that reports its work left is ranked by that, not by its model's history
    told = replace(short, remaining_samples=1e9)
    c = pol.candidates(AllocationProblem(8, 4, (long_, told)))
    assert c.values[c.offsets[0]] > c.values[c.offsets[1]]


def test_the_history_survives_a_daemon_restart_through_json_and_junk_is_dropped():
    import json

    from slurm_elastic.policies import _sizes

    h = SizeHistory()
    h.observe([replace(_run(1, "cifar10", 100.0), user="alice"), _run(2, "cifar10", 300.0), _run(3, "bert", 50.0)])
    h.observe([_run(3, "bert", 60.0)])
    back = SizeHistory.from_json(json.loads(json.dumps(h.to_json())))
    assert back.remaining_gpu_s("alice", "cifar10", 50.0) == pytest.approx(50.0)
    assert back.remaining_gpu_s("", "cifar10", 50.0) == pytest.approx(250.0)
    back.observe([])  # job 3, seen before the restart and gone after it, ended at what it had
    assert back.remaining_gpu_s("", "bert", 10.0) == pytest.approx(50.0)
    junk = {"ended": [["u", "m", [[1, float("nan")], [2, -5], [3, True], ["x", 7.0]]], ["u", 5, []], "no",
                      ["v", "m", [[4, float("inf")]]]],
            "seen": [[9, "u", "m", "big"], [True, "u", "m", 3.0]]}
    j = SizeHistory.from_json(junk)
    assert len(j) == 1 and j.remaining_gpu_s("u", "m", 0.0) == pytest.approx(7.0) and not j._seen
    assert len(SizeHistory.from_json("garbage")) == 0 and len(SizeHistory.from_json(None)) == 0
    # bounded: the (user, model) keys a user's model names can make
    old = _sizes.MAX_KEYS
    try:
        _sizes.MAX_KEYS = 3
        m = SizeHistory()
        for i in range(5):
            m.observe([_run(i, f"model{i}", 10.0)])
        m.observe([])
        assert len(m._ended) == 3 and m.remaining_gpu_s("", "model4", 0.0) == pytest.approx(10.0)
    finally:
        _sizes.MAX_KEYS = old


def test_the_daemon_keeps_what_ended_jobs_ran_across_a_restart(tmp_path):
    """A job of a model ends; the daemon restarts; a job of that model that reports nothing is still
    ranked by what the ended one ran (before, the restarted daemon knew nothing until another ended)."""
    from slurm_elastic.backends.simulated import SimulatedSlurm
    from slurm_elastic.daemon.config import config_from_dict
    from slurm_elastic.daemon.loop import Daemon
    from slurm_elastic.profiles import load_profile
    from slurm_elastic.spec import ElasticSpec

    sim = SimulatedSlurm(groups=[(1, 4, "gpu", "t4")], checkpoint_s=5, restart_s=10)
    sim.advance_to(1000.0)  # Slurm shows no start time 0
    comment = ElasticSpec(1, 4, 64, 512, 128, profile="cifar10").to_comment()
    sim.submit(name="short", gpus_per_node=1, comment=comment, total_samples=3e6, model=load_profile("cifar10"))
    cfg = config_from_dict({"state_dir": str(tmp_path / "state"), "metrics_address": "", "cooldown_s": 0,
                            "restart_cost_s": 5})

    def daemon():
        d = Daemon(cfg, backend=sim, ack=sim, clock=lambda: sim.now)
        d.open()
        return d

    d = daemon()
    for _ in range(200):
        d.cycle()
        sim.advance_to(sim.now + 30)
        if not sim.list_jobs():
            break
    # the policy sees the job gone at its next allocation: the next job's
    sim.submit(name="next", gpus_per_node=1, comment=comment.replace("cifar10", "ncf"), total_samples=3e9,
               model=load_profile("ncf"))
    d.cycle()
    ran = d.policy.inner.sizes.remaining_gpu_s("user", "cifar10", 0.0)
    assert ran is not None and ran > 0, "the job did not end in the simulated time"
    d.close()
    d = daemon()
    assert d.policy.inner.sizes.remaining_gpu_s("user", "cifar10", 0.0) == pytest.approx(ran)
    d.close()


def test_one_user_naming_many_models_evicts_only_their_own_history():
    """Model names are the users': a user who names thousands of models (each ended job a new key) must not
    push another user's history out of the bounded table; their own oldest models go instead."""
    from slurm_elastic.policies import _sizes

    h = SizeHistory()
    h.observe([replace(_run(1, "bert", 500.0), user="bob")])
    h.observe([])  # bob's bert job ended at 500 GPU-s
    many = _sizes.MAX_KEYS_PER_USER * 3
    for i in range(many):
        h.observe([replace(_run(100 + i, f"m{i}", 10.0), user="mallory")])
    h.observe([])
    mallory = [k for k in h._ended if k[0] == "mallory"]
    assert len(mallory) == _sizes.MAX_KEYS_PER_USER
    assert ("mallory", _sizes.ALL) in h._ended  # the every-model key is never the one dropped
    assert h.remaining_gpu_s("mallory", f"m{many - 1}", 0.0) == pytest.approx(10.0)  # the newest kept
    assert h.remaining_gpu_s("mallory", "m0", 0.0) is None  # the oldest went
    assert h.remaining_gpu_s("bob", "bert", 100.0) == pytest.approx(400.0)
    back = SizeHistory.from_json(h.to_json())  # the bound holds for a restored table too
    assert len([k for k in back._ended if k[0] == "mallory"]) <= _sizes.MAX_KEYS_PER_USER
    assert back.remaining_gpu_s("bob", "bert", 100.0) == pytest.approx(400.0)


def test_the_daemon_saves_what_it_learned_at_most_every_few_minutes_and_at_close(tmp_path):
    """The learned history can be megabytes at a large site: it is written at most every LEARNED_SAVE_S of
    the daemon's clock (and at close), not every poll; a crash loses at most that long of learning."""
    from slurm_elastic.backends.simulated import SimulatedSlurm
    from slurm_elastic.daemon import loop
    from slurm_elastic.daemon.config import config_from_dict
    from slurm_elastic.profiles import load_profile
    from slurm_elastic.spec import ElasticSpec

    sim = SimulatedSlurm(groups=[(1, 4, "gpu", "t4")], checkpoint_s=5, restart_s=10)
    sim.advance_to(1000.0)
    comment = ElasticSpec(1, 4, 64, 512, 128, profile="cifar10").to_comment()
    sim.submit(name="long", gpus_per_node=1, comment=comment, total_samples=3e9, model=load_profile("cifar10"))
    cfg = config_from_dict({"state_dir": str(tmp_path / "state"), "metrics_address": "", "cooldown_s": 0,
                            "restart_cost_s": 5})
    d = loop.Daemon(cfg, backend=sim, ack=sim, clock=lambda: sim.now)
    d.open()
    writes = []
    real = d.db.set_meta
    d.db.set_meta = lambda k, v: (writes.append((sim.now, k)) if k == "policy_learned" else None, real(k, v))[1]
    start = sim.now
    while sim.now < start + 3 * loop.LEARNED_SAVE_S:
        d.cycle()
        sim.advance_to(sim.now + 30)
    at = [t for t, _ in writes]
    assert at and len(at) <= 4, at  # the job's attained service changes every cycle: not a write each
    assert all(b - a >= loop.LEARNED_SAVE_S for a, b in zip(at, at[1:], strict=False))
    d.close()
    assert len(writes) == len(at) + 1  # and once more at close, with the latest
    from slurm_elastic.daemon.state import StateDB

    db = StateDB(cfg.state_dir)
    seen = db.get_meta("policy_learned", {})["state"]["sizes"]["seen"]
    db.close()
    assert [row[2] for row in seen] == ["cifar10"] and seen[0][3] > 0
