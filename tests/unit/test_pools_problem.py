"""Issue 13 in build_problem: pools, a job's allowed pools, per-type models, rigid-job reservations,
time limits. Pure (records built by hand, as the backends' dialects produce them)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sim_helpers import LinearModel, toy_spec

from slurm_elastic.backends.base import JobRecord, NodeRecord
from slurm_elastic.pools import allowed_pools, group_pools, parse_constraint
from slurm_elastic.problem import build_problem
from slurm_elastic.profiles.gavel import gavel_model
from slurm_elastic.profiles.types import TYPE_SPEED
from slurm_elastic.spec import SpecError

MODEL = LinearModel()
SPEC = toy_spec(max_gpus=16, batch=16)
COMMENT = SPEC.to_comment()


def node(name, gpus=4, used=0, parts=("gpu",), gtype="", feats=(), resv=(), state="IDLE", flags=()):
    return NodeRecord(name, state, flags, gpus, used, 8, parts, gtype, tuple(feats), tuple(resv))


def job(i, state="PENDING", gpus=0, nodes=(), comment=COMMENT, held=True, part="gpu", **kw):
    gpn = kw.pop("gpn", None)
    if gpn is None:
        gpn = gpus // max(1, len(nodes)) if nodes else gpus
    n = kw.pop("n", max(1, len(nodes)))
    return JobRecord(job_id=i, name=f"j{i}", user="u", partition=part, state=state, gpus_per_node=gpn,
                     gpus_total=gpus, node_count=n, nodes=tuple(nodes), comment=comment, held=held,
                     priority=0 if held else kw.pop("priority", 100 - i), submit_time=i, **kw)


def build(jobs, nodes, model=MODEL, **kw):
    return build_problem(jobs, nodes, model_for=lambda r, s: model, now=1000.0, **kw)


TWO_POOLS = [node("a1", 4, parts=("a100",), gtype="a100"), node("a2", 4, parts=("a100",), gtype="a100"),
             node("v1", 8, parts=("v100",), gtype="v100"), node("v2", 8, parts=("v100",), gtype="v100")]


def test_pools_are_disjoint_groups_of_same_partitions_type_features_reservations():
    nodes = TWO_POOLS + [node("f1", 4, parts=("a100",), gtype="a100", feats=("ib",)),
                         node("r1", 4, parts=("a100",), gtype="a100", resv=("maint",))]
    pools = group_pools(nodes)
    assert [(p.name, p.nodes) for p in pools] == [
        ("a100:a100", ("a1", "a2")), ("v100:v100", ("v1", "v2")), ("a100:a100[ib]", ("f1",)),
        ("a100:a100@maint", ("r1",))]
    rec = job(1, part="a100,v100")
    assert allowed_pools(rec, pools) == ("a100:a100", "v100:v100", "a100:a100[ib]")
    assert allowed_pools(replace(rec, gpu_type="v100"), pools) == ("v100:v100",)
    assert allowed_pools(replace(rec, constraint="ib"), pools) == ("a100:a100[ib]",)
    assert allowed_pools(replace(rec, reservation="maint"), pools) == ("a100:a100@maint",)
    assert allowed_pools(job(2, part="v100"), pools) == ("v100:v100",)


@pytest.mark.parametrize("text", ["ib|eth", "[rack1|rack2]", "ib*2", "!ib", "a&(b)"])
def test_constraints_beyond_and_are_refused_naming_the_job(text):
    with pytest.raises(SpecError) as e:
        parse_constraint(text, 7)
    assert "job 7" in str(e.value) and "constraint" in str(e.value)
    assert parse_constraint("ib&nvlink", 7) == {"ib", "nvlink"}


def test_single_pool_gives_todays_problem():
    nodes = [node("n1"), node("n2"), node("n3", state="DOWN")]
    jobs = [job(1, "RUNNING", 4, ["n1"], held=False), job(2)]
    snap = build(jobs, nodes)
    assert snap.problem.pools == () and snap.problem.total_gpus == 8
    assert snap.problem.node_capacity == (("n1", 4), ("n2", 4))
    assert all(q.pools == () and q.pool == "" for q in snap.problem.jobs)


def test_two_pools_jobs_get_their_pools_and_per_type_models():
    gv = gavel_model("v100", "ResNet-50")
    jobs = [job(1, part="a100,v100"), job(2, part="v100"), job(3, "RUNNING", 4, ["a1"], held=False,
                                                                  part="a100,v100")]
    snap = build(jobs, TWO_POOLS, model=gv)
    prob = snap.problem
    assert [p.name for p in prob.pools] == ["a100:a100", "v100:v100"]
    assert [p.total_gpus for p in prob.pools] == [8, 16] and prob.total_gpus == 24
    q = {r.job_id: r for r in prob.jobs}
    assert q[1].pools == ("a100:a100", "v100:v100") and q[1].pool == ""
    # running: its pool first, then the others it may move to (issue 23)
    assert q[3].pools == ("a100:a100", "v100:v100") and q[3].pool == "a100:a100"
    # a100 has no Gavel table: the measured per-type prior scales the V100 table (issue 23: never unscaled)
    m = dict(q[1].pool_models)["a100:a100"]
    assert q[1].unscaled_pools == () and m.provenance == "type prior"
    assert m.samples_per_s(1, 1, 32) == pytest.approx(gv.samples_per_s(1, 1, 32) * TYPE_SPEED["a100"] / TYPE_SPEED["v100"])
    # a type nothing is known of: unscaled, and that is recorded
    odd = [n if n.gpu_type != "a100" else replace(n, gpu_type="h200") for n in TWO_POOLS]
    q1 = {r.job_id: r for r in build(jobs, odd, model=gv).problem.jobs}[1]
    assert q1.unscaled_pools == ("a100:h200",)


def test_gavel_job_gets_the_other_types_table():
    nodes = [node("k1", 4, parts=("p",), gtype="k80"), node("v1", 4, parts=("p",), gtype="v100")]
    gv = gavel_model("v100", "ResNet-50")
    snap = build([job(1, part="p")], nodes, model=gv)
    q = snap.problem.jobs[0]
    assert dict(q.pool_models) == {"p:k80": gavel_model("k80", "resnet50")} and q.unscaled_pools == ()


def test_job_no_pool_admits_is_its_error_and_others_go_on():
    jobs = [job(1, part="v100", gpu_type="h100"), job(2, part="v100", constraint="a|b"), job(3, part="v100")]
    snap = build(jobs, TWO_POOLS)
    assert set(snap.errors) == {1, 2}
    assert "gres type 'h100'" in str(snap.errors[1]) and snap.errors[1].field == "partition"
    assert snap.errors[2].field == "constraint"
    assert [q.job_id for q in snap.problem.jobs] == [3]


def test_drained_nodes_are_not_in_any_pool():
    nodes = TWO_POOLS[:3] + [node("v2", 8, parts=("v100",), gtype="v100", flags=("DRAIN",))]
    snap = build([job(1, part="v100")], nodes)
    assert dict(snap.problem.pools[1].node_capacity) == {"v1": 8}


def test_rigid_job_reserves_gpus_and_shrinks_the_elastic_jobs_on_them():
    # 4 x 4 GPUs, two elastic jobs of 8 each; a rigid 2 x 4 job arrives (the scenario)
    nodes = [node(f"n{i}", 4, used=4) for i in range(1, 5)]
    jobs = [job(1, "RUNNING", 8, ["n1", "n2"], held=False), job(2, "RUNNING", 8, ["n3", "n4"], held=False),
            job(9, "PENDING", 8, comment="", held=False, gpn=4, n=2, priority=500)]
    snap = build(jobs, nodes)
    res = snap.kept_for_rigid
    assert res.jobs[9][1] and len(res.jobs[9][1]) == 2 and sum(res.by_node.values()) == 8
    assert snap.problem.total_gpus == 8 and snap.capacity == 8
    caps = {q.job_id: q.spec.max_gpus for q in snap.problem.jobs}
    # the jobs on the reserved nodes are capped below their current 8 GPUs: the policy must shrink them
    on = {1: {"n1", "n2"}, 2: {"n3", "n4"}}
    for j in (1, 2):
        assert (caps[j] < 8) == bool(on[j] & set(res.jobs[9][1]))
    cap = dict(snap.problem.node_capacity)
    assert all(cap[n] == 0 for n in res.jobs[9][1])
    # nothing free there for elastic jobs; the elastic GPUs still on them count against the reservation
    # (4 used - 4 reserved of 4), so the planner's give-back of a leaving job frees nothing there
    assert all(snap.node_free[n] == -4 for n in res.jobs[9][1])


def test_rigid_job_that_cannot_fit_at_the_minimums_blocks_lower_ones_in_its_pools():
    spec = toy_spec(min_gpus=4, max_gpus=16, batch=16)
    nodes = [node(f"n{i}", 4, used=4) for i in range(1, 5)]
    jobs = [job(1, "RUNNING", 16, ["n1", "n2", "n3", "n4"], held=False, comment=spec.to_comment()),
            job(8, "PENDING", 16, comment="", held=False, gpn=4, n=4, priority=600),
            job(9, "PENDING", 4, comment="", held=False, gpn=4, n=1, priority=500)]
    snap = build(jobs, nodes)
    assert not snap.kept_for_rigid.by_node
    assert "elastic jobs at their minimums" in snap.kept_for_rigid.blocked[8]
    assert "higher-priority rigid job" in snap.kept_for_rigid.blocked[9]


def test_rigid_exclusive_takes_whole_nodes_and_held_rigid_jobs_are_ignored():
    nodes = [node("n1", 4, used=1), node("n2", 4, used=0), node("n3", 4, used=0)]
    jobs = [job(1, "RUNNING", 1, ["n1"], held=False),
            job(8, "PENDING", 2, comment="", held=True, gpn=2, n=1),  # held: Slurm will not start it
            job(9, "PENDING", 2, comment="", held=False, gpn=2, n=1, exclusive=True, priority=50)]
    snap = build(jobs, nodes)
    name, on = snap.kept_for_rigid.jobs[9]
    assert len(on) == 1 and on[0] in ("n2", "n3") and snap.kept_for_rigid.by_node[on[0]] == 4
    assert 8 not in snap.kept_for_rigid.jobs and 8 not in snap.kept_for_rigid.blocked


def test_time_limit_freezes_a_rescale_that_cannot_pay_back():
    nodes = [node("n1"), node("n2")]
    short = job(1, "RUNNING", 4, ["n1"], held=False, time_limit_s=600, start_time=1000 - 590)
    long = job(2, "RUNNING", 4, ["n2"], held=False, time_limit_s=86400, start_time=900)
    q = {r.job_id: r for r in build([short, long], nodes).problem.jobs}
    assert q[1].frozen and not q[2].frozen


def test_a_time_limit_stops_grows_that_cannot_pay_back_but_never_a_shrink_for_other_jobs():
    # Seen in CI: Slurm 22.05's backfill gives a job started without --time a one-year limit; a job holding
    # every GPU (no grow possible) was frozen for that whole year, so a pending job was never admitted.
    from slurm_elastic.policies import get_policy

    nodes = [node("n1", used=4), node("n2", used=4)]
    spec = toy_spec(min_gpus=1, max_gpus=8, batch=16)
    year = job(1, "RUNNING", 8, ["n1", "n2"], held=False, comment=spec.to_comment(), time_limit_s=365 * 86400,
               start_time=900)
    newcomer = job(2, "PENDING", 0, comment=toy_spec(min_gpus=2, max_gpus=4, batch=16).to_comment())
    snap = build([year, newcomer], nodes)
    q = {r.job_id: r for r in snap.problem.jobs}
    assert not q[1].frozen and q[1].spec.max_gpus == 8
    a = get_policy("dp").allocate(snap.problem)
    assert 1 <= a.jobs[1].gpus < 8 and a.jobs[2].gpus >= 2, a.jobs
    # 60 s left and a 45 s restart: no grow of a 2-GPU job repays (at most 4x for 15 s < 60 s at 1x), so
    # it is not grown; it is not frozen either (a shrink stays possible)
    short = job(3, "RUNNING", 2, ["n1"], held=False, comment=spec.to_comment(), time_limit_s=600,
                start_time=1000 - 540)
    q = {r.job_id: r for r in build([short], [node("n1"), node("n2")]).problem.jobs}
    assert not q[3].frozen and q[3].spec.max_gpus == 2


def test_rigid_jobs_waiting_for_something_else_than_gpus_get_no_reservation():
    nodes = [node(f"n{i}", 4, used=4) for i in range(1, 3)]
    jobs = [job(1, "RUNNING", 8, ["n1", "n2"], held=False),
            job(8, "PENDING", 4, comment="", held=False, gpn=4, n=1, priority=600, state_reason="Dependency"),
            job(9, "PENDING", 4, comment="", held=False, gpn=4, n=1, priority=500, state_reason="Resources")]
    res = build(jobs, nodes).kept_for_rigid
    assert 8 not in res.jobs and 8 not in res.blocked and 9 in res.jobs


def test_a_single_node_elastic_job_gives_up_part_of_its_node_for_a_rigid_job():
    nodes = [node("n1", 4, used=4)]
    jobs = [job(1, "RUNNING", 4, ["n1"], held=False),
            job(9, "PENDING", 1, comment="", held=False, gpn=1, n=1, priority=500)]
    snap = build(jobs, nodes)
    assert snap.kept_for_rigid.jobs[9] == ("gpu:gpu", ("n1",))
    assert snap.problem.jobs[0].spec.max_gpus == 3 and snap.problem.total_gpus == 3


def test_an_elastic_job_at_its_minimum_moves_off_the_node_a_rigid_job_needs():
    # The live scenario (tests/integration/test_pools_daemon.py): two 8-GPU nodes, an elastic job of 5 on
    # each (minimum 1). A rigid job needs a whole node: no shrink in place frees one, so one elastic job
    # must restart on the other node (3 free there), below its size, with the reserved node excluded.
    spec = toy_spec(min_gpus=1, max_gpus=8, batch=16)
    nodes = [node("v1", 8, used=5), node("v2", 8, used=5)]
    jobs = [job(1, "RUNNING", 5, ["v1"], held=False, comment=spec.to_comment()),
            job(2, "RUNNING", 5, ["v2"], held=False, comment=spec.to_comment()),
            job(9, "PENDING", 8, comment="", held=False, gpn=8, n=1, priority=500)]
    snap = build(jobs, nodes)
    res = snap.kept_for_rigid
    assert 9 in res.jobs, res.blocked
    (on,) = res.jobs[9][1]
    mover = 1 if on == "v1" else 2
    assert res.avoid == {mover: {on}}
    assert res.caps[mover] == 3  # what the other node leaves free, below its 5 (so it is resized)
    caps = {q.job_id: q.spec.max_gpus for q in snap.problem.jobs}
    assert caps[mover] == 3 and caps[3 - mover] == 8
    assert dict(snap.problem.node_capacity)[on] == 0 and snap.node_free[on] == -5


def test_a_job_that_cannot_restart_elsewhere_is_not_moved():
    # The other node has no GPU free for even the job's minimum: nothing is reserved, the rigid job waits.
    spec = toy_spec(min_gpus=2, max_gpus=8, batch=16)
    nodes = [node("v1", 8, used=8), node("v2", 8, used=7)]
    jobs = [job(1, "RUNNING", 8, ["v1"], held=False, comment=spec.to_comment()),
            job(2, "RUNNING", 7, ["v2"], held=False, comment=toy_spec(min_gpus=7, max_gpus=8, batch=16).to_comment()),
            job(9, "PENDING", 8, comment="", held=False, gpn=8, n=1, priority=500)]
    res = build(jobs, nodes).kept_for_rigid
    assert 9 not in res.jobs and not res.avoid and "minimums" in res.blocked[9]


def test_partition_maxnodes_caps_an_elastic_job_and_a_minimum_past_it_is_its_error():
    from slurm_elastic.backends.base import PartitionRecord

    nodes = [node(f"n{i}", 4) for i in range(1, 5)]
    wide = toy_spec(min_gpus=1, max_gpus=16, batch=16).to_comment()
    big = toy_spec(min_gpus=12, max_gpus=16, batch=16).to_comment()
    limits = {"gpu": PartitionRecord("gpu", max_nodes=2)}
    snap = build([job(1, comment=wide), job(2, comment=big)], nodes, partition_limits=limits)
    assert {q.job_id: q.spec.max_gpus for q in snap.problem.jobs} == {1: 8}  # 2 nodes x 4
    assert snap.errors[2].field == "min_gpus" and "MaxNodes=2" in str(snap.errors[2])
    assert {q.job_id for q in build([job(1, comment=wide)], nodes).problem.jobs} == {1}  # no limits: as before
    assert build([job(1, comment=wide)], nodes).problem.jobs[0].spec.max_gpus == 16


def test_an_elastic_exclusive_job_is_refused_naming_the_field_and_others_go_on():
    nodes = [node("n1"), node("n2")]
    snap = build([job(1, exclusive=True), job(2)], nodes)
    assert snap.errors[1].field == "exclusive" and "--exclusive" in str(snap.errors[1])
    assert [q.job_id for q in snap.problem.jobs] == [2]
