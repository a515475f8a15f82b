"""The multi-pool optimizer (policies/_multipool.py) against HiGHS on small random instances of the same
problem Q (every (job, pool, choice) a binary; one per job; pool capacities), and its dispatch."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
from sim_helpers import LinearModel, toy_spec

from slurm_elastic.policies._multipool import REQUIRED, allocate_pools, build_q, lagrangian
from slurm_elastic.policies.base import AllocationProblem, JobRequest, Pool
from slurm_elastic.policies.dp import DPPolicy
from slurm_elastic.profiles.gavel import gavel_model

scipy = pytest.importorskip("scipy")

MODELS = [gavel_model("v100", "ResNet-50"), gavel_model("k80", "ResNet-50"), gavel_model("p100", "LM"),
          LinearModel(50.0), LinearModel(120.0)]


def q_milp(q):
    """Q's optimum by HiGHS."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csr_matrix

    n = q.job.size
    if n == 0:
        return 0.0
    jobs = np.unique(q.job)
    row = np.searchsorted(jobs, q.job)
    one = csr_matrix((np.ones(n), (row, np.arange(n))), shape=(jobs.size, n))
    cap = csr_matrix((q.weight.astype(float), (q.pool, np.arange(n))), shape=(q.capacity.size, n))
    res = milp(-q.value, constraints=[LinearConstraint(one, 1, 1), LinearConstraint(cap, -np.inf, q.capacity)],
               integrality=np.ones(n), bounds=Bounds(0, 1), options={"mip_rel_gap": 1e-9})
    assert res.status == 0, res.message
    return -float(res.fun)


def instance(rng: random.Random):
    n_pools = rng.randint(2, 3)
    pools = []
    for i in range(n_pools):
        size = rng.choice([2, 4])
        caps = tuple((f"p{i}n{k}", size) for k in range(rng.randint(1, 3)))
        pools.append(Pool(f"p{i}", ("k80", "p100", "v100")[i], (f"part{i}",), caps, size))
    jobs = []
    used = {p.name: 0 for p in pools}
    for j in range(rng.randint(2, 7)):
        spec = toy_spec(min_gpus=rng.choice([1, 1, 2]), max_gpus=rng.choice([2, 4, 8]), batch=64)
        spec = replace(spec, min_batch=32, max_batch=256, max_local_batch=128, weight=rng.choice([1.0, 2.0]))
        allowed = tuple(p.name for p in pools if rng.random() < 0.7) or (pools[0].name,)
        model = rng.choice(MODELS)
        pm = tuple((p.name, gavel_model(p.gpu_type, model.model)) for p in pools
                   if hasattr(model, "model") and p.name in allowed)
        req = JobRequest(j, spec, model, wait_s=rng.choice([0.0, 10.0]), pools=allowed, pool_models=pm)
        p = next(p for p in pools if p.name == allowed[0])
        if rng.random() < 0.3 and used[p.name] + spec.min_gpus <= p.total_gpus:
            g = spec.min_gpus
            used[p.name] += g
            req = replace(req, running_gpus=g, running_batch=64, pool=p.name, pools=(p.name,))
        jobs.append(req)
    return AllocationProblem(sum(p.total_gpus for p in pools), 4, tuple(jobs), pools=tuple(pools))


@pytest.mark.parametrize("objective", ["completion", "throughput", "goodput"])
def test_agrees_with_highs_on_small_random_instances(objective):
    rng = random.Random(13)
    gaps = []
    for _ in range(25):
        prob = instance(rng)
        pol = DPPolicy(admission="priority", objective=objective, placement=False, unranked="las")
        value = DPPolicy.OBJECTIVES[objective][0]
        joint = DPPolicy(admission="joint", starvation_s=float("inf"), objective=objective, unranked="las")
        q = build_q(prob, joint.candidates, objective=value)
        opt = q_milp(q)
        a = pol.allocate(prob)
        assert a.objective == pytest.approx(opt, rel=1e-9, abs=1e-9)  # enumerated: exact
        assert sum(x.gpus for x in a.jobs.values()) <= prob.total_gpus
        for x in a.jobs.values():  # every job within its pools and their capacities
            if x.gpus:
                req = next(r for r in prob.jobs if r.job_id == x.job_id)
                assert x.pool in (req.pools or [p.name for p in prob.pools])
        for p in prob.pools:
            assert sum(x.gpus for x in a.jobs.values() if x.pool == p.name) <= p.total_gpus
        # the Lagrangian path alone: a valid bound above, a feasible answer below
        b = allocate_pools(prob, joint.candidates, objective=value, placement=False, enumerate_limit=0)
        assert b.bound >= opt - 1e-9 >= b.objective - 2e-9
        L, _, _ = lagrangian(q)
        assert L >= opt - 1e-9
        gaps.append((b.bound - b.objective) / max(abs(opt), 1e-9))
    print(f"{objective}: Lagrangian-path relative gap bound median {np.median(gaps):.3%}, max {max(gaps):.3%}")


