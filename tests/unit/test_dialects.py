"""Parsers of Slurm's JSON dialects, on output captured from real Slurm (22.05 and 24.11)."""

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_elastic.backends.base import SlurmParseError
from slurm_elastic.backends.dialects import (
    expand_hostlist,
    gpus_in_tres,
    number,
    parse_jobs,
    parse_nodes,
    slurm_version,
    split_job_state,
    state_list,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
CAPTURED = sorted(p for p in FIXTURES.glob("slurm-*") if (p / "MANIFEST.json").exists())
REFERENCE_2411 = FIXTURES / "slurm-24.11-reference"


def load(path: Path):
    return json.loads(path.read_text())


def test_there_are_captures_for_at_least_one_version():
    assert CAPTURED, "run scripts/capture_fixtures.py to record fixtures from a live cluster"


@pytest.mark.parametrize("capture", CAPTURED, ids=lambda p: p.name)
def test_captures_parse_to_what_the_manifest_says(capture):
    manifest = load(capture / "MANIFEST.json")
    major_minor = tuple(int(x) for x in manifest["slurm_version"].split(".")[:2])
    checked = 0
    for name, about in manifest["files"].items():
        doc = load(capture / name)
        assert slurm_version(doc)[:2] == major_minor
        if name.startswith("squeue_"):
            jobs = {j.job_id: j for j in parse_jobs(doc)}
            for jid, want in about["jobs"].items():
                job = jobs[int(jid)]
                for key, value in want.items():
                    if key == "elastic":
                        assert job.comment.startswith("elastic:") == value, (name, jid)
                    elif key == "requeue":
                        assert job.requeueable == value, (name, jid)
                    else:
                        assert getattr(job, key) == value, (name, jid, key, getattr(job, key))
                    checked += 1
        else:
            nodes = parse_nodes(doc)
            assert len(nodes) == manifest["nodes"]
            assert all(n.gpus_total == manifest["gpus_per_node"] for n in nodes)
            assert sum(n.gpus_used for n in nodes) == about["gpus_used"], name
            assert all(n.usable for n in nodes)
            checked += 1
    assert checked > 10


def test_2205_running_jobs_list_their_nodes_and_start_times():
    cap = FIXTURES / "slurm-22.05"
    if not cap.exists():
        pytest.skip("no 22.05 capture")
    jobs = parse_jobs(load(cap / "squeue_resized.json"))
    resized = [j for j in jobs if j.restart_count == 1][0]
    assert len(resized.nodes) == 2 and all(n.startswith("node") for n in resized.nodes)
    assert resized.start_time and resized.submit_time and resized.user == "root" and resized.partition == "gpu"


@pytest.mark.parametrize("version", ["22.05", "24.11"])
def test_a_cancelled_job_still_ending_is_active_and_completing_in_both_dialects(version):
    """Found live: after scancel, while the batch script is still ending, 22.05 prints "COMPLETING" but
    24.11 prints ["CANCELLED", "COMPLETING"]. The old parser read the latter as CANCELLED, so the job
    vanished from list_jobs() while its processes (and slurmstepd) were still running."""
    cap = FIXTURES / f"slurm-{version}"
    if not (cap / "squeue_completing.json").exists():
        pytest.skip(f"no {version} capture with the completing step")
    doc = load(cap / "squeue_completing.json")
    want = load(cap / "MANIFEST.json")["files"]["squeue_completing.json"]["jobs"]
    (jid,) = [int(j) for j, w in want.items() if w["state"] == "COMPLETING"]
    raw = [j["job_state"] for j in doc["jobs"] if j["job_id"] == jid][0]
    assert raw == ("COMPLETING" if version == "22.05" else ["CANCELLED", "COMPLETING"])
    job = {j.job_id: j for j in parse_jobs(doc)}[jid]
    assert job.state == "COMPLETING" and job.is_active and job.is_completing and not job.is_requeued_settled


def test_final_state_with_completing_flag_reads_completing_but_requeued_stays_pending():
    assert split_job_state(["CANCELLED", "COMPLETING"]) == ("COMPLETING", ("COMPLETING", "CANCELLED"))
    assert split_job_state(["FAILED", "COMPLETING"]) == ("COMPLETING", ("COMPLETING", "FAILED"))
    assert split_job_state(["PENDING", "COMPLETING"]) == ("PENDING", ("COMPLETING",))
    assert split_job_state(["RUNNING", "COMPLETING"]) == ("RUNNING", ("COMPLETING",))
    assert split_job_state(["CANCELLED"]) == ("CANCELLED", ())


def test_2411_reference_pending_and_held():
    jobs = {j.job_id: j for j in parse_jobs(load(REFERENCE_2411 / "squeue_2411.json"))}
    assert jobs[1].state == "PENDING" and not jobs[1].held and jobs[1].gpus_per_node == 2
    assert jobs[1].nodes == () and jobs[1].state_reason == "Resources"  # job_resources is null here
    assert jobs[2].held and jobs[2].state_reason == "JobHeldUser" and jobs[2].gpus_per_node == 1
    assert slurm_version(load(REFERENCE_2411 / "squeue_2411.json")) == (24, 11, 5)


def test_2411_reference_after_resize():
    jobs = {j.job_id: j for j in parse_jobs(load(REFERENCE_2411 / "squeue_2411_b.json"))}
    j = jobs[1]
    assert (j.state, j.gpus_per_node, j.gpus_total, j.node_count, j.restart_count) == ("RUNNING", 3, 6, 2, 1)
    assert j.nodes == ("node1", "node2") and j.requeueable and j.start_time == 1796223928


def test_2411_scontrol_job_json_has_the_same_shape_as_squeue():
    a = parse_jobs(load(REFERENCE_2411 / "scontrol_job_2411.json"))
    b = parse_jobs(load(REFERENCE_2411 / "squeue_2411.json"))
    assert [(j.job_id, j.state, j.held, j.gpus_per_node) for j in a] == [(j.job_id, j.state, j.held, j.gpus_per_node)
                                                                           for j in b]


def test_2411_nodes_from_scontrol():
    nodes = parse_nodes(load(REFERENCE_2411 / "scontrol_node_2411.json"))
    assert [(n.name, n.gpus_total, n.gpus_used) for n in nodes] == [("node1", 4, 0), ("node2", 4, 0)]
    assert nodes[0].state == "UNKNOWN" and not nodes[0].usable


def test_2411_sinfo_is_an_aggregate_and_is_refused_as_per_node_output():
    with pytest.raises(SlurmParseError):
        parse_nodes(load(REFERENCE_2411 / "sinfo_2411.json"))


@pytest.mark.parametrize(
    "value, expected",
    [(5, 5), (None, None), ({"set": True, "infinite": False, "number": 7}, 7),
     ({"set": False, "infinite": False, "number": 0}, None), ({"set": True, "infinite": True, "number": 0}, float("inf")),
     ("Infinity", float("inf"))],
)
def test_number_in_every_dialect(value, expected):
    assert number(value) == expected


def test_number_rejects_garbage():
    for bad in ("12", [1], True):
        with pytest.raises(SlurmParseError):
            number(bad)


def test_states():
    assert state_list("RUNNING") == ["RUNNING"] and state_list(["PENDING", "REQUEUED"]) == ["PENDING", "REQUEUED"]
    assert state_list("idle+drain") == ["IDLE", "DRAIN"]
    assert split_job_state(["REQUEUE_HOLD"]) == ("PENDING", ("REQUEUE_HOLD",))
    assert split_job_state(["COMPLETING"]) == ("COMPLETING", ("COMPLETING",))
    assert split_job_state(["PENDING", "COMPLETING"]) == ("PENDING", ("COMPLETING",))
    assert split_job_state(["COMPLETE"]) == ("COMPLETED", ())


@pytest.mark.parametrize(
    "tres, gpus",
    [("gres:gpu:2", 2), ("gres/gpu:3", 3), ("gres/gpu:a100:2", 2), ("gres/gpu=4", 4), ("gpu:4(S:0-1)", 4),
     ("gpu:2(IDX:0-1)", 2), ("gres/gpu:1,gres/gpu:a100:2", 3), ("gres:mps:100", None), ("", None), (None, None)],
)
def test_gpus_in_tres(tres, gpus):
    assert gpus_in_tres(tres) == gpus


def test_hostlists():
    assert expand_hostlist("node[1-3,7],gpu05") == ["node1", "node2", "node3", "node7", "gpu05"]
    assert expand_hostlist("n[01-03]") == ["n01", "n02", "n03"]
    assert expand_hostlist("rack[1-2]-n[1-2]") == ["rack1-n1", "rack1-n2", "rack2-n1", "rack2-n2"]
    assert expand_hostlist("") == []
    with pytest.raises(SlurmParseError):
        expand_hostlist("node[a-b]")


def test_slurm_errors_in_the_document_are_raised():
    doc = load(CAPTURED[0] / "squeue_idle.json")
    doc["errors"] = [{"error": "Unable to contact slurm controller", "error_number": 1}]
    with pytest.raises(SlurmParseError, match="Unable to contact"):
        parse_jobs(doc)


def _all_real_jobs():
    jobs = []
    for cap in [*CAPTURED, REFERENCE_2411]:
        for f in sorted(cap.glob("squeue_*.json")):
            jobs.extend(load(f)["jobs"])
    return jobs


REAL_JOBS = _all_real_jobs()
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3),
    max_leaves=8,
)


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(range(len(REAL_JOBS))), st.lists(st.tuples(st.sampled_from(sorted(REAL_JOBS[0])), json_values),
                                                         max_size=4), st.lists(st.sampled_from(sorted(REAL_JOBS[0])),
                                                                               max_size=3))
