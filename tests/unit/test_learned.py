"""Job models from the first report (profiles/learned.py), the report's checks (train/protocol.py),
the measured restart cost (daemon ModelRegistry), their way into the policy's JobRequest
(problem.build_problem) and the planner's stability guard."""

from __future__ import annotations

import json
import math
import os

import pytest
from sim_helpers import toy_spec

from slurm_elastic import planner as pl
from slurm_elastic.backends.base import JobRecord, NodeRecord
from slurm_elastic.daemon.models import DEFAULT_MODEL, ModelRegistry
from slurm_elastic.policies.base import Allocation, JobAllocation
from slurm_elastic.problem import build_problem
from slurm_elastic.profiles.learned import GROWTH_WHILE_UNCERTAIN, JobFacts, learn
from slurm_elastic.profiles.parametric import Observation
from slurm_elastic.spec import parse_spec
from slurm_elastic.train import protocol

SPEC = "elastic:min_gpus=1,max_gpus=16,min_batch=32,max_batch=512,max_local_batch=32,batch=64"


def _job(spec, ckpt, state="RUNNING", gpus=4, restart=0, jid=7):
    s = parse_spec(f"{spec},ckpt_dir={ckpt}")
    rec = JobRecord(job_id=jid, name="x", user="u", partition="gpu", state=state, comment=s.to_comment(),
                    gpus_per_node=gpus, gpus_total=gpus, node_count=1 if gpus else 0,
                    nodes=("n1",) if state == "RUNNING" else (), restart_count=restart, user_id=os.getuid())
    return rec, s


def _registry(rec, node_size=4):
    """A registry that saw Slurm run ``rec`` for 100 s at its size (reported points need that evidence)."""
    reg = ModelRegistry(node_size=node_size)
    if rec.gpus_total:
        reg.evidence.observe(rec.job_id, rec.restart_count, rec.gpus_total, 1000.0, 1100.0)
    return reg


def _report(ckpt, **fields):
    (ckpt / "throughput.json").write_text(json.dumps({"format": 1, **fields}))


def test_a_job_measured_at_48_samples_per_s_is_modelled_at_48_after_its_first_report(tmp_path):
    rec, spec = _job(SPEC, tmp_path, gpus=4)
    reg = _registry(rec)
    m = reg(rec, spec)
    assert reg.sources[7] == "prior" and m.uncertainty == 1.0
    assert m.max_gpus == 4  # running on the default prior, nothing reported: no grow on a guess
    guess = DEFAULT_MODEL.samples_per_s(4, 1, 16, 1)
    assert guess > 1000  # what `status` used to show for this job
    _report(tmp_path, points=[{"gpus": 4, "batch": 64, "samples_per_s": 48.0}])
    m = reg(rec, spec)
    assert reg.sources[7] == "fitted from 1 report"
    assert m.samples_per_s(4, 1, 16, 1) == pytest.approx(48.0)
    assert m.samples_per_s(8, 2, 8, 1) < 2 * 48.0  # the prior's shape, at the job's scale
    assert m.max_gpus == GROWTH_WHILE_UNCERTAIN * 4  # uncertain: at most double what it ran at
    assert 0 < m.uncertainty < 1.0


def test_profile_and_declared_priors_are_not_capped_and_keep_their_provenance():
    obs = [Observation(2, 1, 16, 1, 300.0)]
    m = learn(DEFAULT_MODEL, "declared", obs, running_gpus=2)
    assert m.provenance == "fitted from 1 report" and m.max_gpus is None
    assert learn(DEFAULT_MODEL, "declared", [], running_gpus=2).provenance == "declared"
    with pytest.raises(ValueError):
        learn(DEFAULT_MODEL, "guess", obs)


def test_three_gpu_counts_fit_the_parametric_model_alone():
    truth = DEFAULT_MODEL
    obs = [Observation(k, 1, 16, 1, 0.5 * truth.samples_per_s(k, 1, 16, 1)) for k in (1, 2, 4)]
    m = learn(DEFAULT_MODEL, "prior", obs)
    assert m.provenance == "fitted from 3 reports" and m.max_gpus is None
    assert m.samples_per_s(3, 1, 16, 1) == pytest.approx(0.5 * truth.samples_per_s(3, 1, 16, 1), rel=0.05)