def test_required_jobs_get_their_minimum_in_some_pool():
    rng = random.Random(5)
    for _ in range(20):
        prob = instance(rng)
        joint = DPPolicy(admission="joint", starvation_s=float("inf"))
        q = build_q(prob, joint.candidates)
        a = DPPolicy(admission="priority", placement=False).allocate(prob)
        b = allocate_pools(prob, joint.candidates, placement=False, enumerate_limit=0)  # the prices' path
        for j, req in enumerate(prob.jobs):
            if q.standing[j] == REQUIRED:
                assert a.jobs[req.job_id].gpus >= req.spec.min_gpus, a.jobs[req.job_id]
                assert b.jobs[req.job_id].gpus >= req.spec.min_gpus, b.jobs[req.job_id]
        for p in prob.pools:
            assert sum(x.gpus for x in b.jobs.values() if x.pool == p.name) <= p.total_gpus


def test_faster_type_is_chosen_and_unscaled_jobs_say_so():
    v, k = gavel_model("v100", "ResNet-50"), gavel_model("k80", "ResNet-50")
    pools = (Pool("slow", "k80", ("a",), (("s1", 4),), 4), Pool("fast", "v100", ("b",), (("f1", 4),), 4))
    spec = replace(toy_spec(min_gpus=1, max_gpus=4, batch=64), min_batch=32, max_batch=256, max_local_batch=128)
    typed = JobRequest(1, spec, k, pools=("slow", "fast"), pool_models=(("fast", v),))
    plain = JobRequest(2, spec, LinearModel(), pools=("slow",), unscaled_pools=("slow",))
    a = DPPolicy().allocate(AllocationProblem(8, 4, (typed, plain), pools=pools))
    assert a.jobs[1].pool == "fast" and a.jobs[2].pool == "slow"
    assert "its model unscaled" in a.jobs[2].reason and a.bound is not None


def test_single_pool_problem_is_unchanged():
    spec = toy_spec(max_gpus=4, batch=8)
    jobs = (JobRequest(1, spec, LinearModel()), JobRequest(2, spec, LinearModel()))
    one = DPPolicy().allocate(AllocationProblem(8, 4, jobs))
    assert one.bound is None and all(x.pool == "" for x in one.jobs.values())


def test_planner_pins_the_chosen_pool_and_places_only_on_its_nodes():
    from slurm_elastic import planner as pl
    from slurm_elastic.policies.base import Allocation, JobAllocation

    pools = (Pool("a100:a100", "a100", ("a100",), (("a1", 4),), 4),
             Pool("v100:v100", "v100", ("v100",), (("v1", 8),), 8))
    spec = toy_spec(max_gpus=8, batch=8)
    views = [pl.JobView(1, pl.PENDING, spec=spec, partitions=("a100", "v100")),
             pl.JobView(2, pl.PENDING, spec=spec, partitions=("v100",))]
    alloc = Allocation({1: JobAllocation(1, 4, 1, 8, 2, pool="v100:v100"),
                        2: JobAllocation(2, 4, 1, 8, 2, pool="v100:v100")})
    p = pl.plan(alloc, views, {}, 0.0, capacity=12, node_size=4, node_free={"a1": 4, "v1": 8}, pools=pools)
    starts = {a.job_id: a for a in p.of_kind("start")}
    # each partition holds one GPU type: the partition pins it, the gres stays as submitted (issue 23:
    # Slurm 22.05 never retypes a typed request), and the other partitions stay in the decision
    assert starts[1].partition == "v100" and starts[1].gpu_type is None
    assert starts[1].decision.parts == ("a100", "v100")
    assert starts[2].partition is None and starts[2].gpu_type is None  # already its only partition
    # a partition with two GPU types: the nodes of the other type are excluded, the gres stays untyped
    mixed = (Pool("p:a100", "a100", ("p",), (("a1", 4),), 4), Pool("p:v100", "v100", ("p",), (("v1", 8),), 8))
    alloc2 = Allocation({2: JobAllocation(2, 4, 1, 8, 2, pool="p:v100")})
    p2 = pl.plan(alloc2, [pl.JobView(2, pl.PENDING, spec=spec, partitions=("p",))], {}, 0.0, capacity=12,
                 node_size=4, node_free={"a1": 4, "v1": 8}, pools=mixed)
    s2 = p2.of_kind("start")[0]
    assert s2.gpu_type is None and s2.exclude_nodes == ("a1",) and s2.partition is None
    # a third 4-GPU start in v100 does not fit there, though a1 is free: it waits
    views.append(pl.JobView(3, pl.PENDING, spec=spec, partitions=("v100",)))
    alloc.jobs[3] = JobAllocation(3, 4, 1, 8, 2, pool="v100:v100")
    p = pl.plan(alloc, views, {}, 0.0, capacity=12, node_size=4, node_free={"a1": 4, "v1": 8}, pools=pools)
    assert {a.job_id for a in p.of_kind("start")} == {1, 2}


