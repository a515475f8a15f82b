"""sim/checks.py: what a cycle left undone, on clusters of one pool and of several (GPU types).

A job runs on one GPU type, so idle GPUs of two pools never add up to a place for it: the checks
count a pending job as waiting beside idle GPUs, and a running job as held at a wrong size, only where
one pool it may use holds what it needs (a grow in its own pool; a move to another, by its model there).
"""

from __future__ import annotations

from types import SimpleNamespace

from sim_helpers import LinearModel, toy_spec

from slurm_elastic.planner import PENDING, RUNNING, JobView, Leave, Plan
from slurm_elastic.policies.base import AllocationProblem, JobRequest, Pool
from slurm_elastic.sim import checks

POOLS = (Pool("gpu:a", "a", ("gpu",), (("a0", 4),), 4), Pool("gpu:b", "b", ("gpu",), (("b0", 4),), 4))


def _res(free, jobs, views, pools=POOLS):
    problem = AllocationProblem(total_gpus=8, node_size=4, jobs=tuple(jobs), pools=pools)
    snap = SimpleNamespace(node_free=dict(free), node_size=4, views=list(views), capacity=8, problem=problem)
    acts = tuple(Leave(v.job_id) for v in views if v.status == RUNNING)
    return SimpleNamespace(snapshot=snap, plan=Plan(acts, committed_gpus=8 - sum(free.values())))


def _running(job_id, node, model, pool_models=(), max_gpus=8, pool="gpu:a"):
    spec = toy_spec(min_gpus=1, max_gpus=max_gpus, batch=32)
    req = JobRequest(job_id, spec, model, running_gpus=4, running_batch=32, nodes=(node,), gpus_per_node=4,
                     pool=pool, pools=("gpu:a", "gpu:b"), pool_models=pool_models)
    view = JobView(job_id, RUNNING, gpus=4, batch=32, spec=spec, nodes=(node,), gpus_per_node=4, restart_s=30.0)
    return req, view


def _pending(job_id, min_gpus):
    spec = toy_spec(min_gpus=min_gpus, max_gpus=8, batch=48)
    return JobRequest(job_id, spec, LinearModel()), JobView(job_id, PENDING, spec=spec)


def life(job_id, rate):
    return 1e6


def test_grow_across_two_types_is_not_a_wrong_size():
    """Its own pool full, the other idle, the same speed there: moving to 4 GPUs there gains nothing, and
    4 + 4 over both types is no place for it."""
    req, view = _running(1, "a0", LinearModel(100.0))
    assert checks.held_wrong(_res({"a0": 0, "b0": 4}, [req], [view]), life) == []
    # one pool holding both nodes: the same map is a grow to 8, and that is a wrong size
    one = (Pool("gpu", "", ("gpu",), (("a0", 4), ("b0", 4)), 4),)
    req1 = JobRequest(1, req.spec, req.model, running_gpus=4, running_batch=32, nodes=("a0",), gpus_per_node=4,
                      pool="gpu", pools=("gpu",))
    assert checks.held_wrong(_res({"a0": 0, "b0": 4}, [req1], [view], pools=one), life) == [1]


def test_move_to_a_faster_idle_type_is_a_wrong_size_to_hold():
    """The idle pool runs it three times faster by its own model there: held, that is a wrong size."""
    req, view = _running(1, "a0", LinearModel(100.0), pool_models=(("gpu:b", LinearModel(300.0)),))
    assert checks.held_wrong(_res({"a0": 0, "b0": 4}, [req], [view]), life) == [1]
    # ... unless its true remaining life is too short for the restart to pay (twice over)
    assert checks.held_wrong(_res({"a0": 0, "b0": 4}, [req], [view]), lambda j, r: 50.0) == []


def test_grow_in_its_own_pool_is_counted():
    req, view = _running(1, "a0", LinearModel(100.0))
    pools = (Pool("gpu:a", "a", ("gpu",), (("a0", 4), ("a1", 4)), 4), Pool("gpu:b", "b", ("gpu",), (("b0", 4),), 4))
    res = _res({"a0": 0, "a1": 4, "b0": 0}, [req], [view], pools=pools)
    res.snapshot.capacity = 12
    assert checks.held_wrong(res, life) == [1]


def test_pending_job_waits_beside_idle_gpus_only_where_one_pool_fits_it():
    """4 idle GPUs in each type: a job needing 8 fits in neither (not counted); one needing 4 fits in
    either (counted)."""
    free = {"a0": 4, "b0": 4}
    big = _pending(7, 8)
    assert checks.idle_waiting(_res(free, [big[0]], [big[1]])) == []
    small = _pending(8, 4)
    assert checks.idle_waiting(_res(free, [small[0]], [small[1]])) == [8]
    # on one pool of both nodes the 8 place as 4 + 4: counted
    one = (Pool("gpu", "", ("gpu",), (("a0", 4), ("b0", 4)), 4),)
    assert checks.idle_waiting(_res(free, [big[0]], [big[1]], pools=one)) == [7]