def test_hostile_report_values_are_dropped_not_guessed(tmp_path):
    _report(tmp_path, noise_scale=float("nan"), base_batch=True,
            starts=[{"restart_count": -1, "first_step": 5.0}, {"restart_count": 1, "first_step": "x"},
                    {"restart_count": 2, "first_step": 1e300}, "junk", {"restart_count": 1, "first_step": 9.5}])
    (tmp_path / "throughput.json").write_text((tmp_path / "throughput.json").read_text().replace("NaN", "1e400"))
    r = protocol.read_report(tmp_path)
    assert r["noise_scale"] is None and r["base_batch"] is None
    assert r["starts"] == [{"restart_count": 1, "first_step": 9.5, "stop": None}] and r["points"] == []
    _report(tmp_path, noise_scale=-3.0, base_batch=64)
    assert protocol.read_report(tmp_path)["noise_scale"] is None
    assert protocol.read_report(tmp_path)["base_batch"] == 64
    _report(tmp_path, points=[{"gpus": 4, "batch": 64, "samples_per_s": float("inf")}])
    rec, spec = _job(SPEC, tmp_path)
    reg = _registry(rec)
    reg(rec, spec)
    assert reg.sources[7] == "prior (report rejected)" and "Infinity" in reg.problems[7]


def test_merge_throughput_keeps_noise_base_batch_and_one_record_per_start(tmp_path):
    protocol.merge_throughput(tmp_path, 7, 2, 64, 640, 2.0, 10, noise_scale=123.5, base_batch=64,
                              start={"restart_count": 0, "first_step": 100.0, "stop": None})
    protocol.merge_throughput(tmp_path, 7, 2, 64, 0, 0.0, 0, start={"restart_count": 1, "first_step": 200.0,
                                                                    "stop": 150.0})
    protocol.merge_throughput(tmp_path, 7, 2, 64, 64, 0.5, 1, start={"restart_count": 1, "first_step": 200.0,
                                                                     "stop": 150.0})
    r = protocol.read_report(tmp_path)
    assert r["noise_scale"] == 123.5 and r["base_batch"] == 64  # kept when a later write has no estimate
    assert [s["restart_count"] for s in r["starts"]] == [0, 1]
    assert protocol.read_throughput(tmp_path)[0]["samples"] == 704


def test_restart_cost_is_measured_from_the_signal_and_the_first_step_and_reaches_the_request(tmp_path):
    rec, spec = _job(SPEC, tmp_path, gpus=2, restart=1)
    reg = _registry(rec)
    reg.note_signal(7, 0, 1000.0)
    _report(tmp_path, points=[{"gpus": 2, "batch": 64, "samples_per_s": 100.0}], noise_scale=250.0, base_batch=64,
            starts=[{"restart_count": 0, "first_step": 900.0}, {"restart_count": 1, "first_step": 1085.0,
                                                                 "stop": 1010.0}])
    m = reg(rec, spec)
    assert m.restart_s == pytest.approx(85.0)  # the daemon's view: signal -> first step
    assert reg.measured == [(7, 1, {"daemon_s": pytest.approx(85.0), "job_s": pytest.approx(75.0)})]
    nodes = [NodeRecord("n1", "MIXED", (), 4, 2, 8, ("gpu",))]
    snap = build_problem([rec], nodes, model_for=reg, now=2000.0, default_restart_s=10.0)
    req = snap.problem.jobs[0]
    assert (req.restart_s, req.noise_scale, req.base_batch) == (pytest.approx(85.0), 250.0, 64)
    assert snap.views[0].stepped is True
    # without the daemon's signal time, the job's own view (stop -> first step) is used
    reg2 = _registry(rec)
    assert reg2(rec, spec).restart_s == pytest.approx(75.0)


