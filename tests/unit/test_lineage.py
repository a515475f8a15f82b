"""A resubmitted job keeps its lineage (issue 21 item 6): what Slurm showed of the old job's runs counts for
the job that resumes its checkpoint, so its throughput points (measured under the old job id) are
verified and its report is not refused for naming the old id; only for the same user and the same
checkpoint directory as the daemon recorded them, and only once (a user cannot borrow another job's runs,
nor hand one lineage to two jobs)."""

from __future__ import annotations

import json

import pytest

from slurm_elastic.daemon.reports import ReportError, RunEvidence, validate_report, verify_points

REPORT = {"job_id": "8", "points": [{"gpus": 2, "batch": 64, "samples_per_s": 500.0, "samples": 40000,
                                     "seconds": 80.0, "steps": 625}]}


def ended_job_8() -> RunEvidence:
    ev = RunEvidence()
    ev.observe(8, 0, 2, 1000.0, 1100.0)  # Slurm showed job 8 on 2 GPUs for 100 s
    ev.observe(9, 0, 1, 2000.0, 2001.0)  # the resubmission, just started on 1 GPU
    ev.forget_except({9}, {8: ("alice", "/scratch/ck"), 9: ("alice", "/scratch/ck")})
    return ev


def test_the_same_user_and_directory_continue_the_old_jobs_runs():
    ev = ended_job_8()
    with pytest.raises(ReportError, match="is not this job"):
        validate_report(REPORT, 9)  # before: "job_id '8' is not this job (9)"
    assert ev.lineage_of(9, "alice", "/scratch/ck", "8") == 8
    points = validate_report(REPORT, 9, also=8)
    verified, why = verify_points(points, 9, ev)
    assert verified == points and not why  # 2 GPUs x 80 s: within the 100 s Slurm showed job 8
    assert ev.seconds_on(9, 2) == 100.0 and ev.running_seconds(9) == 101.0
    again = RunEvidence.from_json(json.loads(json.dumps(ev.to_json())))
    assert again.lineage_of(9, "alice", "/scratch/ck", "8") == 8 and again.seconds_on(9, 2) == 100.0


@pytest.mark.parametrize("user, ckpt", [("bob", "/scratch/ck"), ("alice", "/scratch/other")])
def test_another_user_or_directory_cannot_borrow_the_runs(user, ckpt):
    ev = ended_job_8()
    assert ev.lineage_of(9, user, ckpt, "8") is None
    assert ev.seconds_on(9, 2) == 0.0
    with pytest.raises(ReportError):
        validate_report(REPORT, 9, also=ev.lineage_of(9, user, ckpt, "8"))


def test_a_lineage_has_one_heir_and_a_running_job_none():
    ev = ended_job_8()
    assert ev.lineage_of(9, "alice", "/scratch/ck", "8") == 8
    assert ev.lineage_of(10, "alice", "/scratch/ck", "8") is None  # already continued by job 9
    ev.observe(11, 0, 2, 3000.0, 3050.0)
    assert ev.lineage_of(12, "alice", "/scratch/ck", "11") is None  # job 11 has not ended
    assert RunEvidence.from_json({"3": {"0": [2, 1.0, 2.0]}}).seconds_on(3, 2) == 1.0  # the older format