def test_pollux_dp_dispatches_to_the_pools_too():
    from slurm_elastic.policies import get_policy

    rng = random.Random(3)
    for _ in range(5):
        prob = instance(rng)
        a = get_policy("pollux-dp").allocate(prob)
        assert a.bound is not None
        for p in prob.pools:
            assert sum(x.gpus for x in a.jobs.values() if x.pool == p.name) <= p.total_gpus
        for req in prob.jobs:
            x = a.jobs[req.job_id]
            assert not x.gpus or x.pool in req.pools


@pytest.mark.parametrize("admission", ["joint", "priority"])
def test_second_price_search_never_worsens_the_answer_or_the_bound(admission, monkeypatch):
    """Both price searches' assignments are solved and the better kept, the bound is the lower: against
    the subgradient search alone (the module's first and only one before), on the Lagrangian path."""
    import slurm_elastic.policies._multipool as mp

    rng = random.Random(31)
    joint = DPPolicy(admission="joint", starvation_s=float("inf"), objective="completion")
    seen = []
    for _ in range(20):
        prob = instance(rng)
        both = allocate_pools(prob, joint.candidates, admission=admission, objective="completion", enumerate_limit=0)
        with monkeypatch.context() as m:
            m.setattr(mp, "lagrangian", mp.subgradient_prices)
            alone = allocate_pools(prob, joint.candidates, admission=admission, objective="completion",
                                   enumerate_limit=0)
        q = build_q(prob, joint.candidates, admission=admission, objective="speedup")
        assert lagrangian(q)[0] >= q_milp(q) - 1e-9  # the bisection search's bound is a bound too
        assert both.objective >= alone.objective - 1e-9
        assert both.bound <= alone.bound + 1e-9
        seen.append((both.objective - alone.objective, alone.bound - both.bound))
    print(f"{admission}: objective gained on {sum(a > 1e-9 for a, _ in seen)}/20, bound tightened on "
          f"{sum(b > 1e-9 for _, b in seen)}/20")


def test_allocation_pauses_the_garbage_collector_and_restores_it(monkeypatch):
    import gc

    import slurm_elastic.policies.dp as dpmod

    prob = instance(random.Random(2))
    single = replace(prob, pools=(), node_capacity=None)
    states = []
    real = dpmod.make_candidates

    def spy(*a, **k):
        states.append(gc.isenabled())
        return real(*a, **k)

    def boom(*a, **k):
        raise RuntimeError("boom")

    assert gc.isenabled()
    monkeypatch.setattr(dpmod, "make_candidates", spy)
    DPPolicy().allocate(prob)  # several pools
    DPPolicy().allocate(single)
    assert len(states) > 1 and not any(states)  # off while the policy built its candidates
    assert gc.isenabled()
    monkeypatch.setattr(dpmod, "make_candidates", boom)
    with pytest.raises(RuntimeError):
        DPPolicy().allocate(single)
    assert gc.isenabled()  # back on after a failing allocation too