def test_mutated_real_jobs_parse_or_raise_slurm_parse_error(index, replacements, removals):
    job = dict(REAL_JOBS[index])
    for key, value in replacements:
        job[key] = value
    for key in removals:
        job.pop(key, None)
    try:
        parse_jobs({"jobs": [job], "meta": {}, "errors": []})
    except SlurmParseError:
        pass


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_arbitrary_json_documents_raise_only_slurm_parse_error(doc):
    for parse in (parse_jobs, parse_nodes):
        try:
            parse(doc)
        except SlurmParseError:
            pass


@pytest.mark.parametrize("capture", CAPTURED, ids=lambda p: p.name)
def test_every_captured_job_has_its_users_uid(capture):
    """The daemon reads a job's files only when they belong to the job's uid (daemon/userfiles.py)."""
    jobs = [j for f in sorted(capture.glob("squeue_*.json")) for j in parse_jobs(load(f))]
    assert jobs
    assert all(isinstance(j.user_id, int) and j.user_id >= 0 for j in jobs), [(j.job_id, j.user_id) for j in jobs]


@pytest.mark.parametrize("capture", CAPTURED, ids=lambda p: p.name)
def test_a_jobs_slurm_account_is_read_and_must_be_text(capture):
    # captured without accounting: every account is "" (the weight grants of an account then never apply)
    doc = load(capture / "squeue_mixed.json")
    assert {r.account for r in parse_jobs(doc)} == {""}
    doc["jobs"][0]["account"] = "ml-lab"
    assert parse_jobs(doc)[0].account == "ml-lab"
    doc["jobs"][0]["account"] = ["ml-lab"]
    with pytest.raises(SlurmParseError, match="'account'"):
        parse_jobs(doc)
