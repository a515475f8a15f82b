"""The planner's rules (slurm_elastic/planner.py docstring), one by one."""

from __future__ import annotations

from dataclasses import replace

from sim_helpers import toy_spec

from slurm_elastic import planner as pl
from slurm_elastic.policies.base import Allocation, JobAllocation

SPEC = toy_spec(max_gpus=16)


def alloc(**gpus):
    return Allocation({k: JobAllocation(k, g, batch=8 if g else 0, local_batch=8 // g if g else 0)
                       for k, g in gpus.items()})


def view(job_id, status, gpus=0, batch=None, sps=0.0):
    return pl.JobView(job_id, status, gpus, batch if batch is not None else (8 if gpus else None), sps, SPEC)


def kinds(plan):
    return {a.job_id: (a.kind, getattr(a, "gpus", None)) for a in plan.actions}


def test_start_pending_with_placement_and_decision():
    p = pl.plan(alloc(a=2, b=8), [view("a", pl.PENDING), view("b", pl.PENDING)], {}, 0.0, capacity=16, node_size=4)
    by = {a.job_id: a for a in p.actions}
    assert isinstance(by["a"], pl.Start) and (by["a"].nodes, by["a"].gpus_per_node) == (1, 2)
    assert (by["b"].nodes, by["b"].gpus_per_node) == (2, 4)
    d = by["b"].decision
    assert (d.gpus, d.nodes, d.batch, d.local_batch, d.accum, d.seq) == (8, 2, 8, 1, 1, 1)
    assert d.to_admin_comment().startswith("elastic-decision:gpus=8,nodes=2,batch=8")
    assert p.committed_gpus == 10


def test_same_gpu_count_is_left_alone_even_with_another_batch():
    a = Allocation({"a": JobAllocation("a", 4, batch=16, local_batch=4)})
    p = pl.plan(a, [view("a", pl.RUNNING, 4, batch=8)], {}, 100.0, capacity=16, node_size=4)
    assert isinstance(p.actions[0], pl.Leave) and "batch-only" in p.actions[0].reason


def test_resize_and_cooldown():
    books = {"a": pl.JobBook(last_change_s=100.0, seq=3)}
    cfg = pl.PlannerConfig(cooldown_s=300.0)
    p = pl.plan(alloc(a=8), [view("a", pl.RUNNING, 4)], books, 350.0, capacity=16, node_size=4, config=cfg)
    assert kinds(p) == {"a": ("leave", None)} and "cooldown" in p.actions[0].reason and p.deferred == 1
    p = pl.plan(alloc(a=8), [view("a", pl.RUNNING, 4)], books, 400.0, capacity=16, node_size=4, config=cfg)
    r = p.actions[0]
    assert isinstance(r, pl.Resize) and (r.from_gpus, r.gpus, r.nodes, r.decision.seq) == (4, 8, 2, 4)
    nb = pl.update_books(books, [r], 400.0)
    assert nb["a"] == pl.JobBook(last_change_s=400.0, rescales=1, seq=4)


def test_in_flight_and_starting_jobs_are_left_alone_and_committed():
    jobs = [view("a", pl.IN_FLIGHT, 8), view("b", pl.STARTING, 4), view("c", pl.PENDING)]
    p = pl.plan(alloc(a=2, b=2, c=8), jobs, {}, 0.0, capacity=16, node_size=4)
    k = kinds(p)
    assert k["a"] == ("leave", None) and k["b"] == ("leave", None)
    # 8 + 4 committed: c's 8 do not fit in 16.
    assert k["c"] == ("leave", None)
    assert {a.job_id: a.reason for a in p.actions}["c"] == "waiting for GPUs"


def test_shrinks_before_grows_before_starts_and_capacity_gate():
    jobs = [view("g", pl.RUNNING, 4), view("s", pl.RUNNING, 8), view("n", pl.PENDING)]
    p = pl.plan(alloc(g=8, s=4, n=4), jobs, {}, 1000.0, capacity=16, node_size=4)
    assert [a.job_id for a in p.actions] == ["s", "g", "n"]
    assert p.actions[2].after == ()  # no placement gate (no node map): nothing to wait for
    assert p.committed_gpus == 16
    # Without the shrink (cooldown on s), the start fits (4+8+4=16) but the grow does not.
    books = {"s": pl.JobBook(last_change_s=900.0)}
    p = pl.plan(alloc(g=8, s=4, n=4), jobs, books, 1000.0, capacity=16, node_size=4,
                config=pl.PlannerConfig(cooldown_s=300.0))
    k = kinds(p)
    assert k["s"] == ("leave", None) and k["n"] == ("start", 4) and k["g"] == ("leave", None)
    assert p.committed_gpus == 16


def test_max_in_flight_counts_existing_resizes():
    jobs = [view("x", pl.IN_FLIGHT, 4), view("a", pl.RUNNING, 4), view("b", pl.RUNNING, 4)]
    p = pl.plan(alloc(a=2, b=2), jobs, {}, 0.0, capacity=16, node_size=4, config=pl.PlannerConfig(max_in_flight=2))
    k = kinds(p)
    assert k["a"] == ("resize", 2) and k["b"] == ("leave", None)
    assert p.deferred == 1


def test_zero_gpus_for_running_job_needs_preemption():
    jobs = [view("a", pl.RUNNING, 4)]
    p = pl.plan(alloc(a=0), jobs, {}, 0.0, capacity=16, node_size=4)
    assert kinds(p) == {"a": ("leave", None)} and "preemption is off" in p.actions[0].reason
    assert p.committed_gpus == 4
    p = pl.plan(alloc(a=0), jobs, {}, 0.0, capacity=16, node_size=4, config=pl.PlannerConfig(allow_preemption=True))
    assert isinstance(p.actions[0], pl.Preempt) and p.committed_gpus == 0


def test_min_relative_gain_skips_small_grows_only():
    a = Allocation({"a": JobAllocation("a", 8, batch=8, local_batch=1, samples_per_s=105.0),
                    "b": JobAllocation("b", 2, batch=8, local_batch=4, samples_per_s=50.0)})
    jobs = [view("a", pl.RUNNING, 4, sps=100.0), view("b", pl.RUNNING, 4, sps=100.0)]
    cfg = pl.PlannerConfig(min_relative_gain=0.1)
    k = kinds(pl.plan(a, jobs, {}, 0.0, capacity=16, node_size=4, config=cfg))
    assert k == {"a": ("leave", None), "b": ("resize", 2)}
    k = kinds(pl.plan(a, jobs, {}, 0.0, capacity=16, node_size=4))
    assert k == {"a": ("resize", 8), "b": ("resize", 2)}


def test_job_missing_from_allocation_is_left_alone():
    p = pl.plan(Allocation({}), [view("a", pl.RUNNING, 4), view("b", pl.PENDING)], {}, 0.0, capacity=8, node_size=4)
    assert all(isinstance(a, pl.Leave) for a in p.actions) and p.committed_gpus == 4


# ---- the placement gate (node_free given) ----

def test_start_waits_or_starts_smaller_when_gpus_are_scattered():
    # 8 free GPUs in total but 2 on each of 4 nodes: 8 GPUs need 2 whole nodes.
    free = {"n1": 2, "n2": 2, "n3": 2, "n4": 2}
    a = Allocation({"a": JobAllocation("a", 8, batch=8, local_batch=1)})
    p = pl.plan(a, [view("a", pl.PENDING)], {}, 0.0, capacity=16, node_size=4, node_free=free)
    s = p.actions[0]
    assert isinstance(s, pl.Start) and (s.gpus, s.nodes, s.gpus_per_node) == (2, 1, 2)
    assert (s.decision.batch, s.decision.local_batch) == (8, 4) and "placement" in s.reason
    p = pl.plan(a, [view("a", pl.PENDING)], {}, 0.0, capacity=16, node_size=4, node_free=free,
                config=pl.PlannerConfig(start_smaller=False))
    assert isinstance(p.actions[0], pl.Leave) and "placement" in p.actions[0].reason
    # Without the node map only the count gate applies.
    p = pl.plan(a, [view("a", pl.PENDING)], {}, 0.0, capacity=16, node_size=4)
    assert p.actions[0].gpus == 8


def test_unplaceable_starting_job_is_held_after_the_timeout():
    free = {"n1": 2, "n2": 2}
    jobs = [view("a", pl.STARTING, 4), view("b", pl.PENDING)]
    books = {"a": pl.JobBook(last_change_s=0.0, seq=1)}
    alloc_ = Allocation({"a": JobAllocation("a", 4, batch=8, local_batch=2),
                         "b": JobAllocation("b", 2, batch=8, local_batch=4)})
    p = pl.plan(alloc_, jobs, books, 60.0, capacity=8, node_size=4, node_free=free)
    assert kinds(p) == {"a": ("leave", None), "b": ("start", 2)}  # a still within its timeout
    p = pl.plan(alloc_, jobs, books, 120.0, capacity=8, node_size=4, node_free=free)
    assert isinstance(p.actions[0], pl.Hold) and p.actions[0].job_id == "a"
    assert kinds(p)["b"] == ("start", 2) and p.committed_gpus == 2
    assert pl.update_books(books, [p.actions[0]], 120.0)["a"].last_change_s == 120.0


def test_a_grow_still_in_flight_keeps_the_gpus_it_grows_onto_from_a_new_start():
    """Live, a checkpoint can outlast the poll: next cycle the growing job still holds only its old GPUs on
    Slurm's map. A start placed on the GPUs it grows onto would leave it, released, without a place."""
    jobs = [pl.JobView("g", pl.IN_FLIGHT, 8, 8, 0.0, SPEC, ("n1",), 4), view("b", pl.PENDING)]
    free = {"n1": 4, "n2": 2}  # 8-GPU nodes: g has 4 of n1 and grows to all 8 of it
    p = pl.plan(alloc(g=8, b=4), jobs, {}, 100.0, capacity=16, node_size=8, node_free=free)
    assert kinds(p) == {"g": ("leave", None), "b": ("start", 2)}  # the 2 of n2, not 4 of n1
    p = pl.plan(alloc(g=8, b=4), jobs, {}, 100.0, capacity=16, node_size=8, node_free={"n1": 4, "n2": 0})
    assert kinds(p)["b"] == ("leave", None)
    # requeued already (no nodes on the map): its whole target is kept
    gone = [pl.JobView("g", pl.IN_FLIGHT, 8, 8, 0.0, SPEC), view("b", pl.PENDING)]
    p = pl.plan(alloc(g=8, b=4), gone, {}, 100.0, capacity=16, node_size=8, node_free={"n1": 8, "n2": 2})
    assert kinds(p)["b"] == ("start", 2)
    # a preemption in flight (target 0), requeued already: nothing kept (found by the fault suite: it crashed)
    pre = [pl.JobView("g", pl.IN_FLIGHT, 0, 8, 0.0, SPEC), view("b", pl.PENDING)]
    p = pl.plan(alloc(g=0, b=4), pre, {}, 100.0, capacity=16, node_size=8, node_free={"n1": 8})
    assert kinds(p)["b"] == ("start", 4)
    # a shrink in flight holds more than it will: nothing changes for the start
    shrink = [pl.JobView("g", pl.IN_FLIGHT, 2, 8, 0.0, SPEC, ("n1",), 4), view("b", pl.PENDING)]
    p = pl.plan(alloc(g=2, b=4), shrink, {}, 100.0, capacity=16, node_size=8, node_free=free)
    assert kinds(p)["b"] == ("start", 4)


def test_grow_needs_a_placement_and_a_shrink_frees_its_nodes():
    free = {"n1": 0, "n2": 1, "n3": 0}
    jobs = [pl.JobView("g", pl.RUNNING, 2, 8, 0.0, SPEC, ("n1",), 2),
            pl.JobView("s", pl.RUNNING, 4, 8, 0.0, SPEC, ("n3",), 4)]
    # g wants 4 on one node: n1 holds only its own 2; s shrinking to 2 leaves 2 free on n3 (best fit
    # puts s back on n3): g fits nowhere and waits; s's shrink goes ahead.
    p = pl.plan(alloc(g=4, s=2), jobs, {}, 1000.0, capacity=12, node_size=4, node_free=free)
    assert kinds(p) == {"s": ("resize", 2), "g": ("leave", None)}
    # If s shrinks to 1 GPU, best fit puts it on n2's free GPU, n3 is whole again and g fits there.
    p = pl.plan(alloc(g=4, s=1), jobs, {}, 1000.0, capacity=12, node_size=4, node_free=free)
    assert kinds(p) == {"s": ("resize", 1), "g": ("resize", 4)}


def test_released_job_pinned_to_a_pool_it_no_longer_fits_is_held_for_the_pool_the_policy_chose():
    """Several pools: a job released to the fast pool, which a rigid job then took before Slurm started
    it, is held again at once (not after the start timeout) when the policy now places it in the pool
    that has room, so that it starts there next cycle; the free nodes of that other pool do not make it
    look placeable where it was pinned. Within the pool it was released to it keeps its place."""
    from slurm_elastic.policies.base import Pool

    pools = [Pool("a100", "a100", ("a100",), (("n1", 4), ("n2", 4)), 4),
             Pool("v100", "v100", ("v100",), (("n3", 4), ("n4", 4)), 4)]
    jobs = [pl.JobView("a", pl.STARTING, 2, 8, 0.0, SPEC, partitions=("a100", "v100"),
                       start_nodes=frozenset({"n3", "n4"}))]
    books = {"a": pl.JobBook(last_change_s=0.0, seq=1)}
    to_a100 = Allocation({"a": JobAllocation("a", 2, batch=8, local_batch=4, pool="a100")})
    full_v100 = {"n1": 4, "n2": 4, "n3": 0, "n4": 0}
    p = pl.plan(to_a100, jobs, books, 5.0, capacity=8, node_size=4, node_free=full_v100, pools=pools)
    assert kinds(p) == {"a": ("hold", 2)} and "start in a100" in p.actions[0].reason and p.committed_gpus == 0
    # where it was pinned still has room: it keeps its place (Slurm starts it there)
    p = pl.plan(to_a100, jobs, books, 5.0, capacity=8, node_size=4, node_free={**full_v100, "n3": 2}, pools=pools)
    assert kinds(p) == {"a": ("leave", None)} and p.committed_gpus == 2
    # the policy keeps it in its pool: it waits there until the start timeout, as with one pool
    to_v100 = Allocation({"a": JobAllocation("a", 2, batch=8, local_batch=4, pool="v100")})
    p = pl.plan(to_v100, jobs, books, 5.0, capacity=8, node_size=4, node_free=full_v100, pools=pools)
    assert kinds(p) == {"a": ("leave", None)}


def test_a_grow_is_placed_before_a_start_so_the_start_takes_the_gpus_it_leaves():
    # Issue 23 item 7. n0 is free; g (2 GPUs) and x (2 GPUs) fill n1. The policy grows g to 4 and starts s
    # at 1: g can only go to n0 (4 on one node) and s to the 2 GPUs g leaves on n1. Placed start first, s
    # took n0 (best fit: the only free node), g's grow found no node and 3 GPUs of n0 stayed idle.
    on = {"g": ("n1",), "x": ("n1",)}
    jobs = [pl.JobView("s", pl.PENDING, spec=SPEC)] + [
        pl.JobView(j, pl.RUNNING, 2, 8, 0.0, SPEC, on[j], 2) for j in ("g", "x")]
    p = pl.plan(alloc(s=1, g=4, x=2), jobs, {}, 1000.0, capacity=8, node_size=4, node_free={"n0": 4, "n1": 0})
    k = kinds(p)
    assert k["g"] == ("resize", 4) and k["s"] == ("start", 1) and k["x"] == ("leave", None)
    assert [a.job_id for a in p.changes] == ["g", "s"]  # executed in the order placed
    assert p.changes[1].after == ("g",)  # released once g is placed on n0
    assert p.committed_gpus == 7


def test_a_start_that_needs_no_gpu_of_a_resize_is_released_at_once():
    # g grows 2->4 in place of nothing else (n1 empties, n2 was free); s starts at 2 on n0's free GPUs,
    # which no resize touches: it need not wait for g's checkpoint.
    jobs = [pl.JobView("s", pl.PENDING, spec=SPEC), pl.JobView("g", pl.RUNNING, 2, 8, 0.0, SPEC, ("n1",), 2)]
    p = pl.plan(alloc(s=2, g=4), jobs, {}, 1000.0, capacity=12, node_size=4,
                node_free={"n0": 2, "n1": 2, "n2": 4})
    k = kinds(p)
    assert k["g"] == ("resize", 4) and k["s"] == ("start", 2)
    assert {a.job_id: a for a in p.actions}["s"].after == ()


def test_a_released_job_holds_no_place_on_nodes_its_last_start_excluded():
    # Seen on the heterogeneous simulator: a released job pinned to one type by ExcNodeList (a partition of
    # several types) "kept its place" on a free node of another type in the planner's map, though Slurm
    # would never start it there; a grow was planned onto the GPUs it then took, and it waited 24 minutes.
    d = pl.Decision(gpus=4, nodes=1, batch=8, local_batch=2, seq=1)
    start = pl.Start("w", 4, 1, 4, d, exclude_nodes=("n1",))
    books = pl.update_books({}, [start], 0.0)
    assert books["w"].excluded == ("n1",)
    jobs = [pl.JobView("w", pl.STARTING, 4, 8, 0.0, SPEC)]
    p = pl.plan(alloc(w=4), jobs, books, 200.0, capacity=8, node_size=4, node_free={"n0": 2, "n1": 4})
    assert kinds(p)["w"] == ("hold", 4)  # not placeable where it may start, and past start_timeout_s
    assert pl.update_books(books, [replace(start, exclude_nodes=())], 300.0)["w"].excluded == ()


def test_no_shrink_is_made_for_a_grow_that_max_in_flight_defers():
    """Found on the simulator: the resize slots went to 8 shrinks, the grow they fed was deferred, and the
    GPU one shrink freed sat idle for a cycle while pending jobs that fitted waited. A shrink whose GPUs
    would go to no one this cycle is not made; its slot goes to the deferred grow."""
    jobs = [pl.JobView("a", pl.RUNNING, 2, 8, 1.0, SPEC, ("n0",), 2),  # a and c share n0
            pl.JobView("b", pl.RUNNING, 4, 8, 1.0, SPEC, ("n1",), 4),
            pl.JobView("c", pl.RUNNING, 2, 8, 1.0, SPEC, ("n0",), 2), view("d", pl.PENDING)]
    free = {"n0": 0, "n1": 0}
    cfg = pl.PlannerConfig(max_in_flight=2)
    p = pl.plan(alloc(a=1, b=3, c=3, d=1), jobs, {}, 0.0, capacity=8, node_size=4, node_free=free, config=cfg)
    kept = [x for x in p.actions if x.kind == "leave" and "resize slot" in x.reason]
    assert len(kept) == 1 and kept[0].job_id in ("a", "b")  # one shrink not made...
    assert p.committed_gpus == 8  # ...and no GPU idle (7 before: a GPU freed for the deferred grow)
    assert kinds(p)["d"] == ("start", 1) and len(p.of_kind("resize")) == 1
    # with a slot for each, every action is made, the grow onto what a frees included
    p = pl.plan(alloc(a=1, b=3, c=3, d=1), jobs, {}, 0.0, capacity=8, node_size=4, node_free=free)
    assert kinds(p) == {"a": ("resize", 1), "b": ("resize", 3), "c": ("resize", 3), "d": ("start", 1)}
    # a shrink another start takes the GPUs of is made even while the grow waits
    p = pl.plan(alloc(a=1, b=3, c=3, d=1), jobs, {}, 0.0, capacity=8, node_size=4, node_free=free,
                config=pl.PlannerConfig(max_in_flight=1))
    k = kinds(p)
    assert k["c"] == ("leave", None) and p.committed_gpus == 8


def test_a_start_the_count_turned_away_is_made_when_the_one_counted_first_does_not_place():
    """The count runs in priority order before placement: a start counted first that then finds no node
    turned away one that would have placed, and the GPUs idled. The next pass leaves the unplaceable one
    out of the count."""
    free = {"n1": 2, "n2": 2}  # 4 free GPUs, no node with 4
    four = pl.JobView("a", pl.PENDING, 0, None, 0.0, toy_spec(min_gpus=4, max_gpus=4))  # cannot start smaller
    p = pl.plan(alloc(a=4, b=2), [four, view("b", pl.PENDING)], {}, 0.0, capacity=4, node_size=4, node_free=free)
    by = {x.job_id: x for x in p.actions}
    assert by["a"].kind == "leave" and by["a"].reason == "waiting for a placement of 4 GPUs"
    assert by["b"].kind == "start" and by["b"].gpus == 2 and p.committed_gpus == 2  # was: b waited, 4 idle


def test_a_grow_is_placed_on_the_node_a_later_move_leaves_and_what_cannot_be_placed_is_reported():
    """Found on Sia's cluster: a grow counted first needed the node a lower-priority job was moving off
    (to another GPU type); placed in priority order it found no node, and the node the move then left
    idled for a cycle. A grow that found no place is tried again once the later moves are placed. One
    that still has none is reported in ``Plan.blocked`` (the cycle may re-solve without it)."""
    from slurm_elastic.policies.base import Pool

    pools = (Pool("t4", "t4", ("gpu",), (("n0", 4), ("n1", 4)), 4), Pool("a100", "a100", ("gpu",), (("n2", 4),), 4))
    jobs = [pl.JobView("g", pl.RUNNING, 2, 8, 1.0, SPEC, ("n0",), 2),  # g first in priority order
            pl.JobView("x", pl.RUNNING, 2, 8, 1.0, SPEC, ("n0",), 2),
            pl.JobView("m", pl.RUNNING, 4, 8, 1.0, SPEC, ("n1",), 4)]
    free = {"n0": 0, "n1": 0, "n2": 4}

    def to(**where):
        return Allocation({j: JobAllocation(j, g, batch=8, local_batch=8 // g, pool=p) for j, (g, p) in where.items()})

    a = to(g=(4, "t4"), x=(2, "t4"), m=(4, "a100"))  # g to 4 on one node: only n1, which m leaves for n2
    p = pl.plan(a, jobs, {}, 0.0, capacity=12, node_size=4, node_free=free, pools=pools)
    assert kinds(p) == {"g": ("resize", 4), "x": ("leave", None), "m": ("resize", 4)}
    assert p.committed_gpus == 10 and not p.blocked  # was: g left, 8 committed, n1 idle
    # m stays: g has no node for 4 GPUs and says so
    a = to(g=(4, "t4"), x=(2, "t4"), m=(4, "t4"))
    p = pl.plan(a, jobs, {}, 0.0, capacity=12, node_size=4, node_free=free, pools=pools)
    assert kinds(p)["g"] == ("leave", None) and p.blocked == {"g"} and p.committed_gpus == 8


def test_a_start_left_out_of_the_count_is_placed_last_on_what_a_move_vacated():
    """Found on Sia's cluster (workload 4, 30 s restarts): starts are counted before grows, so a move to
    the T4s was turned away by the count while a 1-GPU start counted ahead of it found no place on the RTX
    node that move would vacate. The next pass left the start out of the count, the move was made, and
    the GPU it vacated idled while the start waited. Such a start is now placed last, if the count and
    the map still take it; one they do not take stays out."""
    from slurm_elastic.policies.base import Pool

    spec = toy_spec(max_gpus=16, batch=24, gpus_per_node=None)
    pools = (Pool("t4", "t4", ("gpu",), (("n0", 4),), 4), Pool("rtx", "rtx", ("gpu",), (("r0", 2),), 2),
             Pool("a100", "a100", ("gpu",), (("a0", 8),), 8))

    def run(free, **where):
        views = [pl.JobView("up", pl.RUNNING, 1, 24, 1.0, spec, ("r0",), 1),  # rtx -> 4 T4s, first by priority
                 pl.JobView("out", pl.RUNNING, 4, 24, 1.0, spec, ("n0",), 4),  # T4s -> 3 A100s
                 pl.JobView("o", pl.RUNNING, 1, 24, 1.0, spec, ("r0",), 1),
                 pl.JobView("z", pl.RUNNING, 1, 24, 1.0, spec, ("a0",), 1),
                 pl.JobView("big", pl.PENDING, 0, None, 0.0, spec), pl.JobView("one", pl.PENDING, 0, None, 0.0, spec)]
        a = Allocation({j: JobAllocation(j, g, batch=24, local_batch=24 // g, pool=p) for j, (g, p) in where.items()})
        return pl.plan(a, views, {}, 0.0, capacity=14, node_size=8, node_free=free, pools=pools)

    where = dict(up=(4, "t4"), out=(3, "a100"), o=(1, "rtx"), z=(1, "a100"), big=(4, "a100"), one=(1, "rtx"))
    p = run({"n0": 0, "r0": 0, "a0": 7}, **where)
    assert kinds(p) == {"up": ("resize", 4), "out": ("resize", 3), "o": ("leave", None), "z": ("leave", None),
                        "big": ("start", 4), "one": ("start", 1)}, [a.reason for a in p.actions]
    assert p.committed_gpus == 14  # was: 13, 'one' waiting for a placement and r0's GPU idle
    one = next(a for a in p.actions if a.job_id == "one")
    assert one.gpu_type == "rtx" and set(one.after) == {"up", "out"}  # released once the move has left r0
    # the move is not made (its pool is full): the start has no place and stays out of the count
    p = run({"n0": 0, "r0": 0, "a0": 7}, **{**where, "up": (1, "rtx")})
    assert kinds(p)["one"] == ("leave", None) and p.committed_gpus == 10  # the T4s "out" leaves: nobody asked


def test_a_late_start_is_lowered_to_counts_of_its_own_pool():
    """A start placed last, where the count leaves fewer GPUs than the policy chose, starts at the largest
    count allowed on its own pool's nodes (5 of 8-GPU A100 nodes), not on the nodes of the pool placed
    before it (2-GPU RTX nodes allow 1, 2, 4: it started at 4 and one GPU idled)."""
    from slurm_elastic.policies.base import Pool

    spec = toy_spec(max_gpus=16, batch=60, gpus_per_node=None)
    pools = (Pool("rtx", "rtx", ("gpu",), (("r0", 2),), 2), Pool("a100", "a100", ("gpu",), (("a0", 8),), 8))
    views = [pl.JobView("s", pl.PENDING, 0, None, 0.0, spec), pl.JobView("late", pl.PENDING, 0, None, 0.0, spec)]
    a = Allocation({"s": JobAllocation("s", 2, batch=60, local_batch=30, pool="rtx"),
                    "late": JobAllocation("late", 6, batch=60, local_batch=10, pool="a100")})
    ps = pl._plan(a, views, {}, 0.0, capacity=7, node_size=8, config=pl.PlannerConfig(),
                  node_free={"r0": 2, "a0": 8}, pools=pools, urgent=frozenset(), keep=frozenset(),
                  skip=frozenset({"late"}))
    assert kinds(ps.plan) == {"s": ("start", 2), "late": ("start", 5)}, [x.reason for x in ps.plan.actions]
    assert ps.plan.committed_gpus == 7


def test_moves_that_each_need_the_gpus_another_leaves_are_made_together():
    """Found on Sia's cluster (workload 7, per-model restarts): a job on 7 A100s was moved to 16 RTX GPUs held
    by a job moved to those A100s. Each move needed the other's GPUs first, so neither was ever placed and
    both jobs stayed put, 'no placement', for 25 minutes while GPUs idled. A cycle of moves is made as one:
    every job of it requeued, each started in its new pool once the others have left. A three-job cycle whose
    biggest move the count alone turns away (it needs GPUs two moves free) is made too; a move whose place
    the cycle does not free is left, and the others are made without it; a cycle that ``max_in_flight`` cannot
    take whole is not begun."""
    from slurm_elastic.policies.base import Pool

    pools = (Pool("rtx", "rtx", ("gpu",), (("r0", 8), ("r1", 8)), 8), Pool("a100", "a100", ("gpu",), (("a0", 8),), 8),
             Pool("t4", "t4", ("gpu",), (("t0", 4),), 4))
    spec = toy_spec(max_gpus=16, gpus_per_node=None)

    def run(*jobs, free, config=None, **where):
        a = Allocation({j: JobAllocation(j, g, batch=16, local_batch=16 // g, pool=p) for j, (g, p) in where.items()})
        views = [pl.JobView(j, pl.RUNNING, k, 16, 1.0, spec, nodes, k // len(nodes)) for j, k, nodes in jobs]
        return pl.plan(a, views, {}, 0.0, capacity=28, node_size=8, node_free=free, pools=pools,
                       config=config or pl.PlannerConfig())

    p = run(("fast", 7, ("a0",)), ("slow", 16, ("r0", "r1")), free={"r0": 0, "r1": 0, "a0": 1, "t0": 4},
            fast=(16, "rtx"), slow=(8, "a100"))
    assert kinds(p) == {"fast": ("resize", 16), "slow": ("resize", 8)}, [a.reason for a in p.actions]
    assert not p.blocked and p.committed_gpus == 24  # was: both left, 'no placement', 23 committed
    assert all("made with the moves that free its GPUs" in a.reason for a in p.actions)
    assert {a.job_id: (a.gpu_type, a.nodes, a.gpus_per_node) for a in p.actions} == {"fast": ("rtx", 2, 8),
                                                                                        "slow": ("a100", 1, 8)}
    # largest first (best fit decreasing, as the starts): the 2-GPU move into the RTX pool, placed first by
    # priority, took the node the 8-GPU one needed and nothing was made; now the two 8-GPU moves are made
    p = run(("tiny", 4, ("t0",)), ("small", 8, ("r0",)), ("big", 8, ("a0",)), ("other", 7, ("r1",)),
            free={"r0": 0, "r1": 1, "a0": 0, "t0": 0}, tiny=(2, "rtx"), small=(8, "a100"), big=(8, "rtx"))
    assert kinds(p) == {"tiny": ("leave", None), "small": ("resize", 8), "big": ("resize", 8),
                        "other": ("leave", None)}
    assert p.blocked == {"tiny"} and p.committed_gpus == 27

    # one resize slot: half a cycle would leave both stuck, so neither is made (and each is blocked)
    p = run(("fast", 7, ("a0",)), ("slow", 16, ("r0", "r1")), free={"r0": 0, "r1": 0, "a0": 1, "t0": 4},
            config=pl.PlannerConfig(max_in_flight=1), fast=(16, "rtx"), slow=(8, "a100"))
    assert {j: k for j, (k, _) in kinds(p).items()} == {"fast": "leave", "slow": "leave"}
    assert p.blocked == {"fast", "slow"} and p.committed_gpus == 23

    # three jobs: big 8 A100 -> 16 RTX (+8: the count turns it away alone), mid 8 RTX -> 4 T4, small 8 RTX -> 8 A100
    p = run(("big", 8, ("a0",)), ("mid", 8, ("r0",)), ("small", 8, ("r1",)), free={"r0": 0, "r1": 0, "a0": 0, "t0": 4},
            big=(16, "rtx"), mid=(4, "t4"), small=(8, "a100"))
    assert kinds(p) == {"big": ("resize", 16), "mid": ("resize", 4), "small": ("resize", 8)}
    assert p.committed_gpus == 28 and not p.blocked

    # the same, but the T4 node is taken: mid cannot leave r0, so big has no place; small alone frees no GPU
    # it could take (a0 is big's): nothing is made, and each says why
    p = run(("big", 8, ("a0",)), ("mid", 8, ("r0",)), ("small", 8, ("r1",)), free={"r0": 0, "r1": 0, "a0": 0, "t0": 0},
            big=(16, "rtx"), mid=(4, "t4"), small=(8, "a100"))
    assert {j: k for j, (k, _) in kinds(p).items()} == {"big": "leave", "mid": "leave", "small": "leave"}
    assert p.blocked == {"big", "mid", "small"} and p.committed_gpus == 24
