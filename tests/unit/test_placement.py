"""Placeable allocations (issue 12): the allocator's replay matches the planner, and what dp / pollux-dp
return is carried out in full by the planner on fragmented clusters."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from slurm_elastic import planner as pl
from slurm_elastic.commands.bench import random_problem
from slurm_elastic.policies import AllocationProblem, get_policy
from slurm_elastic.policies._candidates import build_allocation, make_candidates
from slurm_elastic.policies._mckp import mckp
from slurm_elastic.policies._placement import (
    _Free,
    _start_fill,
    make_placeable,
    place_check,
    repair,
    solve_placeable,
)
from tests.unit.test_policies import job, spec


def _views(problem: AllocationProblem):
    """The planner's view of a problem: running jobs on their nodes, released-but-unplaced ones starting."""
    views = []
    for r in problem.jobs:
        if r.running_gpus and r.nodes:
            views.append(pl.JobView(r.job_id, pl.RUNNING, r.running_gpus, r.running_batch, 0.0, r.spec, r.nodes,
                                    r.gpus_per_node))
        elif r.running_gpus:
            views.append(pl.JobView(r.job_id, pl.STARTING, r.running_gpus, r.running_batch, 0.0, r.spec))
        else:
            views.append(pl.JobView(r.job_id, pl.PENDING, spec=r.spec))
    free = dict(problem.node_capacity)
    for r in problem.jobs:
        for n in r.nodes:
            free[n] -= r.gpus_per_node
    return views, free


def _unplaced(problem: AllocationProblem, alloc) -> list:
    """Actions of the allocation that the planner could not carry out as allocated."""
    views, free = _views(problem)
    cfg = pl.PlannerConfig(cooldown_s=0.0, max_in_flight=10**6)
    p = pl.plan(alloc, views, {}, 0.0, capacity=problem.total_gpus, node_size=problem.node_size, config=cfg,
                node_free=free)
    out = []
    for a in p.actions:
        want = alloc.jobs[a.job_id].gpus
        if a.kind == "leave" and ("placement" in a.reason or "waiting" in a.reason):
            out.append(a)
        elif a.kind in ("start", "resize") and a.gpus != want:
            out.append(a)
    return out


def _fragmented(seed: int, jobs: int = 40, gpus: int = 96) -> AllocationProblem:
    """The benchmark's instance (nodes full, best fit); a running job it could not place is released and
    not started yet, which the daemon hands to the policy frozen (enact._freeze)."""
    p = random_problem(jobs, gpus, seed, 4)
    return replace(p, jobs=tuple(replace(r, frozen=True) if r.running_gpus and not r.nodes else r for r in p.jobs))


def test_free_map_takes_exactly_as_the_planner_places():
    rng = random.Random(7)
    for _ in range(30):
        free = {f"n{i:02d}": rng.randint(0, 4) for i in range(rng.randint(1, 12))}
        mine, theirs = _Free(free, 4), pl._Placer(free, 4)
        for _ in range(40):
            nodes, gpn = rng.choice([(1, 1), (1, 2), (1, 3), (1, 4), (2, 4), (3, 4)])
            if rng.random() < 0.3:
                names = rng.sample(sorted(free), rng.randint(1, len(free)))
                g = rng.randint(1, 2)
                if all(mine.free[n] + g <= 4 for n in names):
                    mine.add(names, g)
                    theirs.give_back(names, g)
                continue
            a, b = mine.take(nodes, gpn), theirs.take(nodes, gpn)
            assert (a is None) == (b is None)
            assert a is None or sorted(a) == sorted(b)
            assert mine.free == theirs.free


def test_capped_resolves_do_not_converge_where_the_repair_places_everything():
    # Full, fragmented clusters (the benchmark's instances: every node full, best fit). The knapsack on
    # the pool plans grows no node can take; re-solving with those jobs capped (the old allocator, 4
    # rounds) hands the GPUs to other counts that do not fit either. solve_placeable places everything.
    # Since starts are placed after grows (issue 23) the pool-only answer fails far less often (3 of the
    # first 30 instances of 40 jobs, was 5 of 16), and since the largest start is placed first 1 of the
    # first 40, so more instances are tried.
    old_failed = 0
    for jobs, gpus, seeds in ((40, 96, 40), (100, 256, 6)):
        for seed in range(seeds):
            cand = get_policy("dp", admission="joint", restart_margin=1.0, tenure=False, backoff=0.0).candidates(
                random_problem(jobs, gpus, seed, 4))
            values = cand.values.copy()
            _, chosen = mckp(cand.offsets, cand.weights, values, cand.capacity)
            for _ in range(4):
                for p, cap in place_check(cand, chosen).items():
                    lo, hi = int(cand.offsets[p]), int(cand.offsets[p + 1])
                    over = cand.cols[0, lo:hi] > cap
                    over[0] = False
                    values[lo:hi][over] = -1e30
                _, chosen = mckp(cand.offsets, cand.weights, values, cand.capacity)
            old_failed += bool(place_check(cand, chosen))
            new = solve_placeable(cand)
            assert place_check(cand, new) == {}, (jobs, seed)
            assert cand.weights[new].sum() <= cand.capacity
    assert old_failed >= 1  # measured: 1 of these 46 (5 of 16 with starts placed before grows)


