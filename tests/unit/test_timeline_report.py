"""The timeline (spans and marks from the daemon's decision log) and ``slurm-elastic report`` on a real
state DB written through StateDB, with the PNG drawn by matplotlib (Agg)."""

import pytest
from click.testing import CliRunner

from slurm_elastic.timeline import build_timeline


def row(ts, job, action, status, gpus_from=None, gpus_to=None, batch=None, reason=""):
    return {"ts": ts, "job_id": job, "action": action, "status": status, "gpus_from": gpus_from,
            "gpus_to": gpus_to, "batch": batch, "reason": reason}


LOG = [
    row(100, 1, "start", "done", None, 4, 512, "admitted: 4 GPUs (minimum 1)"),
    row(101, 2, "start", "done", None, 4, 512, "admitted: 4 GPUs (minimum 1)"),
    row(120, 2, "resize", "begun", 4, 1, 128, "shrunk 4->1: ...; GPUs to higher-value jobs"),
    row(130, 2, "resize", "done", 4, 1, 128, "shrunk 4->1: ...; GPUs to higher-value jobs"),
    row(131, 3, "start", "done", None, 3, 384, "admitted: 3 GPUs (minimum 3)"),
    row(136, 2, "measure", "restart-cost", reason="restart 1"),  # its first step at the new size
    row(200, 3, "end", "done", None, 0, reason="ended"),
    row(205, 2, "resize", "begun", 1, 4, 512, "grown 1->4: +150% goodput"),
    row(215, 2, "resize", "done", 1, 4, 512, "grown 1->4: +150% goodput"),
    row(220, 1, "resize", "begun", 4, 4, 1024, "rebatched 512->1024"),
    row(221, 1, "resize", "timeout", 4, 4, 1024, "rebatched 512->1024"),
    row(250, 1, "end", "done", None, 0),
]


def test_spans_follow_the_decisions():
    tl = build_timeline(LOG, now=300)
    assert (tl.t0, tl.t1) == (100, 300)
    by_job = {j: [(s.start, s.end, s.gpus, s.restarting) for s in tl.spans if s.job == j] for j in tl.jobs}
    assert by_job["1"] == [(100, 250, 4, False)]  # a timed-out resize leaves the job at its size
    assert by_job["2"] == [(101, 120, 4, False), (120, 130, 4, True), (130, 136, 1, True), (136, 205, 1, False),
                           (205, 215, 1, True), (215, 300, 4, False)]  # still running at the end: until now
    assert by_job["3"] == [(131, 200, 3, False)]
    kinds = [(m.job, m.kind, m.gpus_from, m.gpus_to, m.batch_from, m.batch_to) for m in tl.marks]
    assert kinds == [("1", "start", None, 4, None, 512), ("2", "start", None, 4, None, 512),
                     ("2", "shrink", 4, 1, 512, 128), ("3", "start", None, 3, None, 384),
                     ("2", "grow", 1, 4, 128, 512)]
    assert tl.counts() == {"start": 3, "shrink": 1, "grow": 1, "rebatch": 0, "preempt": 0}
    assert "batch 128->512" in tl.marks[-1].label() and "+150% goodput" in tl.marks[-1].label()
    assert tl.gpu_seconds("3") == 69 * 3
    assert tl.utilization(8) == pytest.approx(tl.gpu_seconds() / (8 * 200))


def test_rebatch_and_preempt_marks_and_empty_log():
    tl = build_timeline([row(0, 5, "start", "done", None, 2, 64), row(10, 5, "resize", "done", 2, 2, 128, "rebatched"),
                         row(20, 5, "preempt", "done", 2, 0, None, "preempted")])
    assert [m.kind for m in tl.marks] == ["start", "rebatch", "preempt"]
    assert [(s.start, s.end, s.batch) for s in tl.spans] == [(0, 10, 64), (10, 20, 128)]
    assert build_timeline([]).spans == []


def _state_db(tmp_path):
    from slurm_elastic.daemon.state import StateDB

    db = StateDB(tmp_path)
    for r in LOG:
        db.log_decision(1, r["job_id"], r["action"], r["status"], gpus_from=r["gpus_from"], gpus_to=r["gpus_to"],
                        batch=r["batch"], reason=r["reason"])
    db.set_meta("last_cycle", {"ts": 1e12, "cycle": 9, "capacity": 8})
    db.close()


def test_report_command_prints_the_story_and_writes_the_png(tmp_path):
    pytest.importorskip("matplotlib")
    from slurm_elastic.commands.report import report

    _state_db(tmp_path / "state")
    out = tmp_path / "t.png"
    res = CliRunner().invoke(report, ["--state-dir", str(tmp_path / "state"), "-o", str(out)])
    assert res.exit_code == 0, res.output
    assert "3 starts, 1 shrinks, 1 grows" in res.output
    assert "of the 8 managed GPUs" in res.output
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    # -j: only job 3
    res = CliRunner().invoke(report, ["--state-dir", str(tmp_path / "state"), "-o", str(out), "-j", "3"])
    assert res.exit_code == 0 and "1 starts, 0 shrinks" in res.output


def test_report_without_state_says_so(tmp_path):
    from slurm_elastic.commands.report import report

    res = CliRunner().invoke(report, ["--state-dir", str(tmp_path)])
    assert res.exit_code != 0 and "no daemon state" in res.output


def test_demo_summary_counts_shrinks_grows_and_batch_changes():
    from slurm_elastic.demo import DemoJob, DemoResult

    spec = "elastic:min_gpus=1,max_gpus=4,min_batch=128,max_batch=1024,max_local_batch=256,batch=512"
    jobs = [DemoJob("D", spec, [], job_id=14), DemoJob("C", spec.replace("batch=512", "batch=256"), [], job_id=16)]
    log = [{**r, "id": i} for i, r in enumerate([
        row(1, 14, "start", "done", None, 4, 728, "admitted"), row(2, 16, "start", "done", None, 1, 256, "admitted"),
        row(3, 14, "resize", "done", 4, 1, 256, "shrunk"), row(4, 16, "resize", "done", 1, 3, 618, "grown"),
        row(5, 16, "resize", "error", 3, 4, 618, "failed"), row(6, 14, "end", "done", None, 0)])]
    res = DemoResult(jobs=jobs, plain_job=0, decisions=log, utilization=0.9)
    assert res.counts() == {"start": 2, "shrink": 1, "grow": 1, "batch": 2, "batch_at_start": 1}
    assert "1 shrinks, 1 grows, 2 batch changes on resize" in res.summary()