def test_a_job_without_a_step_in_its_current_start_is_not_resized(tmp_path):
    rec, spec = _job(SPEC, tmp_path, gpus=4, restart=2)
    reg = _registry(rec)
    _report(tmp_path, starts=[{"restart_count": 1, "first_step": 5.0}])
    nodes = [NodeRecord("n1", "MIXED", (), 4, 4, 8, ("gpu",))]
    snap = build_problem([rec], nodes, model_for=reg, now=100.0)
    v = snap.views[0]
    assert v.stepped is False
    books = {7: pl.JobBook(last_change_s=90.0)}
    a = Allocation({7: JobAllocation(7, 2, batch=64, local_batch=32, accum=1)})
    plan = pl.plan(a, [v], books, 100.0 + 60, capacity=4, node_size=4, config=pl.PlannerConfig(cooldown_s=10))
    assert plan.actions[0].kind == "leave" and "no step reported" in plan.actions[0].reason
    # once it reported its first step at this size, the shrink goes ahead
    _report(tmp_path, starts=[{"restart_count": 2, "first_step": 95.0}])
    v = build_problem([rec], nodes, model_for=reg, now=100.0).views[0]
    plan = pl.plan(a, [v], books, 160.0, capacity=4, node_size=4, config=pl.PlannerConfig(cooldown_s=10))
    assert plan.actions[0].kind == "resize"
    # a job that never reports is not pinned forever
    v_silent = pl.JobView(7, pl.RUNNING, 4, 64, 0.0, toy_spec(max_gpus=16, batch=64), ("n1",), 4, False)
    plan = pl.plan(a, [v_silent], books, 90.0 + 901, capacity=4, node_size=4, config=pl.PlannerConfig(cooldown_s=10))
    assert plan.actions[0].kind == "resize"


def test_learned_model_facts_defaults():
    m = learn(DEFAULT_MODEL, "prior", [])
    assert m.noise_scale is None and m.base_batch is None and m.restart_s is None
    assert m.facts == JobFacts() and math.isfinite(m.samples_per_s(1, 1, 8))


def test_status_shows_the_model_provenance_and_an_old_state_db_gains_the_columns(tmp_path):
    import sqlite3

    from slurm_elastic.commands.status import format_table, merge_daemon_view, short_provenance
    from slurm_elastic.daemon.state import StateDB

    assert short_provenance("fitted from 3 reports") == "fitted(3)"
    assert short_provenance("profile cifar10") == "profile" and short_provenance(None) == "-"
    # a database written before the model columns existed
    tmp_path.mkdir(exist_ok=True)
    con = sqlite3.connect(tmp_path / "state.sqlite3")
    con.execute("CREATE TABLE jobs (job_id INTEGER PRIMARY KEY, updated REAL NOT NULL, gpus INTEGER, "
                "target_gpus INTEGER, batch INTEGER, samples_per_s REAL, efficiency REAL, rescales INTEGER, "
                "last_change REAL, reason TEXT)")
    con.commit()
    con.close()
    db = StateDB(tmp_path)
    db.save_job_views([{"job_id": 5, "gpus": 2, "samples_per_s": 48.0, "model": "fitted from 1 report",
                        "model_uncertainty": 0.5, "noise_scale": 120.0, "restart_s": 18.0}])
    view = db.job_views()[5]
    db.close()
    row = merge_daemon_view({"jobid": 5, "reason": "", "model": None, "samples_per_s": None}, view)
    assert row["model"] == "fitted from 1 report" and row["noise_scale"] == 120.0 and row["restart_s"] == 18.0
    out = format_table([row], "jobid,samples_per_s,model")
    assert out.splitlines()[1].split() == ["5", "48", "fitted(1)"]
    # the DONE column: the share of the work the job reported done, or that its claim is not used
    from slurm_elastic.commands.status import progress_of

    assert progress_of("fitted from 2 reports, 37% of 4.8e+04 samples done") == "37%"
    assert progress_of("fitted from 1 report, 37% of 4.8e+04 samples done; not used until verified (12 s run, "
                       "throughput not verified)") == "unused"
    assert progress_of("fitted from 1 report, progress claim not used: samples seen rose by 1e+06 in 30 s of "
                       "running, more than 1.8e+04 its verified throughput allows") == "unused"
    assert progress_of("fitted from 1 report, 100% of 4.8e+04 samples done; spent") == "100%"
    assert progress_of("fitted from 1 report, 3 unverified ignored") is None and progress_of("prior") is None
    row = merge_daemon_view({"jobid": 5, "reason": "", "model": None},
                            dict(view, model="fitted from 2 reports, 37% of 4.8e+04 samples done"))
    assert format_table([row], "jobid,model,progress").splitlines()[1].split() == ["5", "fitted(2)", "37%"]