# dp with its stability margin off (the margin plans fewer grows, so fewer need the repair), and as is
OFF = {"restart_margin": 1.0, "tenure": False, "backoff": 0.0}


@pytest.mark.parametrize("policy,opts", [("dp", {"admission": "priority", **OFF}), ("dp", {"admission": "joint", **OFF}),
                                         ("dp", {}), ("pollux-dp", {})])
def test_allocations_are_carried_out_in_full_on_fragmented_clusters(policy, opts):
    seen_repair = 0
    for seed in (*range(8), 12, 27):  # 12 and 27: joint admission's pool-only answer does not place
        problem = _fragmented(seed)
        pol = get_policy(policy, **opts)
        alloc = pol.allocate(problem)
        assert _unplaced(problem, alloc) == [], f"seed {seed}"
        assert alloc.gpus_used() <= problem.total_gpus
        if policy == "dp":
            cand = pol.candidates(problem)
            seen_repair += bool(place_check(cand, mckp(cand.offsets, cand.weights, cand.values, cand.capacity)[1]))
    if policy == "dp" and opts.get("admission") == "joint":
        # the instances do exercise the repair (the pool-only answer does not place). With starts placed
        # after grows, priority admission's answers placed on all of the first 30 instances.
        assert seen_repair >= 2


def test_resolve_and_fill_are_worth_at_least_repair_alone_and_at_most_the_pool_optimum():
    for seed in range(10):
        problem = _fragmented(seed, jobs=60, gpus=128)
        cand = get_policy("dp", admission="joint").candidates(problem)
        obj, chosen = mckp(cand.offsets, cand.weights, cand.values, cand.capacity)
        fixed = repair(cand, chosen)
        final = make_placeable(cand, chosen, fills=2)
        resolved = make_placeable(cand, chosen, resolves=2)
        assert place_check(cand, fixed) == {} and place_check(cand, final) == {} and place_check(cand, resolved) == {}
        v_fix, v_final, v_res = cand.values[fixed].sum(), cand.values[final].sum(), cand.values[resolved].sum()
        assert v_fix - 1e-9 <= v_final <= obj + 1e-6
        assert v_fix - 1e-9 <= v_res <= obj + 1e-6
        assert cand.weights[final].sum() <= cand.capacity


def test_gpus_a_job_cannot_be_placed_on_go_to_jobs_that_fit():
    # 3 nodes x 4. Frozen 1-GPU jobs on n1 and n2: 3 + 3 + 4 GPUs free, one whole node. Job 2 (high
    # weight) would take 8 (two whole nodes: impossible); it fits at 4 on n3. The 6 GPUs left on n1/n2
    # go to job 3 (up to 3 GPUs, one node) and job 4 (the capped re-solve), and with fills (no re-solve)
    # too.
    nodes = (("n1", 4), ("n2", 4), ("n3", 4))
    one = spec(min_gpus=1, max_gpus=1)
    jobs = (job(0, one, running=1, batch=32, nodes=("n1",), gpus_per_node=1, frozen=True),
            job(1, one, running=1, batch=32, nodes=("n2",), gpus_per_node=1, frozen=True),
            job(2, spec(min_gpus=1, max_gpus=8, weight=20.0)),
            job(3, spec(min_gpus=1, max_gpus=3)),
            job(4, spec(min_gpus=1, max_gpus=3)))
    problem = AllocationProblem(12, 4, jobs, node_capacity=nodes)
    pool = get_policy("dp", placement=False, objective="throughput").allocate(problem)
    assert pool.jobs[2].gpus == 8  # the pool alone plans two whole nodes that do not exist
    a = get_policy("dp", objective="throughput").allocate(problem)
    assert a.jobs[2].gpus == 4
    assert a.jobs[3].gpus == 3 and a.jobs[4].gpus == 3  # nothing left idle that fits
    assert _unplaced(problem, a) == []
    cand = make_candidates(problem)
    _, chosen = mckp(cand.offsets, cand.weights, cand.values, cand.capacity)
    counts = lambda ch: [int(cand.cols[0, i]) for i in ch]  # noqa: E731
    assert counts(chosen) == [1, 1, 8, 1, 1]
    assert counts(repair(cand, chosen)) == [1, 1, 4, 1, 1]  # 4 GPUs idle
    assert counts(make_placeable(cand, chosen, fills=1)) == [1, 1, 4, 3, 3]


def test_no_node_map_means_no_change():
    problem = _fragmented(1)
    problem = AllocationProblem(problem.total_gpus, 4, problem.jobs)
    cand = get_policy("dp", admission="joint").candidates(problem)
    _, chosen = mckp(cand.offsets, cand.weights, cand.values, cand.capacity)
    assert np.array_equal(solve_placeable(cand), chosen)
    assert make_candidates(problem) is not None