def test_a_job_that_fits_no_node_of_its_pool_starts_on_another_pools_idle_gpus():
    """Found on Sia's cluster: the search assigns each pending job one pool by count; where that pool's
    nodes had no place for it, it waited while GPUs of another type it may use sat idle (10-80 cycles a
    run). The fill starts it where it places (policies/_multipool._fill_pools)."""
    from slurm_elastic.policies import _multipool

    pools = (Pool("fast", "v100", ("b",), (("f1", 2), ("f2", 2)), 2), Pool("slow", "k80", ("a",), (("s1", 2),), 2))
    spec = replace(toy_spec(min_gpus=1, max_gpus=2, batch=64), min_batch=32, max_batch=256, max_local_batch=128)
    v, k = gavel_model("v100", "ResNet-50"), gavel_model("k80", "ResNet-50")
    one = replace(spec, max_gpus=1)
    running = tuple(JobRequest(j, one, v, running_gpus=1, running_batch=64, pool="fast", pools=("fast",),
                               nodes=(n,), gpus_per_node=1, pool_models=(("fast", v),))
                    for j, n in ((1, "f1"), (2, "f2")))  # one GPU free on each fast node
    waiting = JobRequest(3, replace(spec, min_gpus=2), k, pools=("fast", "slow"),
                         pool_models=(("fast", v), ("slow", k)))  # 2 GPUs on one node
    prob = AllocationProblem(6, 2, (*running, waiting), pools=pools)
    joint = DPPolicy(admission="joint", starvation_s=float("inf"))
    a = allocate_pools(prob, joint.candidates)
    assert (a.jobs[3].gpus, a.jobs[3].pool) == (2, "slow")
    assert a.jobs[1].gpus == a.jobs[2].gpus == 1
    real = _multipool._fill_pools  # without the fill, the count says fast and nothing places it there
    try:
        _multipool._fill_pools = lambda q, problem, parts, obj, assign, name, memo: (parts, obj, assign)
        assert allocate_pools(prob, joint.candidates).jobs[3].pool == "fast"
    finally:
        _multipool._fill_pools = real


def test_a_start_may_take_the_gpus_a_moving_job_leaves():
    """Found on Sia's cluster: a job moving to another type leaves its node; a start the policy placed on
    that node was turned away by the planner's count (starts are counted before moves are), and the node
    idled. The GPUs a move leaves count for the starts; without the node map nothing is credited."""
    from slurm_elastic import planner as pl
    from slurm_elastic.policies.base import Allocation, JobAllocation

    pools = (Pool("a100:a100", "a100", ("a100",), (("a1", 4),), 4),
             Pool("v100:v100", "v100", ("v100",), (("v1", 4),), 4))
    spec = toy_spec(max_gpus=8, batch=8)
    views = [pl.JobView(1, pl.RUNNING, 4, 8, 1.0, spec, ("v1",), 4, partitions=("a100", "v100")),
             pl.JobView(3, pl.RUNNING, 2, 8, 1.0, spec, ("a1",), 2, partitions=("a100",)),
             pl.JobView(2, pl.PENDING, spec=spec, partitions=("v100",))]
    alloc = Allocation({1: JobAllocation(1, 2, 1, 8, 4, pool="a100:a100"),  # 1 moves to the A100 node
                        3: JobAllocation(3, 2, 1, 8, 4, pool="a100:a100"),
                        2: JobAllocation(2, 4, 1, 8, 2, pool="v100:v100")})  # 2 starts where 1 was
    p = pl.plan(alloc, views, {}, 0.0, capacity=8, node_size=4, node_free={"a1": 2, "v1": 0}, pools=pools)
    k = {a.job_id: a.kind for a in p.actions}
    assert k == {1: "resize", 2: "start", 3: "leave"} and p.committed_gpus == 8  # was: 2 waited, v1 idle
    assert p.of_kind("start")[0].after == (1,)  # released once the move has left v1
    # the move cannot be made (the A100 node is full): the start finds no place, nothing is committed twice
    p = pl.plan(alloc, views, {}, 0.0, capacity=8, node_size=4, node_free={"a1": 0, "v1": 0}, pools=pools)
    assert {a.job_id: a.kind for a in p.actions} == {1: "leave", 2: "leave", 3: "leave"}
    assert p.committed_gpus == 6


