"""Issue 13's Slurm edge, unit level: pool fields parsed from real captures of both dialects, the
``scontrol -o`` text readers, hostile values, and the two-pool LocalCluster layout.

The captures (tests/fixtures/pools-<version>/) come from ``scripts/capture_fixtures.py --pools`` on the
two-pool local cluster; their MANIFEST.json says what each job and node must read as.
"""

import json
from pathlib import Path

import pytest

from slurm_elastic.backends.base import SlurmParseError, preemption_refusal
from slurm_elastic.backends.cli import attach_reservations
from slurm_elastic.backends.dialects import (
    gpu_type_in_tres,
    gpus_in_tres,
    parse_config,
    parse_job,
    parse_jobs,
    parse_node,
    parse_nodes,
    parse_oneliners,
    parse_partitions,
    parse_reservations,
    slurm_duration_seconds,
    time_limit_seconds,
)
from slurm_elastic.cluster import TWO_POOLS, ClusterConfig, ClusterError, parse_pools

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
POOLS = sorted(p for p in FIXTURES.glob("pools-*") if (p / "MANIFEST.json").exists())


def test_pool_captures_exist_for_both_dialects():
    assert {p.name for p in POOLS} >= {"pools-22.05", "pools-24.11"}, "run scripts/capture_fixtures.py --pools --slurm all"


@pytest.mark.parametrize("capture", POOLS, ids=lambda p: p.name)
def test_pool_captures_parse_to_what_the_manifest_says(capture):
    m = json.loads((capture / "MANIFEST.json").read_text())
    jobs = {j.job_id: j for j in parse_jobs(json.loads((capture / "squeue_pools.json").read_text()))}
    for jid, want in m["jobs"].items():
        job = jobs[int(jid)]
        for key, value in want.items():
            got = getattr(job, key)
            assert (list(got) if isinstance(got, tuple) else got) == value, (capture.name, jid, key, got)
    resv = parse_reservations((capture / "reservations_pools.txt").read_text())
    nodes = {n.name: n for n in attach_reservations(parse_nodes(json.loads((capture / "nodes_pools.json").read_text())),
                                                    resv)}
    for name, want in m["nodes"].items():
        for key, value in want.items():
            got = getattr(nodes[name], key)
            assert (list(got) if isinstance(got, tuple) else got) == value, (capture.name, name, key, got)
    parts = {p.name: p for p in parse_partitions((capture / "partitions_pools.txt").read_text())}
    for name, want in m["partitions"].items():
        for key, value in want.items():
            got = getattr(parts[name], key)
            assert (list(got) if isinstance(got, tuple) else got) == value, (capture.name, name, key, got)
    assert preemption_refusal(parse_config((capture / "config_pools.txt").read_text())) is None


def test_gpu_types_and_counts_in_every_spelling():
    cases = {
        "gres:gpu:a100:2": ("a100", 2), "gres/gpu:a100:2": ("a100", 2), "gpu:a100:4(S:0)": ("a100", 4),
        "gpu:a100:4(IDX:0-3)": ("a100", 4), "gpu:4(S:0-1)": ("", 4), "gres/gpu:2": ("", 2), "gres/gpu=3": ("", 3),
        "gpu:1080:2": ("1080", 2), "gres/gpu:a100:1,gres/gpu:v100:1": ("a100,v100", 2),
        "gpu:tesla_v100-sxm2:8": ("tesla_v100-sxm2", 8), "nic:1": ("", None), "": ("", None), None: ("", None),
        # Does not parse: no type and no count are guessed.
        "gpu:a100:x": ("", None), "gpu:": ("", None), "gpu::2": ("", None), "gres/gpu:a1 00:2": ("", None),
    }
    for text, (kind, count) in cases.items():
        assert (gpu_type_in_tres(text), gpus_in_tres(text)) == (kind, count), text
    with pytest.raises(SlurmParseError):
        gpu_type_in_tres(["gpu:a100:2"])


def test_time_limits_hostile_values_read_as_no_limit_or_a_clear_error():
    assert time_limit_seconds(30, what="t") == 1800
    assert time_limit_seconds({"set": True, "infinite": False, "number": 120}, what="t") == 7200
    for unlimited in (None, 0, -5, {"set": False, "infinite": True, "number": 0}, {"set": True, "number": -1},
                      2**32 - 1, 2**32 - 2, float("nan"), float("inf"), "Infinity", 10**12):
        assert time_limit_seconds(unlimited, what="t") is None, unlimited
    for bad in ("30", "soon", True, [30]):
        with pytest.raises(SlurmParseError, match="job 9: time_limit"):
            time_limit_seconds(bad, what="job 9: time_limit")


def test_slurm_durations():
    assert [slurm_duration_seconds(t) for t in ("2:00:00", "1-00:00:00", "30:00", "45", "1-12", "1-2:03",
                                                "UNLIMITED", "NONE", "")] == [
        7200, 86400, 1800, 2700, 129600, 93780, None, None, None]
    for bad in ("2h", "-1", "1:2:3:4", "a-1"):
        with pytest.raises(SlurmParseError):
            slurm_duration_seconds(bad)


