"""Issue 23: every job on the GPU type where it progresses fastest. Pure (records built by hand)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from sim_helpers import LinearModel, toy_spec

from slurm_elastic import planner as pl
from slurm_elastic.backends.base import JobRecord, NodeRecord
from slurm_elastic.policies.dp import DPPolicy
from slurm_elastic.problem import build_problem
from slurm_elastic.profiles.learned import learn
from slurm_elastic.profiles.parametric import Observation
from slurm_elastic.profiles.types import TYPE_SPEED, OnType, TypeRatios, measured_pairs, model_on_type
from slurm_elastic.spec import Decision, parse_decision

SPEC = toy_spec(min_gpus=1, max_gpus=4, batch=16)
NODES = [NodeRecord("t1", "IDLE", (), 4, 0, 8, ("t4",), "t4"), NodeRecord("a1", "IDLE", (), 4, 0, 8, ("a100",), "a100")]


def rec(i, state="PENDING", nodes=(), part="t4,a100", admin=""):
    gpus = 4 if nodes else 0
    return JobRecord(job_id=i, name=f"j{i}", user="u", partition=part, state=state, gpus_per_node=gpus,
                     gpus_total=gpus, node_count=1, nodes=tuple(nodes), comment=SPEC.to_comment(),
                     held=state == "PENDING", priority=0 if state == "PENDING" else 100, submit_time=i,
                     admin_comment=admin, start_time=0.0 if nodes else None)


def snap(jobs, model=None, **kw):
    m = model or LinearModel(100.0)
    return build_problem(jobs, NODES, model_for=lambda r, s: m, now=1000.0, default_restart_s=30.0, **kw)


def test_pending_job_prefers_the_fast_type():
    s = snap([rec(1)])
    q = s.problem.jobs[0]
    a100 = dict(q.pool_models)["a100:a100"]
    assert q.unscaled_pools == () and a100.provenance == "type prior"
    assert a100.samples_per_s(1, 1, 16) == pytest.approx(100.0 * TYPE_SPEED["a100"])
    alloc = DPPolicy().allocate(s.problem)
    assert alloc.jobs[1].pool == "a100:a100" and alloc.jobs[1].gpus == 4
    assert "(speed on a100: type prior)" in alloc.jobs[1].reason  # provenance, shown by status


def test_reports_on_t4_are_scaled_on_a100_not_used_as_is():
    obs = [Observation(1, 1, 16, 1, 50.0), Observation(2, 1, 8, 1, 95.0)]
    m = learn(LinearModel(100.0), "prior", obs)
    m.gpu_type = "t4"
    on_a100 = model_on_type(m, "a100")
    assert isinstance(on_a100, OnType) and on_a100.provenance == "type prior"
    assert on_a100.samples_per_s(1, 1, 16) == pytest.approx(m.samples_per_s(1, 1, 16) * TYPE_SPEED["a100"])
    # the cluster's own jobs: a100 ran 3x a T4 for three jobs -> learned ratio, shrunk toward the prior
    ratios = TypeRatios()
    for j in range(3):
        ratios.observe(j, "t4", "a100", 3.0)
    r, why = ratios.ratio("t4", "a100")
    assert why == "type ratio from 3 jobs" and TYPE_SPEED["a100"] < r < 3.0
    assert ratios.ratio("a100", "t4")[0] == pytest.approx(1 / r)
    assert model_on_type(m, "a100", ratios=ratios).provenance == "type ratio from 3 jobs"
    # its own reports on a100 win over any ratio
    m.by_type["a100"] = learn(LinearModel(100.0), "prior", [Observation(1, 1, 16, 1, 400.0)])
    assert model_on_type(m, "a100", ratios=ratios) is m.by_type["a100"]
    # a ratio measured from one job's reports on both types, at the configurations both ran
    pairs = measured_pairs({"t4": obs, "a100": [Observation(1, 1, 16, 1, 150.0)]})
    assert pairs == {("a100", "t4"): pytest.approx(50.0 / 150.0)}


def test_running_job_moves_to_the_fast_type_when_it_frees():
    running = rec(1, "RUNNING", nodes=("t1",))
    s = snap([running])
    q = s.problem.jobs[0]
    assert q.pool == "t4:t4" and q.pools == ("t4:t4", "a100:a100")
    alloc = DPPolicy().allocate(s.problem)
    a = alloc.jobs[1]
    assert a.pool == "a100:a100" and "moved from t4:t4" in a.reason
    p = pl.plan(alloc, s.views, {}, 1000.0, capacity=s.capacity, node_size=4, node_free=s.node_free,
                pools=s.problem.pools)
    (rz,) = p.of_kind("resize")
    # pinned by partition (each partition holds one type), the gres untouched, the other partition kept
    assert rz.partition == "a100" and rz.gpu_type is None and rz.decision.parts == ("t4", "a100")
    # Slurm now shows only the pinned partition: the decision gives the job its partitions back
    back = rec(1, "RUNNING", nodes=("a1",), part="a100", admin=rz.decision.to_admin_comment())
    q2 = snap([back]).problem.jobs[0]
    assert q2.pool == "a100:a100" and q2.pools == ("a100:a100", "t4:t4")


def test_a_move_says_from_where_to_where_and_what_it_does_to_the_job():
    """status shows a move as a move: the pool's own reason began "admitted: 4 GPUs", which read as a
    start (on Sia's cluster a job moved off 16 T4s onto 2 RTX showed only "admitted: 2 GPUs")."""
    running = rec(1, "RUNNING", nodes=("t1",), admin=Decision(4, 1, 16, 4).to_admin_comment())
    a = DPPolicy().allocate(snap([running]).problem).jobs[1]
    gain = 100.0 * (TYPE_SPEED["a100"] - 1.0)
    assert a.pool == "a100:a100" and a.gpus == 4
    assert a.reason.startswith(f"moved from t4:t4 (4 GPUs) to a100:a100 (4 GPUs): {gain:+.0f}% samples/s, "
                               "a restart; there: 4 GPUs"), a.reason
    assert "admitted" not in a.reason and "higher-value" not in a.reason
    # a move that runs it slower (fewer GPUs of a faster type) says where its GPUs went
    from slurm_elastic.policies._multipool import _move_reason

    req = snap([running]).problem.jobs[0]
    slower = replace(a, gpus=1, samples_per_s=0.1 * a.samples_per_s, reason="admitted: 1 GPU (its minimum)")
    why = _move_reason(req, slower, "t4:t4", "a100:a100", 4)
    assert why.startswith("moved from t4:t4 (4 GPUs) to a100:a100 (1 GPU): ") and \
        "% samples/s, its GPUs to higher-value jobs, a restart; there: 1 GPU (its minimum)" in why, why


def test_a_move_pays_its_restart():
    # the a100 is busy with a rigid job: no move; a restart that costs most of the job's life: no move
    busy = [NODES[0], NodeRecord("a1", "MIXED", (), 4, 4, 8, ("a100",), "a100")]
    rigid = JobRecord(job_id=9, name="r", user="u", partition="a100", state="RUNNING", gpus_per_node=4,
                      gpus_total=4, node_count=1, nodes=("a1",), comment="", held=False, priority=1,
                      submit_time=0)
    s = build_problem([rec(1, "RUNNING", nodes=("t1",)), rigid], busy, model_for=lambda r, s: LinearModel(100.0),
                      now=1000.0)
    assert DPPolicy().allocate(s.problem).jobs[1].pool == "t4:t4"
    s = build_problem([rec(1, "RUNNING", nodes=("t1",))], NODES, model_for=lambda r, s: LinearModel(100.0),
                      now=1000.0, default_restart_s=3500.0)
    assert DPPolicy().allocate(s.problem).jobs[1].pool == "t4:t4"


def test_decision_keeps_the_submitted_partitions():
    d = Decision(4, 1, 16, 4, 1, 3, parts=("t4", "a100"))
    text = d.to_admin_comment()
    assert text.endswith(",parts=t4+a100") and parse_decision(text, 1) == d
    assert Decision(**{**d.__dict__, "parts": ["t4", "a100"]}) == d  # read back from JSON (a list)
    assert parse_decision(Decision(4, 1, 16, 4).to_admin_comment(), 1).parts == ()


def test_a_move_frees_its_nodes_for_a_job_that_may_only_use_the_slow_type():
    s = snap([rec(1, "RUNNING", nodes=("t1",)), rec(2, part="t4")])
    alloc = DPPolicy().allocate(s.problem)
    assert (alloc.jobs[1].pool, alloc.jobs[1].gpus) == ("a100:a100", 4)
    assert (alloc.jobs[2].pool, alloc.jobs[2].gpus) == ("t4:t4", 4)  # on the GPUs job 1 leaves
    assert alloc.bound is not None and alloc.objective <= alloc.bound + 1e-9


def test_per_type_batch_limit_runs_a_larger_micro_batch_on_the_larger_gpu():
    from slurm_elastic.spec import ElasticSpec, SpecError, parse_spec

    spec = ElasticSpec(min_gpus=1, max_gpus=1, min_batch=64, max_batch=64, max_local_batch=64, batch=64,
                       max_accum=4, local_batch_by_type=(("t4", 16),))
    assert parse_spec(spec.to_comment()) == spec and "local_batch_by_type=t4:16" in spec.to_comment()
    with pytest.raises(SpecError) as e:
        parse_spec(spec.to_comment().replace("t4:16", "t4:128"))  # above max_local_batch (the largest type's)
    assert e.value.field == "local_batch_by_type"
    got = {}
    for part in ("t4", "a100"):
        r = JobRecord(job_id=1, name="j", user="u", partition=part, state="PENDING", gpus_per_node=0,
                      gpus_total=0, node_count=1, nodes=(), comment=spec.to_comment(), held=True, priority=0,
                      submit_time=1)
        a = DPPolicy().allocate(snap([r]).problem).jobs[1]
        got[part] = (a.gpus, a.local_batch, a.accum)
    assert got == {"t4": (1, 16, 4), "a100": (1, 64, 1)}


def test_one_partition_of_several_types_moves_by_excluding_the_other_types_nodes():
    from slurm_elastic import enact

    nodes = [NodeRecord("t1", "MIXED", (), 4, 4, 8, ("gpu",), "t4"), NodeRecord("a1", "IDLE", (), 4, 0, 8, ("gpu",), "a100")]
    r = rec(1, "RUNNING", nodes=("t1",), part="gpu")  # untyped --gres=gpu:4, as submitted
    s = build_problem([r], nodes, model_for=lambda r, s: LinearModel(100.0), now=1000.0, default_restart_s=30.0)
    assert s.problem.jobs[0].pools == ("gpu:t4", "gpu:a100")
    alloc = DPPolicy().allocate(s.problem)
    p = pl.plan(alloc, s.views, {}, 1000.0, capacity=s.capacity, node_size=4, node_free=s.node_free,
                pools=s.problem.pools)
    (rz,) = p.of_kind("resize")
    assert rz.gpu_type is None and rz.partition is None and rz.exclude_nodes == ("t1",)

    class Book:
        excluded: set = set()

    # a rigid job's reservation adds its nodes; the pool pin is kept
    out = enact._exclude_reserved(p, {"a9": 4}, Book())
    assert out.of_kind("resize")[0].exclude_nodes == ("a9", "t1")


def test_site_gpu_speeds_replace_the_prior_and_are_checked():
    from slurm_elastic.daemon.config import ConfigError, config_from_dict

    cfg = config_from_dict({"gpu_speed": {"A100": 3, "v100": 1.0}})
    assert cfg.gpu_speed == {"a100": 3.0, "v100": 1.0}
    r = TypeRatios(cfg.gpu_speed)
    assert r.ratio("v100", "a100") == (pytest.approx(3.0), "type prior")
    for bad in ({"a100": 0}, {"a100": float("nan")}, {"a 100": 1.0}, {"a100": True}, [1.0], {"a100": 1e9},
                {"a100\n": 1.0}):
        with pytest.raises(ConfigError, match="gpu_speed"):
            config_from_dict({"gpu_speed": bad})


def test_multi_node_job_grows_on_whole_nodes_of_its_type():
    spec = toy_spec(min_gpus=4, max_gpus=16, batch=64)
    nodes = [NodeRecord(f"a{i}", "ALLOCATED" if i < 2 else "IDLE", (), 4, 4 if i < 2 else 0, 8, ("gpu",), "a100")
             for i in range(4)] + [NodeRecord(f"t{i}", "IDLE", (), 4, 0, 8, ("gpu",), "t4") for i in range(4)]
    r = JobRecord(job_id=1, name="j", user="u", partition="gpu", state="RUNNING", gpus_per_node=4, gpus_total=8,
                  node_count=2, nodes=("a0", "a1"), comment=spec.to_comment(), held=False, priority=1,
                  submit_time=0, start_time=0.0)
    s = build_problem([r], nodes, model_for=lambda r, s: LinearModel(100.0), now=1000.0, default_restart_s=5.0)
    a = DPPolicy().allocate(s.problem).jobs[1]
    assert (a.gpus, a.nodes, a.pool) == (16, 4, "gpu:a100")
    p = pl.plan(DPPolicy().allocate(s.problem), s.views, {}, 1000.0, capacity=s.capacity, node_size=4,
                node_free=s.node_free, pools=s.problem.pools)
    (rz,) = p.of_kind("resize")
    assert (rz.gpus, rz.nodes, rz.gpus_per_node) == (16, 4, 4)
    assert rz.exclude_nodes == ("t0", "t1", "t2", "t3")  # whole nodes of its own type only


def test_a_running_job_never_moves_to_a_slower_type():
    # job 2 may only use the a100; job 1 runs there: moving job 1 to the T4 would free the a100, but a
    # move goes only to a type at least MOVE_MIN_GAIN faster (no job is sent down and held there)
    s = snap([rec(1, "RUNNING", nodes=("a1",)), rec(2, part="a100")])
    alloc = DPPolicy().allocate(s.problem)
    assert alloc.jobs[1].pool == "a100:a100" and "moved" not in alloc.jobs[1].reason


def test_type_ratios_by_family_by_weight_and_under_other_names():
    """Sia's names (aws, dgx-ext) are the same GPUs as t4, a100; a family's own ratio comes before the
    cluster's (an A100 is 0.94x to 4.07x a T4 depending on the model); a profile may weigh several jobs."""
    r = TypeRatios()
    assert r.ratio("aws", "dgx-ext") == (pytest.approx(TYPE_SPEED["a100"]), "type prior")
    r.observe(1, "aws", "dgx-ext", 4.0, family="bert")
    r.observe(2, "t4", "a100", 1.0, family="ncf")
    cluster, why = r.ratio("t4", "a100")
    assert why == "type ratio from 2 jobs" and cluster == pytest.approx(
        math.exp((math.log(4.0) + 2 * math.log(TYPE_SPEED["a100"])) / 4))
    bert, why = r.ratio("t4", "a100", "bert")
    assert why == "type ratio from 1 bert job (type ratio from 2 jobs)" and cluster < bert < 4.0
    assert r.ratio("t4", "a100", "ncf")[0] < cluster < bert
    r.observe(3, "aws", "dgx-ext", 4.0, family="bert", weight=6.0)  # a profile: weighs more
    assert r.ratio("t4", "a100", "bert")[0] > bert
    assert r.ratio("a100", "t4", "bert")[0] == pytest.approx(1 / r.ratio("t4", "a100", "bert")[0])


def test_one_user_cannot_move_the_type_ratio_other_users_jobs_are_told():
    """A user who runs slowly on A100s on purpose (50 jobs, ratio 0.01, under a family other users run)
    is one vote: among three users the median is an honest one's; alone besides the asker, half-way to
    the prior at most, never beyond USER_RATIO_SPAN of it. One user alone (the simulator's case) gets the
    plain weighted mean, as before."""
    from slurm_elastic.profiles.types import USER_RATIO_SPAN

    prior = TYPE_SPEED["a100"] / TYPE_SPEED["t4"]
    r = TypeRatios()
    r.observe(1, "t4", "a100", 3.0, family="bert", user="alice")
    r.observe(2, "t4", "a100", 3.2, family="bert", user="bob")
    for j in range(10, 60):
        r.observe(j, "t4", "a100", 0.01, family="bert", user="mallory")
    for asker in ("alice", "bob", "carol"):
        assert 2.9 <= r.ratio("t4", "a100", user=asker)[0] <= 3.2  # an honest user's, a little toward the prior
        assert r.ratio("t4", "a100", "bert", user=asker)[0] >= 2.9  # the family level too
    assert r.ratio("t4", "a100", "bert", user="mallory")[0] >= 2.9  # its own mean is one vote for its jobs too
    only = TypeRatios()  # mallory's jobs only: what alice's bert job is told
    for j in range(10, 60):
        only.observe(j, "t4", "a100", 0.01, family="bert", user="mallory")
    told = only.ratio("t4", "a100", "bert", user="alice")[0]
    assert told >= math.sqrt(prior * prior / USER_RATIO_SPAN) * 0.99  # half-way (in logs) to the clipped claim
    alone = TypeRatios()
    alone.observe(1, "t4", "a100", 3.0)
    alone.observe(2, "t4", "a100", 1.0)
    assert alone.ratio("t4", "a100")[0] == pytest.approx(math.exp((math.log(3.0) + 2 * math.log(prior)) / 4))


def test_a_job_squeezed_on_the_fast_type_moves_to_more_gpus_of_a_slower_one():
    """A job held at 1 A100 (a rigid job has the other 3) while 8 T4s are free: 4 T4s run it faster than
    its one A100 by its models (x1.65 by the prior), so it moves; never to fewer, slower GPUs."""
    nodes = [NodeRecord("t1", "IDLE", (), 4, 0, 8, ("t4",), "t4"), NodeRecord("t2", "IDLE", (), 4, 0, 8, ("t4",), "t4"),
             NodeRecord("a1", "MIXED", (), 4, 4, 8, ("a100",), "a100")]
    rigid = JobRecord(job_id=9, name="r", user="u", partition="a100", state="RUNNING", gpus_per_node=3,
                      gpus_total=3, node_count=1, nodes=("a1",), comment="", held=False, priority=1, submit_time=0)
    one = JobRecord(job_id=1, name="j1", user="u", partition="t4,a100", state="RUNNING", gpus_per_node=1,
                    gpus_total=1, node_count=1, nodes=("a1",), comment=SPEC.to_comment(), held=False, priority=100,
                    submit_time=1, start_time=0.0)
    s = build_problem([one, rigid], nodes, model_for=lambda r, s: LinearModel(100.0), now=1000.0,
                      default_restart_s=30.0)
    a = DPPolicy().allocate(s.problem).jobs[1]
    assert a.pool == "t4:t4" and a.gpus == 4 and "moved from a100:a100" in a.reason
    # with only 1 T4 free it stays on its A100 (one T4 is slower than one A100)
    busy_t4 = [NodeRecord("t1", "MIXED", (), 4, 3, 8, ("t4",), "t4"), nodes[2]]
    other = JobRecord(job_id=8, name="r2", user="u", partition="t4", state="RUNNING", gpus_per_node=3, gpus_total=3,
                      node_count=1, nodes=("t1",), comment="", held=False, priority=1, submit_time=0)
    s = build_problem([one, rigid, other], busy_t4, model_for=lambda r, s: LinearModel(100.0), now=1000.0,
                      default_restart_s=30.0)
    assert DPPolicy().allocate(s.problem).jobs[1].pool == "a100:a100"


def test_type_ratios_survive_a_daemon_restart_and_junk_rows_are_dropped():
    import json

    r = TypeRatios()
    r.observe(1, "t4", "a100", 3.0, family="bert", user="alice")
    r.observe(2, "t4", "a100", 2.0, family="bert", weight=4.0, user="bob")
    r.observe(3, "rtx", "a100", 1.5)
    back = TypeRatios()
    back.load_json(json.loads(json.dumps(r.to_json())), most=10)
    for fam, user in (("bert", "alice"), ("bert", "carol"), ("", "")):
        assert back.ratio("t4", "a100", fam, user) == r.ratio("t4", "a100", fam, user)
    assert back.ratio("rtx", "a100") == r.ratio("rtx", "a100")
    bad = [[9, "bert", 1.0, "eve", [["t4", "a100", float("nan")], ["t4", "a100", -2.0], ["t4", 5, 2.0]]],
           [10, "bert", float("inf"), "eve", [["t4", "a100", 9.0]]], [True, "", 1.0, "", []], "row",
           [11, "x" * 300, 1.0, "", [["t4", "a100", 9.0]]]]
    j = TypeRatios()
    j.load_json(bad, most=10)
    assert j.to_json() == []
    j.load_json(r.to_json(), most=1)  # the last ones only
    assert [row[0] for row in j.to_json()] == [3]