def test_the_daemon_s_learned_noise_scale_drives_the_goodput_objective(tmp_path):
    """Merge of h12l (noise scale learned from the job's report) with h12p (goodput from the noise
    scale): in the daemon the reported noise scale reaches the policy's efficiency, and a driver's
    JobInfo without a noise scale (attained service only) does not erase it."""
    from slurm_elastic.problem import JobInfo
    from slurm_elastic.profiles.goodput import efficiency_for_request

    rec, spec = _job(SPEC, tmp_path, gpus=2)
    reg = _registry(rec)
    _report(tmp_path, points=[{"gpus": 2, "batch": 64, "samples_per_s": 100.0}], noise_scale=250.0, base_batch=64)
    nodes = [NodeRecord("n1", "MIXED", (), 4, 2, 8, ("gpu",))]
    req = build_problem([rec], nodes, model_for=reg, now=2000.0).problem.jobs[0]
    eff, key = efficiency_for_request(req)
    assert key[0] == "noise-scale" and key[2] == 64.0
    assert float(eff(64)) == pytest.approx(1.0) and float(eff(512)) == pytest.approx((250 + 64) / (250 + 512), rel=0.03)
    kept = build_problem([rec], nodes, model_for=reg, now=2000.0,
                         job_info=lambda r: JobInfo(attained_gpu_s=50.0)).problem.jobs[0]
    assert (kept.noise_scale, kept.base_batch, kept.attained_gpu_s) == (250.0, 64, 50.0)
    # a driver that measures the job itself (the simulator) wins over the model's
    over = build_problem([rec], nodes, model_for=reg, now=2000.0,
                         job_info=lambda r: JobInfo(noise_scale=1000.0, base_batch=32)).problem.jobs[0]
    assert (over.noise_scale, over.base_batch) == (1000.0, 32)
    # no report at all: the conservative source, never a silent guess
    rec2, spec2 = _job(SPEC, tmp_path / "none", gpus=2, jid=8)
    (tmp_path / "none").mkdir()
    req2 = build_problem([rec2], nodes, model_for=_registry(rec2), now=2000.0).problem.jobs[0]
    assert req2.noise_scale is None and efficiency_for_request(req2)[1][0] == "conservative"



def test_the_report_carries_progress_and_hostile_figures_are_dropped(tmp_path):
    protocol.merge_throughput(tmp_path, 7, 2, 64, 640, 2.0, 10, samples_seen=640, total_samples=64000)
    protocol.merge_throughput(tmp_path, 7, 2, 64, 640, 2.0, 10)  # a flush without progress keeps the last
    rep = protocol.read_report(tmp_path)
    assert (rep["samples_seen"], rep["total_samples"]) == (640.0, 64000.0)
    for bad in (float("nan"), -1, True, "12", 1e300, [5]):
        _report(tmp_path, samples_seen=bad, total_samples=bad)
        rep = protocol.read_report(tmp_path)
        assert rep["samples_seen"] is None and rep["total_samples"] is None, bad
    _report(tmp_path, samples_seen=0, total_samples=0)  # a total of 0 samples is no plan
    assert protocol.read_report(tmp_path)["total_samples"] is None

def test_progress_ranks_by_remaining_work_once_slurm_backs_the_claim(tmp_path):
    # What the completion objective ranks a job by: its remaining work from its report, attained service
    # from Slurm's view. The claim counts only once the job has run its probation with a verified
    # throughput; the first total stands, samples seen only go up (slurm_elastic.claims).
    from dataclasses import replace

    rec, spec = _job(SPEC, tmp_path, gpus=4)
    rec = replace(rec, start_time=1000)
    reg = _registry(rec)  # Slurm showed it running 100 s on 4 GPUs
    reg(rec, spec)
    assert reg.progress[7].remaining_samples is None and reg.progress[7].attained_gpu_s == 400.0  # no report
    _report(tmp_path, samples_seen=1000, total_samples=100000)
    reg(rec, spec)
    assert reg.progress[7].remaining_samples is None  # no verified throughput: the claim cannot be checked
    assert "not used until verified" in reg.sources[7], reg.sources[7]
    point = [{"gpus": 4, "batch": 64, "samples_per_s": 100.0}]
    _report(tmp_path, points=point, samples_seen=1000, total_samples=100000)
    reg(rec, spec)
    assert reg.progress[7].remaining_samples == 100000  # done counts from its first report (1000 seen)
    assert reg.sources[7].endswith(", 1% of 1e+05 samples done"), reg.sources[7]  # what status shows
    _report(tmp_path, points=point, samples_seen=3000, total_samples=3500)  # a smaller total, to rank first
    reg(rec, spec)
    assert reg.progress[7].remaining_samples == 98000
    _report(tmp_path, points=point, samples_seen=2000, total_samples=100000)  # seen going back: kept at the most
    reg(rec, spec)
    assert reg.progress[7].remaining_samples == 98000
    reg.forget(set())
    assert 7 not in reg.claims.jobs and 7 not in reg.progress


