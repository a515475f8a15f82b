"""The elastic spec parser: strict, with errors that name the job and the field; never another exception."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_elastic.spec import (
    Decision,
    ElasticSpec,
    SpecError,
    ThroughputPoint,
    is_elastic_comment,
    parse_decision,
    parse_spec,
    validate_spec,
)

BASE = "elastic:min_gpus=1,max_gpus=8,min_batch=128,max_batch=4096,max_local_batch=512"


def test_parses_the_documented_example():
    spec = parse_spec(BASE, job_id=7)
    assert spec == ElasticSpec(min_gpus=1, max_gpus=8, min_batch=128, max_batch=4096, max_local_batch=512)
    assert spec.requested_batch == 128 and spec.requested_gpus == 1


def test_optional_fields_and_points():
    spec = parse_spec(BASE + ",batch=256,gpus=2,gpus_per_node=2,profile=cifar10,weight=2.5,max_accum=4,"
                             "min_local_batch=8,restart_s=40,points=1x256@100|2x256@190.5")
    assert spec.batch == 256 and spec.gpus == 2 and spec.gpus_per_node == 2 and spec.profile == "cifar10"
    assert spec.weight == 2.5 and spec.max_accum == 4 and spec.min_local_batch == 8 and spec.restart_s == 40
    assert spec.points == (ThroughputPoint(1, 256, 100.0), ThroughputPoint(2, 256, 190.5))


def test_checkpoint_dir_expands_the_job_id():
    spec = parse_spec(BASE + ",ckpt_dir=/scratch/ckpt/%j")
    assert spec.checkpoint_dir(77) == "/scratch/ckpt/77" and parse_spec(spec.to_comment()) == spec
    assert parse_spec(BASE).checkpoint_dir(77) is None


def test_round_trip_through_comment():
    spec = parse_spec(BASE + ",batch=256,profile=bert,weight=3,points=2x256@5e2")
    assert parse_spec(spec.to_comment()) == spec


@pytest.mark.parametrize(
    "comment, field",
    [
        (BASE + ",colour=blue", "colour"),
        (BASE.replace("max_gpus=8", "max_gpus=eight"), "max_gpus"),
        (BASE.replace("max_gpus=8", "max_gpus=2.5"), "max_gpus"),
        (BASE.replace("max_gpus=8", "max_gpus=-1"), "max_gpus"),
        (BASE.replace("min_gpus=1", "min_gpus=9"), "min_gpus"),
        (BASE.replace("min_batch=128", "min_batch=8192"), "min_batch"),
        (BASE.replace(",max_local_batch=512", ""), "max_local_batch"),
        (BASE + ",batch=100000", "batch"),
        (BASE + ",gpus=16", "gpus"),
        (BASE + ",min_gpus=2", "min_gpus"),
        (BASE + ",weight=0", "weight"),
        (BASE + ",profile=a;rm -rf /", "profile"),
        (BASE + ",points=2x256", "points"),
        (BASE.replace("max_batch=4096", "max_batch=1000000000000000000"), "max_batch"),
        ("elastic:min_gpus=1,max_gpus=8,min_batch=4096,max_batch=4096,max_local_batch=256", "max_batch"),
        ("elastic:min_gpus=3,max_gpus=3,min_batch=100,max_batch=101,max_local_batch=512", "max_batch"),
        (BASE + ",gpus_per_node=16", "gpus_per_node"),
        (BASE + ",batch", "batch"),
        (BASE + ",ckpt_dir=relative/path", "ckpt_dir"),
        (BASE + ",ckpt_dir=/a/../etc", "ckpt_dir"),
        (BASE + ",ckpt_dir=/tmp/$(id)", "ckpt_dir"),
        (BASE + ",ckpt_dir=/tmp/%u", "ckpt_dir"),
    ],
)
def test_errors_name_the_job_and_field(comment, field):
    with pytest.raises(SpecError) as e:
        parse_spec(comment, job_id=42)
    assert e.value.field == field
    assert e.value.job_id == 42
    assert "job 42" in str(e.value) and f"'{field}'" in str(e.value)


def test_unreachable_batch_with_accumulation_becomes_reachable():
    # 1 GPU x 256 per-GPU limit cannot reach 1024 without accumulation; with max_accum=4 it can.
    tight = "elastic:min_gpus=1,max_gpus=1,min_batch=1024,max_batch=1024,max_local_batch=256"
    with pytest.raises(SpecError):
        parse_spec(tight)
    spec = parse_spec(tight + ",max_accum=4")
    assert spec.split_batch(1, 1024) == (256, 4)


def test_allowed_gpu_counts_follow_node_shape():
    spec = parse_spec("elastic:min_gpus=1,max_gpus=16,min_batch=16,max_batch=4096,max_local_batch=512")
    assert spec.allowed_gpu_counts(4) == [1, 2, 3, 4, 8, 12, 16]
    assert spec.placement(3, 4) == (1, 3) and spec.placement(12, 4) == (3, 4)
    shaped = parse_spec("elastic:min_gpus=1,max_gpus=16,min_batch=16,max_batch=4096,max_local_batch=512,gpus_per_node=2")
    assert shaped.allowed_gpu_counts(4) == [2, 4, 6, 8, 10, 12, 14, 16]
    assert shaped.placement(6, 4) == (3, 2)
    with pytest.raises(ValueError):
        spec.placement(6, 4)


def test_split_batch_rules():
    spec = parse_spec(BASE + ",max_accum=2,min_local_batch=16")
    assert spec.split_batch(4, 1024) == (256, 1)
    assert spec.split_batch(1, 1024) == (512, 2)
    assert spec.split_batch(3, 1024) is None  # not divisible
    assert spec.split_batch(1, 4096) is None  # needs 8 accumulation steps
    assert spec.split_batch(8, 127) is None  # below min_batch
    assert spec.split_batch(16, 128) is None  # 8 per GPU < min_local_batch
    assert spec.feasible_batches(8)[:3] == [128, 136, 144]


def test_node_size_validation():
    spec = parse_spec(BASE + ",gpus_per_node=8")
    validate_spec(spec, 1, node_size=8)
    with pytest.raises(SpecError) as e:
        validate_spec(spec, 1, node_size=4)
    assert e.value.field == "gpus_per_node"


def test_is_elastic_comment():
    assert is_elastic_comment(BASE) and is_elastic_comment("  elastic:junk")
    assert not is_elastic_comment("") and not is_elastic_comment(None) and not is_elastic_comment("my run")


def test_decision_round_trip_and_tampering():
    d = Decision(gpus=8, nodes=2, batch=512, local_batch=64, accum=1, seq=3)
    assert parse_decision(d.to_admin_comment(), 5) == d
    assert parse_decision("", 5) is None and parse_decision("site note", 5) is None
    for bad in [
        "elastic-decision:gpus=8,nodes=2,batch=500,local_batch=64",  # inconsistent product
        "elastic-decision:gpus=8,nodes=2,batch=512",  # missing local_batch
        "elastic-decision:gpus=x,nodes=2,batch=512,local_batch=64",
        "elastic-decision:gpus=8,nodes=2,batch=512,local_batch=64,evil=1",
        "elastic-decision:gpus=0,nodes=2,batch=0,local_batch=64",
    ]:
        with pytest.raises(SpecError) as e:
            parse_decision(bad, 5)
        assert e.value.field == "admin_comment" and e.value.job_id == 5


KEYS = ["min_gpus", "max_gpus", "min_batch", "max_batch", "max_local_batch", "batch", "gpus", "profile", "points",
        "weight", "max_accum", "gpus_per_node", "restart_s", "min_local_batch", "ckpt_dir", "x", "", "=", "elastic"]
values = st.one_of(
    st.integers(min_value=-10, max_value=10**20).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.text(max_size=20),
    st.sampled_from(["/tmp/%j", "/a/../b", "1x2@3", "1x2@3|4x5@6", "$(reboot)", "`id`", ";", "ü", "1e400", "nan", "0"]),
)
items = st.tuples(st.sampled_from(KEYS) | st.text(max_size=8), values).map(lambda kv: f"{kv[0]}={kv[1]}")
comments = st.one_of(
    st.text(max_size=200),
    st.lists(items, max_size=12).map(lambda xs: "elastic:" + ",".join(xs)),
    st.lists(items, max_size=12).map(lambda xs: BASE + "," + ",".join(xs)),
)


@settings(max_examples=1500, deadline=None)
@given(comments)
def test_parser_never_raises_anything_but_spec_error(comment):
    try:
        spec = parse_spec(comment, job_id=1)
    except SpecError as e:
        assert e.job_id == 1 and e.field
        return
    # Whatever parses is self-consistent and round-trips.
    assert spec.min_gpus <= spec.max_gpus and spec.min_batch <= spec.max_batch
    assert parse_spec(spec.to_comment(), job_id=1) == spec


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=120))
def test_decision_parser_never_raises_anything_but_spec_error(text):
    try:
        parse_decision("elastic-decision:" + text, 9)
    except SpecError as e:
        assert e.job_id == 9


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 16), st.integers(1, 64), st.integers(1, 4096), st.integers(1, 4096), st.integers(1, 512),
       st.integers(1, 8))
def test_split_batch_results_are_feasible(min_g, span, b1, b2, local, accum):
    lo, hi = sorted((b1, b2))
    spec = ElasticSpec(min_gpus=min_g, max_gpus=min_g + span, min_batch=lo, max_batch=hi, max_local_batch=local,
                       max_accum=accum)
    for k in (min_g, min_g + span // 2, min_g + span):
        for b in spec.feasible_batches(k)[:50]:
            local_b, a = spec.split_batch(k, b)
            assert k * local_b * a == b and local_b <= local and a <= accum and lo <= b <= hi