def test_waiting_reason_counts_ranks_among_the_jobs_ranked():
    """A pending job's reason, several pools: 'k of n rank ahead of it' counts among the jobs its pool
    ranked (n), some of which the pool choice sent elsewhere; it once said '11 of 10'."""
    import re

    said = 0
    for seed in range(8):
        rng = random.Random(seed)
        pools = (Pool("a", "a", ("p",), (("a0", 4), ("a1", 4)), 4), Pool("b", "b", ("p",), (("b0", 4),), 4))
        jobs = []
        for j in range(rng.randint(6, 14)):
            spec = replace(toy_spec(min_gpus=1, max_gpus=rng.choice([2, 4, 8]), batch=32), min_batch=32,
                           max_batch=256, max_local_batch=128)
            pm = (("a", LinearModel(100.0)), ("b", LinearModel(rng.choice([50.0, 200.0]))))
            jobs.append(JobRequest(j, spec, LinearModel(100.0), pools=("a", "b"), pool_models=pm,
                                   remaining_samples=float(rng.randint(1, 100)) * 1e5))
        problem = AllocationProblem(total_gpus=12, node_size=4, jobs=tuple(jobs), pools=pools, horizon_s=3600.0)
        for a in DPPolicy().allocate(problem).jobs.values():
            m = re.search(r"(\d+) of (\d+) rank ahead", a.reason or "")
            if m:
                said += 1
                assert int(m.group(1)) < int(m.group(2)) <= len(jobs), a.reason
    assert said > 0  # the instances do make jobs wait behind shorter ones


def test_a_moved_job_gets_only_a_size_the_move_rule_allows():
    """Found on Sia's cluster: an imagenet job on 1 A100 was moved to 1 RTX (-41% samples/s) so that its
    A100 could go to another job. The move rule (_multipool.MOVE_MIN_GAIN) filtered the prices' items, but
    the pool's exact DP then offered the moved job every count there. Now a job that leaves its pool runs
    there on a faster type per GPU, or at least MOVE_MIN_GAIN more samples/s than it has at home."""
    from slurm_elastic.policies._multipool import MOVE_MIN_GAIN

    moved = 0
    for seed in range(40):
        rng = random.Random(seed)
        pools = (Pool("fast", "a100", ("p",), (("f0", 4),), 4), Pool("slow", "t4", ("p",), (("s0", 4), ("s1", 4)), 4))
        speed = {"fast": 300.0, "slow": 100.0}
        jobs, used = [], {"fast": 0, "slow": 0}
        for j in range(rng.randint(3, 8)):
            spec = replace(toy_spec(min_gpus=1, max_gpus=rng.choice([1, 2, 4, 8]), batch=32), min_batch=32,
                           max_batch=256, max_local_batch=128)
            pm = tuple((p, LinearModel(s)) for p, s in speed.items())
            left = float(rng.randint(1, 100)) * 1e5
            home = rng.choice(["fast", "slow", ""])
            k = min(spec.max_gpus, rng.choice([1, 2, 4]))
            nodes = {"fast": ("f0",), "slow": ("s0",) if used["slow"] + k <= 4 else ("s1",)}.get(home, ())
            if home and used[home] + k <= (4 if home == "fast" else 8):
                used[home] += k
                jobs.append(JobRequest(j, spec, pm[0][1] if home == "fast" else pm[1][1], running_gpus=k,
                                       running_batch=32, pool=f"{home}", pools=("fast", "slow"), nodes=nodes,
                                       gpus_per_node=k, pool_models=pm, remaining_samples=left, restart_s=30.0,
                                       held_s=3600.0))
            else:
                jobs.append(JobRequest(j, spec, pm[0][1], pools=("fast", "slow"), pool_models=pm,
                                       remaining_samples=left))
        problem = AllocationProblem(total_gpus=12, node_size=4, jobs=tuple(jobs), pools=pools, horizon_s=3600.0)
        alloc = DPPolicy().allocate(problem)
        for req in jobs:
            a = alloc.jobs[req.job_id]
            if req.running_gpus and a.gpus and a.pool != req.pool:
                moved += 1
                before = speed[req.pool] * req.running_gpus
                assert speed[a.pool] >= (1 + MOVE_MIN_GAIN) * speed[req.pool] or \
                    a.samples_per_s >= (1 + MOVE_MIN_GAIN) * before, (seed, req.job_id, a)
    assert moved > 0  # the instances do move jobs
