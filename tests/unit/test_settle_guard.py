"""Issue 23 follow-up: a job that never reports a step holds the GPUs work-conserving admission gave it
only about as long as an honest start of it takes (planner.settle_s: 4 x its restart cost, within
[60 s, settle_timeout_s]), not settle_timeout_s (900 s) while another job waits."""

from __future__ import annotations

import os

import pytest

from slurm_elastic import planner as pl
from slurm_elastic.backends.base import JobRecord, NodeRecord
from slurm_elastic.daemon.models import ModelRegistry
from slurm_elastic.policies import get_policy
from slurm_elastic.problem import build_problem
from slurm_elastic.spec import Decision

SPEC = "elastic:min_gpus=1,max_gpus=8,min_batch=32,max_batch=512,max_local_batch=64,batch=64"


@pytest.mark.parametrize("restart_s,settle", [(None, 900.0), (1.0, 60.0), (10.0, 60.0), (45.0, 180.0),
                                              (120.0, 480.0), (250.0, 900.0), (600.0, 900.0)])
def test_the_guard_scales_with_the_restart_cost_within_bounds(restart_s, settle):
    v = pl.JobView(1, pl.RUNNING, 4, 64, stepped=False, restart_s=restart_s)
    assert pl.settle_s(v, pl.PlannerConfig()) == settle


def _cluster(tmp_path, a_spec):
    ckpt = tmp_path / "a"
    ckpt.mkdir()
    d = Decision(gpus=8, nodes=2, batch=64, local_batch=8, seq=1)
    a = JobRecord(job_id=1, name="a", user="mallory", partition="gpu", state="RUNNING", gpus_per_node=4, gpus_total=8,
                  node_count=2, nodes=("n1", "n2"), comment=f"{a_spec},ckpt_dir={ckpt}", admin_comment=d.to_admin_comment(),
                  user_id=os.getuid(), submit_time=0.0)
    b = JobRecord(job_id=2, name="b", user="bob", partition="gpu", state="PENDING", comment=SPEC.replace("max_gpus=8",
                  "max_gpus=4,gpus=4"), held=True, priority=0, submit_time=10.0)
    nodes = [NodeRecord(n, "ALLOCATED", (), 4, 4, 8, ("gpu",)) for n in ("n1", "n2")]
    return [a, b], nodes


@pytest.mark.parametrize("a_spec,held_until", [(SPEC, 180.0), (SPEC + ",restart_s=30", 120.0),
                                               (SPEC + ",restart_s=5000", 900.0)])
def test_a_silent_job_on_every_gpu_is_shrunk_for_a_waiting_job_after_its_settle_time(tmp_path, a_spec, held_until):
    """A (never reports: no first step in its report dir) was admitted on all 8 GPUs at t=0; B (asks for 4)
    waits from t=10. A is held by the guard until 4 x its restart cost (default 45 s, or its spec's), at
    most 900 s; then the policy's shrink goes ahead and B starts."""
    jobs, nodes = _cluster(tmp_path, a_spec)
    reg = ModelRegistry(node_size=4)
    books = {1: pl.JobBook(last_change_s=0.0, seq=1)}

    def cycle(now):
        snap = build_problem(jobs, nodes, model_for=reg, now=now, default_restart_s=45.0)
        assert snap.views[0].stepped is False  # it shows nothing
        alloc = get_policy("dp").allocate(snap.problem)
        assert alloc.jobs[1].gpus < 8 and alloc.jobs[2].gpus > 0, alloc  # the policy wants room for B
        plan = pl.plan(alloc, snap.views, books, now, capacity=snap.capacity, node_size=4,
                       config=pl.PlannerConfig(cooldown_s=60.0))  # the rescale cooldown stays the minimum dwell
        return {x.job_id: x for x in plan.actions}

    before = cycle(held_until - 1)
    assert before[1].kind == "leave" and "no step reported" in before[1].reason, before
    assert f"held up to {held_until:.0f} s" in before[1].reason
    assert before[2].kind == "leave"  # B waits, for no longer than that
    after = cycle(held_until + 1)
    assert after[1].kind == "resize" and after[1].gpus < 8 and after[2].kind == "start", after