def test_exclusive_constraint_and_reservation_from_job_fields():
    doc = json.loads((FIXTURES / "pools-22.05" / "squeue_pools.json").read_text())
    base = doc["jobs"][0]
    for shared, excl in (("none", True), ("user", True), ("mcs", True), ("oversubscribe", False), (None, False),
                         (["none"], True), ([], False), (["oversubscribe"], False)):
        assert parse_job(dict(base, shared=shared)).exclusive is excl, shared
    with pytest.raises(SlurmParseError, match="shared"):
        parse_job(dict(base, shared=7))
    with pytest.raises(SlurmParseError, match="features"):
        parse_job(dict(base, features=["a100"]))
    with pytest.raises(SlurmParseError, match="resv_name"):
        parse_job(dict(base, resv_name=5))
    # A gres string that does not parse: no GPUs and no type, never a crash.
    job = parse_job(dict(base, tres_per_node="gres:gpu:a100:lots", gres_detail=[]))
    assert (job.gpu_type, job.gpus_per_node) == ("", 0)


def test_node_features_and_reservation_fields_of_both_shapes():
    doc = json.loads((FIXTURES / "pools-24.11" / "nodes_pools.json").read_text())
    node = doc["nodes"][0]
    assert parse_node(dict(node, active_features="a100,ib")).features == ("a100", "ib")
    assert parse_node(dict(node, active_features=None, reservation="r1")).features == ()
    assert parse_node(dict(node, reservation="r1")).reservations == ("r1",)
    with pytest.raises(SlurmParseError, match="active_features"):
        parse_node(dict(node, active_features={"a": 1}))


def test_scontrol_oneline_text_readers():
    text = ("ReservationName=a StartTime=x Nodes=node[1-2] State=ACTIVE Comment=two words Users=root\n"
            "ReservationName=b Nodes=node2 State=INACTIVE\n"
            "ReservationName=c Nodes=(null) State=ACTIVE Licenses=lic:1\n"
            "No reservations in the system\n\n"
            "ReservationName=d Nodes=node2,gpu07 State=ACTIVE\n")
    assert parse_oneliners(text)[0]["Comment"] == "two words"
    assert parse_reservations(text) == {"node1": ("a",), "node2": ("a", "d"), "gpu07": ("d",)}
    assert parse_reservations("No reservations in the system\n") == {}
    with pytest.raises(SlurmParseError, match="ReservationName"):
        parse_reservations("Nodes=node1 State=ACTIVE\n")
    with pytest.raises(SlurmParseError, match="reservation r: bad hostlist"):
        parse_reservations("ReservationName=r Nodes=node[1-x] State=ACTIVE\n")
    with pytest.raises(SlurmParseError, match="partition p"):
        parse_partitions("PartitionName=p MaxNodes=many Nodes=n1\n")
    with pytest.raises(SlurmParseError, match="partition p"):
        parse_partitions("PartitionName=p MaxTime=forever Nodes=n1\n")
    assert parse_config("PreemptType             = preempt/qos\nnot a line\n") == {"PreemptType": "preempt/qos"}


def test_preemption_is_refused_with_the_setting_named():
    assert preemption_refusal({"PreemptType": "preempt/none"}) is None
    assert preemption_refusal({"PreemptType": "(null)"}) is None
    assert preemption_refusal({}) is None
    why = preemption_refusal({"PreemptType": "preempt/qos", "PreemptMode": "REQUEUE"})
    assert "PreemptType=preempt/qos" in why and "PreemptMode=REQUEUE" in why and "docs/SYSADMIN.md" in why


def test_two_pool_layout_and_pool_specs():
    cfg = ClusterConfig(pools=[dict(p) for p in TWO_POOLS])
    assert cfg.nodes == 4
    assert cfg.layout() == [("node1", "a100", "a100", 4), ("node2", "a100", "a100", 4),
                            ("node3", "v100", "v100", 8), ("node4", "v100", "v100", 8)]
    assert ClusterConfig().layout() == [(f"node{i}", "gpu", "", 4) for i in range(1, 5)]  # the default is unchanged
    assert parse_pools("a100:1x4,v100:3x8") == [
        {"partition": "a100", "gpu_type": "a100", "nodes": 1, "gpus_per_node": 4},
        {"partition": "v100", "gpu_type": "v100", "nodes": 3, "gpus_per_node": 8}]
    assert parse_pools("two") == TWO_POOLS
    for bad in ("a100", "a100:0x4", "a100:1x99", "a100:1x4,a100:1x8", "a 100:1x4", "1a:1x4"):
        with pytest.raises(ClusterError):
            parse_pools(bad)
    with pytest.raises(ClusterError, match="gpu_type"):
        ClusterConfig(pools=[{"partition": "a", "gpu_type": "x;y", "nodes": 1, "gpus_per_node": 1}])