def test_tiresias_starts_only_what_places_and_keeps_jobs_preempted_for_nothing():
    # 3 nodes x 4 GPUs, three 2-GPU jobs that have run (queue 1), one on each node; a new job (queue 0,
    # first in 2D-LAS order) asks for 8 GPUs = 2 whole nodes. The GPU count says it fits (12 GPUs) once the
    # last-served running job is preempted, but that frees one node only: no placement for it.
    two = spec(gpus=2, batch=64)
    big = spec(min_gpus=8, max_gpus=8, gpus=8, batch=256)
    nodes = (("a", 4), ("b", 4), ("c", 4))
    jobs = tuple(job(i, two, running=2, batch=64, nodes=(n,), gpus_per_node=2, attained_gpu_s=1e5 + i)
                 for i, n in enumerate("abc")) + (job(3, big),)
    problem = AllocationProblem(12, 4, jobs, node_capacity=nodes)
    a = get_policy("tiresias").allocate(problem)
    assert a.jobs[3].gpus == 0 and "no placement for 8 GPUs" in a.jobs[3].reason
    assert [a.jobs[i].gpus for i in range(3)] == [2, 2, 2]  # none preempted for a start that cannot place
    pool = get_policy("tiresias").allocate(AllocationProblem(12, 4, jobs))  # no node data: the count alone
    assert pool.jobs[3].gpus == 8 and pool.jobs[2].gpus == 0
    # where preempting does free whole nodes, it starts: the others on one node, two nodes free
    packed = tuple(replace(r, nodes=("a",)) for r in jobs[:2]) + (replace(jobs[2], nodes=("b",)), jobs[3])
    b = get_policy("tiresias").allocate(AllocationProblem(12, 4, packed, node_capacity=nodes))
    assert b.jobs[3].gpus == 8 and [b.jobs[i].gpus for i in range(3)] == [2, 2, 0]


@pytest.mark.parametrize("seed", range(6))
def test_tiresias_allocation_is_carried_out_in_full_on_fragmented_clusters(seed):
    problem = _fragmented(seed, jobs=30, gpus=64)
    a = get_policy("tiresias").allocate(problem)
    views, free = _views(problem)
    cfg = pl.PlannerConfig(cooldown_s=0.0, max_in_flight=10**6, allow_preemption=True, start_smaller=False)
    p = pl.plan(a, views, {}, 0.0, capacity=problem.total_gpus, node_size=problem.node_size, config=cfg,
                node_free=free)
    started = {x.job_id: x.gpus for x in p.actions if x.kind == "start"}
    wanted = {r.job_id: a.jobs[r.job_id].gpus for r in problem.jobs if not r.running_gpus and a.jobs[r.job_id].gpus}
    assert started == wanted


def _two_nodes():
    """n0 free; g (1 GPU) and x (3 GPUs) fill n1; s pending. Every job 1-8 GPUs."""
    s = spec(min_gpus=1, max_gpus=8)
    jobs = (job("g", s, running=1, batch=64, nodes=("n1",), gpus_per_node=1),
            job("x", s, running=3, batch=192, nodes=("n1",), gpus_per_node=3), job("s", s))
    return AllocationProblem(8, 4, jobs, node_capacity=(("n0", 4), ("n1", 4)))


def _choice(cand, job_id, k):
    """The flat index of ``job_id``'s most valuable choice at ``k`` GPUs."""
    p = [cand.problem.jobs[j].job_id for j in cand.dp_jobs.tolist()].index(job_id)
    lo, hi = int(cand.offsets[p]), int(cand.offsets[p + 1])
    at = [i for i in range(lo, hi) if int(cand.cols[0, i]) == k]
    return p, max(at, key=lambda i: cand.values[i])


def _chosen(cand, **gpus):
    """The choice array that gives each named job its best choice at the given GPU count (others 0)."""
    chosen = np.zeros(cand.dp_jobs.size, dtype=np.int64)
    for jid, k in gpus.items():
        p, i = _choice(cand, jid, k)
        chosen[p] = i
    return chosen


def test_the_replay_places_grows_before_starts_as_the_planner_does():
    # g grows 1->4 (n0, the only node with 4 free) and s starts at 1 on the GPU g leaves on n1. Replayed
    # start first (the old order), s took n0 and g's grow did not fit: place_check said {g: ...}.
    cand = get_policy("dp", admission="joint").candidates(_two_nodes())
    chosen = _chosen(cand, g=4, x=3, s=1)
    assert place_check(cand, chosen) == {}
    alloc = build_allocation(cand, chosen, "dp", 0.0)
    assert _unplaced(cand.problem, alloc) == []  # and the planner carries it out in full


def test_gpus_a_grow_leaves_go_to_a_waiting_start():
    # The repair's leftover GPU (the one g leaves on n1) is handed on to the pending job: the start fill
    # places it after the grow. Before, s on that GPU replayed start first took n0 and broke g's grow, so
    # s waited ("its GPUs are worth more to other jobs") while the GPU went to no job.
    cand = get_policy("dp", admission="joint").candidates(_two_nodes())
    chosen = _chosen(cand, g=4, x=3, s=0)
    ps, _ = _choice(cand, "s", 0)
    filled = _start_fill(cand, chosen)
    assert int(cand.cols[0, filled[ps]]) == 1 and place_check(cand, filled) == {}
