"""``slurm-elastic solve``: the example problem, --json output, and errors that name job and field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_elastic.commands.solve import solve

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "problem.json"


def run(args):
    return CliRunner().invoke(solve, [str(a) for a in args])


@pytest.mark.parametrize("policy", ["dp", "fixed-batch", "static", "pollux-dp", "tiresias"])
def test_example_solves_with_every_policy(policy):
    r = run([EXAMPLE, "--policy", policy, "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert doc["policy"] == policy and doc["gpus_used"] <= doc["total_gpus"] == 16
    ids = [j["id"] for j in doc["jobs"]]
    assert ids == [j["id"] for j in json.loads(EXAMPLE.read_text())["jobs"]]
    for j in doc["jobs"]:
        assert set(j) == {"id", "gpus", "nodes", "batch", "local_batch", "accum", "samples_per_s", "reason"}
        if j["gpus"]:
            assert j["gpus"] * j["local_batch"] * j["accum"] == j["batch"] and j["samples_per_s"] > 0
    assert doc["objective"] > 0 and doc["solve_s"] >= 0


def test_dp_beats_baselines_on_the_example():
    # the same objective for all three: the paper's total weighted speedup of samples/s
    obj = {p: json.loads(run([EXAMPLE, "--policy", p, "--json"] + (["--objective", "throughput"] if p == "dp" else []))
                         .output)["objective"]
           for p in ("dp", "fixed-batch", "static")}
    assert obj["dp"] > obj["fixed-batch"] > obj["static"]


def test_human_output():
    r = run([EXAMPLE])
    assert r.exit_code == 0
    assert "SAMPLES/S" in r.output and "objective" in r.output and "cifar-run" in r.output


def write(tmp_path, doc):
    p = tmp_path / "p.json"
    p.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    return p


GOOD_JOB = {"id": "a", "spec": {"min_gpus": 1, "max_gpus": 4, "min_batch": 32, "max_batch": 512,
                                "max_local_batch": 128, "profile": "cifar10"}}


@pytest.mark.parametrize("doc,needle", [
    ({"total_gpus": 8, "node_size": 4, "jobs": [dict(GOOD_JOB, spec=dict(GOOD_JOB["spec"], min_batch=1024))]},
     "job a, field 'min_batch'"),
    ({"total_gpus": 8, "node_size": 4, "jobs": [dict(GOOD_JOB, spec=dict(GOOD_JOB["spec"], profile="nope"))]},
     "job a, field 'profile'"),
    ({"total_gpus": 8, "node_size": 4, "jobs": [dict(GOOD_JOB, colour="red")]}, "job a, field 'colour'"),
    ({"total_gpus": 8, "node_size": 4, "jobs": [GOOD_JOB, GOOD_JOB]}, "job a, field 'id'"),
    ({"total_gpus": 8, "node_size": 4, "jobs": [dict(GOOD_JOB, running_gpus=-1)]}, "job a, field 'running_gpus'"),
    ({"total_gpus": 8, "node_size": 4, "jobs": [dict(GOOD_JOB, points=[[1, 32]])]}, "job a, field 'points[0]'"),
    ({"total_gpus": 8, "node_size": 4, "jobs": [dict(GOOD_JOB, spec=dict(GOOD_JOB["spec"], max_gpus="x"))]},
     "job a, field 'max_gpus'"),
    ({"node_size": 4, "jobs": []}, "field 'total_gpus'"),
    ("{not json", "not valid JSON"),
    ({"total_gpus": 8, "node_size": 4, "jobs": [dict(GOOD_JOB, remaining_samples=float("nan"))]},
     "job a, field 'remaining_samples'"),
    ({"total_gpus": 8, "node_size": 4, "jobs": [dict(GOOD_JOB, attained_gpu_s=-5)]}, "job a, field 'attained_gpu_s'"),
    ({"total_gpus": 8, "node_size": 4, "jobs": [dict(GOOD_JOB, noise_scale=900.0)]}, "job a, field 'base_batch'"),
    ({"total_gpus": 8, "node_size": 4, "jobs": [dict(GOOD_JOB, noise_scale=9, base_batch=0)]},
     "job a, field 'base_batch'"),
    ({"total_gpus": 8, "node_size": 4, "jobs": [dict(GOOD_JOB, held_s=60)]}, "job a, field 'held_s'"),
])
def test_invalid_problems_name_the_job_and_field(tmp_path, doc, needle):
    r = run([write(tmp_path, doc)])
    assert r.exit_code != 0
    assert needle in r.output


def test_points_and_comment_forms(tmp_path):
    doc = {"total_gpus": 8, "node_size": 4, "jobs": [
        {"id": 1, "comment": "elastic:min_gpus=1,max_gpus=8,min_batch=64,max_batch=1024,max_local_batch=256",
         "points": [[1, 128, 1000.0], [2, 256, 1900.0], [4, 512, 3400.0]]},
        {"id": 2, "comment": "elastic:min_gpus=1,max_gpus=8,min_batch=64,max_batch=1024,max_local_batch=256,"
                             "profile=gavel.v100.resnet18"}]}
    r = run([write(tmp_path, doc), "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert sum(j["gpus"] for j in out["jobs"]) <= 8 and all(j["gpus"] >= 1 for j in out["jobs"])


POOLS_EXAMPLE = EXAMPLE.with_name("problem-pools.json")


def test_pools_example_places_each_job_in_one_of_its_pools():
    doc_in = json.loads(POOLS_EXAMPLE.read_text())
    r = run([POOLS_EXAMPLE, "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    caps = {p["name"]: sum(p["nodes"].values()) for p in doc_in["pools"]}
    assert doc["total_gpus"] == sum(caps.values()) == 24
    allowed = {j["id"]: j["pools"] for j in doc_in["jobs"]}
    used = {name: 0 for name in caps}
    for j in doc["jobs"]:
        if j["gpus"]:
            assert j["pool"] in allowed[j["id"]], j
            used[j["pool"]] += j["gpus"]
    assert all(used[p] <= caps[p] for p in caps), used
    running = {j["id"]: j for j in doc_in["jobs"] if j.get("running_gpus")}
    for j in doc["jobs"]:
        if j["id"] in running and j["gpus"]:
            assert j["pool"] == running[j["id"]]["pools"][0]  # a running job stays in its pool
    assert doc["bound"] is not None and doc["bound"] >= doc["objective"] - 1e-9
    human = run([POOLS_EXAMPLE])
    assert human.exit_code == 0 and "pool v100" in human.output and "bound" in human.output


def test_pool_points_give_a_job_its_own_speed_in_a_pool(tmp_path):
    # one job, two pools of 4 GPUs; its points say it is 3x faster in 'fast': it must go there
    job = {"id": "x", "pools": ["slow", "fast"], "points": [[1, 32, 100.0], [2, 64, 190.0], [4, 128, 360.0]],
           "pool_points": {"fast": [[1, 32, 300.0], [2, 64, 570.0], [4, 128, 1080.0]]},
           "spec": {"min_gpus": 1, "max_gpus": 4, "min_batch": 32, "max_batch": 128, "max_local_batch": 32,
                    "batch": 32}}
    pools = [{"name": "slow", "nodes": {"n1": 4}}, {"name": "fast", "gpu_type": "h100", "nodes": {"n2": 4}}]
    for order in (pools, pools[::-1]):
        doc = json.loads(run([write(tmp_path, {"pools": order, "jobs": [job]}), "--json"]).output)
        assert doc["jobs"][0]["pool"] == "fast" and doc["jobs"][0]["gpus"] == 4, doc


POOLS = [{"name": "a", "nodes": {"n1": 4}}, {"name": "b", "nodes": {"n2": 8}}]


@pytest.mark.parametrize("doc,needle", [
    ({"pools": POOLS, "jobs": [dict(GOOD_JOB, pools=["c"])]}, "job a, field 'pools'"),
    ({"pools": [POOLS[0], {"name": "b", "nodes": {"n1": 4}}], "jobs": [GOOD_JOB]}, "field 'pools[1].nodes'"),
    ({"pools": [POOLS[0], dict(POOLS[0])], "jobs": [GOOD_JOB]}, "field 'pools[1].name'"),
    ({"pools": POOLS, "jobs": [dict(GOOD_JOB, running_gpus=2)]}, "job a, field 'pool'"),
    ({"pools": POOLS, "jobs": [dict(GOOD_JOB, running_gpus=2, pool="b", pools=["a"])]}, "job a, field 'pool'"),
    ({"pools": POOLS, "jobs": [dict(GOOD_JOB, running_gpus=2, nodes=["n9"])]}, "job a, field 'nodes'"),
    ({"pools": POOLS, "jobs": [dict(GOOD_JOB, running_gpus=2, pool="a", nodes=["n2"])]}, "job a, field 'nodes'"),
    ({"pools": POOLS, "total_gpus": 8, "jobs": [GOOD_JOB]}, "field 'total_gpus'"),
    ({"pools": [{"name": "a", "nodes": {"n1": 0}}], "jobs": [GOOD_JOB]}, "field 'pools[0].nodes.n1'"),
    ({"pools": [{"name": "a", "nodes": {"n1": 4}, "colour": 1}], "jobs": [GOOD_JOB]}, "field 'pools[0].colour'"),
    ({"total_gpus": 8, "node_size": 4, "jobs": [dict(GOOD_JOB, pools=["a"])]}, "job a, field 'pools'"),
    ({"total_gpus": 8, "node_size": 4, "jobs": [dict(GOOD_JOB, running_gpus=2, nodes=["n1"])]},
     "job a, field 'nodes'"),
    ({"pools": POOLS, "jobs": [dict(GOOD_JOB, pool_points={"a": [[1, 32]]})]}, "job a, field 'points[0]'"),
])
def test_invalid_pools_name_the_job_and_field(tmp_path, doc, needle):
    r = run([write(tmp_path, doc)])
    assert r.exit_code != 0
    assert needle in r.output, r.output


def test_the_work_a_job_has_left_ranks_it(tmp_path):
    # completion ranks jobs by the work they report left (SRPT): of two identical jobs on 5 GPUs, the one
    # with less left gets more; with no work reported (and so no ranks), the p-norm fallback splits
    # evenly-ish; the noise scale is taken as the job's (its efficiency at a larger batch)
    two = [dict(GOOD_JOB, id="long", remaining_samples=5e7), dict(GOOD_JOB, id="short", remaining_samples=5e4)]
    doc = json.loads(run([write(tmp_path, {"total_gpus": 5, "node_size": 8, "jobs": two}), "--json"]).output)
    got = {j["id"]: j["gpus"] for j in doc["jobs"]}
    assert got["short"] > got["long"] >= 1, got
    flipped = [dict(two[0], remaining_samples=5e4), dict(two[1], remaining_samples=5e7)]
    doc = json.loads(run([write(tmp_path, {"total_gpus": 5, "node_size": 8, "jobs": flipped}), "--json"]).output)
    got = {j["id"]: j["gpus"] for j in doc["jobs"]}
    assert got["long"] > got["short"] >= 1, got
    noisy = [dict(GOOD_JOB, id=i, noise_scale=ns, base_batch=32) for i, ns in (("lo", 10.0), ("hi", 1e6))]
    doc = json.loads(run([write(tmp_path, {"total_gpus": 8, "node_size": 8, "jobs": noisy}), "--json"]).output)
    b = {j["id"]: j["batch"] for j in doc["jobs"]}
    assert b["hi"] > b["lo"], b  # a small noise scale makes a large batch inefficient