def test_a_pending_job_that_never_ran_has_no_standing_to_claim(tmp_path):
    rec, spec = _job(SPEC, tmp_path, state="PENDING", gpus=0)
    reg = _registry(rec)
    _report(tmp_path, points=[{"gpus": 4, "batch": 64, "samples_per_s": 100.0}], samples_seen=9900,
            total_samples=10000)
    reg(rec, spec)
    assert reg.progress[7].remaining_samples is None and "not used until verified" in reg.sources[7]


def test_a_forged_progress_jump_or_a_creeping_claim_is_not_used_for_the_rest_of_the_job_s_life(tmp_path):
    # Over-claim: samples seen may not rise faster than the job's verified throughput allows (a jump to
    # just below the total is caught in the cycle that reads it). Implied finish: a job still running
    # well past the finish its claim implied (creeping) proved it false. Either way: never used again,
    # and the user's next job serves a longer probation.
    from dataclasses import replace

    rec, spec = _job(SPEC, tmp_path, gpus=4)
    rec = replace(rec, start_time=1000)
    reg = _registry(rec)
    point = [{"gpus": 4, "batch": 64, "samples_per_s": 100.0}]
    _report(tmp_path, points=point, samples_seen=1000, total_samples=10**7)
    reg(rec, spec)
    assert reg.progress[7].remaining_samples == 10**7
    reg.evidence.observe(7, 0, 4, 1000.0, 1130.0)  # 30 s more running: at most 2 x 100/s x (30 + 60) s
    _report(tmp_path, points=point, samples_seen=10**7 - 10, total_samples=10**7)
    reg(rec, spec)
    assert reg.progress[7].remaining_samples is None and "verified throughput allows" in reg.sources[7]
    _report(tmp_path, points=point, samples_seen=10**7 - 9, total_samples=10**7)  # honest from now on: too late
    reg(rec, spec)
    assert reg.progress[7].remaining_samples is None
    assert reg.claims.strikes == {"u": 1}
    assert reg.claims.probation_s("u") == 2 * reg.claims.PROBATION_S  # colder trust for the user's jobs

    # creeping: a small total from the start, samples seen bumped by a token amount
    (tmp_path / "b").mkdir()
    rec2, spec2 = _job(SPEC, tmp_path / "b", gpus=4, jid=8)
    rec2 = replace(rec2, start_time=1000, user="v")
    reg.evidence.observe(8, 0, 4, 1000.0, 1100.0)
    _report(tmp_path / "b", points=point, samples_seen=10, total_samples=2000)
    reg(rec2, spec2)
    assert reg.progress[8].remaining_samples == 2000
    deadline = 100.0 + reg.claims.OVERRUN * 2000 / 100.0 + reg.claims.GRACE_S
    reg.evidence.observe(8, 0, 4, 1000.0, 1000.0 + deadline - 1)
    _report(tmp_path / "b", points=point, samples_seen=20, total_samples=2000)
    reg(rec2, spec2)
    assert reg.progress[8].remaining_samples == 1990  # not yet past its implied finish
    reg.evidence.observe(8, 0, 4, 1000.0, 1000.0 + deadline + 1)
    _report(tmp_path / "b", points=point, samples_seen=30, total_samples=2000)
    reg(rec2, spec2)
    assert reg.progress[8].remaining_samples is None and "past the finish its claim implied" in reg.sources[8]
    assert reg.claims.strikes == {"u": 1, "v": 1}
