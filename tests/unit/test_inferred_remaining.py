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
    assert h2.remaining_gpu_s("", "ncf", 0.0) == pytest.approx(25.0)  # the last 2 ended (20, 30) kept


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
