"""The simulator end to end: a hand-checked scenario, conservation, capacity, determinism."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sim_helpers import EqualShare, LinearModel, Requested, toy_job

from slurm_elastic.planner import PlannerConfig
from slurm_elastic.sim.engine import SimConfig, Simulation
from slurm_elastic.sim.metrics import summarize
from slurm_elastic.sim.workloads import WorkloadJob, synthetic

MODEL = LinearModel(100.0)  # 100 samples/s per GPU, whatever the batch


def run(jobs, policy, **cfg):
    planner = cfg.pop("planner", PlannerConfig(cooldown_s=0.0))
    config = SimConfig(nodes=cfg.pop("nodes", 1), gpus_per_node=4, interval_s=60.0, checkpoint_s=10.0,
                       restart_s=35.0, startup_s=0.0, planner=planner, **cfg)
    return Simulation(jobs, policy, config, model_for_job=lambda w: MODEL).run()


def test_hand_checked_two_jobs_shrink_and_regrow():
    """One node of 4 GPUs; A (240,000 samples) alone, then B (60,000) arrives; equal share.

    t=0    cycle: A starts on 4 GPUs (400/s), startup 0.
    t=90   B arrives (held).
    t=120  cycle: share is 2 each. A is signalled (processed 120*400 = 48,000); B is released but
           waits: A still holds the 4 GPUs while it checkpoints.
    t=130  A acks -> requeue-hold frees 4 GPUs -> B starts on 2 (200/s, first start: no delay),
           A is updated to 2 and released -> starts, restart 35 s -> trains from 165 at 200/s.
    t=430  B done: 60,000 / 200 = 300 s after 130. JCT(B) = 430 - 90 = 340.
    t=480  cycle: A alone, grows 2 -> 4: processed 48,000 + (480-165)*200 = 111,000; signal.
    t=490  ack, requeue, release on 4; restart 35 s -> trains from 525 at 400/s.
           remaining 129,000 / 400 = 322.5 s -> done at 847.5. JCT(A) = 847.5.
    """
    jobs = [toy_job("A", 0.0, 240_000), toy_job("B", 90.0, 60_000)]
    res = run(jobs, EqualShare())
    out = {j.name: j for j in res.jobs}
    assert out["B"].jct_s == pytest.approx(340.0)
    assert out["A"].jct_s == pytest.approx(847.5)
    assert out["A"].rescales == 2 and out["B"].rescales == 0
    assert [(g, t) for t, g, _ in out["A"].sizes] == [(4, 0.0), (2, 165.0), (4, 525.0)]
    # GPU-seconds lost: A's checkpoints (10 s at 4, 10 s at 2) and restarts (35 s at 2, 35 s at 4).
    assert out["A"].lost_gpu_s == pytest.approx(10 * 4 + 35 * 2 + 10 * 2 + 35 * 4)
    m = summarize(res)
    assert m["jobs_completed"] == 2 and m["rescales"] == 2
    assert m["avg_jct_s"] == pytest.approx((340.0 + 847.5) / 2)
    assert m["avg_queue_s"] == pytest.approx((0.0 + 40.0) / 2)  # B arrived 90, started 130
    # GPUs held: A on 4 over [0,130], on 2 over [130,490], on 4 over [490,847.5]; B on 2 over [130,430].
    busy = 4 * 130 + 2 * (490 - 130) + 4 * (847.5 - 490) + 2 * 300
    assert res.busy_gpu_s == pytest.approx(busy)
    assert m["gpu_utilization"] == pytest.approx(busy / (4 * 847.5))


def test_hand_checked_cooldown_delays_shrink_and_regrow():
    """A (480,000) and B (60,000) as above, cooldown 300 s (a start counts as a change).

    t=0    A starts on 4.  t=90 B arrives.
    t=120, 180, 240: A's cooldown (since its start at 0) blocks the shrink; B waits for GPUs.
    t=300  A shrinks: processed 300*400 = 120,000; ack 310; B starts on 2 at 310 (done 310+300 = 610);
           A restarts on 2, trains from 345 at 200/s.
    t=660  cycle: A alone and 360 s since its change: grows; processed 120,000 + 315*200 = 183,000;
           ack 670, trains on 4 from 705; remaining 297,000 / 400 = 742.5 -> done at 1447.5.
    """
    jobs = [toy_job("A", 0.0, 480_000), toy_job("B", 90.0, 60_000)]
    res = run(jobs, EqualShare(), planner=PlannerConfig(cooldown_s=300.0))
    out = {j.name: j for j in res.jobs}
    assert out["B"].jct_s == pytest.approx(610.0 - 90.0)
    assert out["A"].jct_s == pytest.approx(1447.5)
    assert [(g, t) for t, g, _ in out["A"].sizes] == [(4, 0.0), (2, 345.0), (4, 705.0)]


def test_static_job_reduces_elastic_capacity():
    """A non-elastic 2-GPU job for 1000 s: the elastic job gets only the 2 other GPUs, then grows."""
    jobs = [
        WorkloadJob(name="S", arrival_s=0.0, spec=None, gpus=2, duration_s=1000.0),
        toy_job("E", 0.0, 400_000),
    ]
    res = run(jobs, EqualShare())
    out = {j.name: j for j in res.jobs}
    assert out["S"].jct_s == pytest.approx(1000.0)
    # E: 2 GPUs from 0 (200/s) to the cycle at 1020: 204,000; ack 1030, trains on 4 from 1065:
    # remaining 196,000 / 400 = 490 -> 1555.
    assert out["E"].jct_s == pytest.approx(1555.0)
    assert res.peak_gpus_in_use <= 4


def _check_conservation(res, cluster_gpus):
    assert res.peak_gpus_in_use <= cluster_gpus
    assert all(g <= cluster_gpus for _, g in res.timeline)
    for j in res.jobs:
        if j.elastic and j.end_s is not None:
            assert j.processed == pytest.approx(j.total_samples, rel=1e-9)
        elif j.elastic:
            assert j.processed < j.total_samples


def test_conservation_on_a_busy_toy_workload():
    jobs = [toy_job(f"j{i}", 37.0 * i, 50_000 + 13_000 * (i % 7), max_gpus=8 if i % 3 else 4) for i in range(40)]
    res = run(jobs, EqualShare(), nodes=3)
    assert res.stopped == "done"
    assert summarize(res)["jobs_completed"] == 40
    assert summarize(res)["rescales"] > 0
    _check_conservation(res, 12)


def test_horizon_stops_and_counts_unfinished():
    jobs = [toy_job(f"j{i}", 10.0 * i, 400_000) for i in range(6)]
    res = run(jobs, Requested(), horizon_s=2000.0)
    m = summarize(res)
    assert res.stopped == "horizon"
    assert m["jobs_completed"] < 6
    assert res.end_s == 2000.0
    _check_conservation(res, 4)


def test_stuck_run_ends():
    """A job whose minimum exceeds the cluster never starts; the run ends as 'stuck'."""
    jobs = [toy_job("big", 0.0, 1000, min_gpus=8, max_gpus=8)]
    res = run(jobs, Requested())
    assert res.stopped == "stuck"
    assert summarize(res)["jobs_completed"] == 0


def test_determinism_synthetic_same_seed_same_result():
    def once(seed):
        jobs = synthetic(rate_per_h=30, hours=2, seed=seed)
        res = Simulation(jobs, EqualShare(), SimConfig(nodes=4, horizon_s=4 * 3600)).run()
        m = summarize(res)
        m.pop("sim_wall_s")
        m.pop("policy_solve_s")
        return m, [(j.name, j.end_s) for j in res.jobs]

    a, b, c = once(3), once(3), once(4)
    assert a == b
    assert a != c


def test_per_job_restart_cost_from_the_spec():
    """B's spec says restart_s=90: split 10:35 like the defaults -> 20 s checkpoint + 70 s restart.

    One node; A (60,000) and B (200,000) both at t=0, equal share: 2 GPUs each from 0. A done at 300.
    t=300 cycle... B was started at 0 (cooldown 0): at 300 B grows 2 -> 4: processed 300*200 = 60,000;
    ack at 320, trains on 4 from 390: remaining 140,000 / 400 = 350 -> done at 740.
    """
    jobs = [toy_job("A", 0.0, 60_000), toy_job("B", 0.0, 200_000, restart_s=90.0)]
    res = run(jobs, EqualShare())
    out = {j.name: j for j in res.jobs}
    assert out["A"].jct_s == pytest.approx(300.0)
    assert out["B"].jct_s == pytest.approx(740.0)
    assert out["B"].lost_gpu_s == pytest.approx(20 * 2 + 70 * 4)


def test_scattered_gpus_do_not_block_a_start():
    """Two 3-GPU static jobs (one per node, 10,000 s) leave 1 free GPU on each node. The policy gives
    the elastic job the 2 GPUs left, which Slurm cannot place on one node: the planner starts it on 1
    (at t=0), where it runs 100,000 / 100 = 1000 s. Without the placement gate it would wait 10,000 s."""
    jobs = [
        WorkloadJob(name="S1", arrival_s=0.0, spec=None, gpus=3, duration_s=10_000.0),
        WorkloadJob(name="S2", arrival_s=0.0, spec=None, gpus=3, duration_s=10_000.0),
        toy_job("E", 0.0, 100_000, max_gpus=2),
    ]
    res = run(jobs, EqualShare(), nodes=2)
    out = {j.name: j for j in res.jobs}
    assert out["E"].jct_s == pytest.approx(1000.0)
    assert [(t, g) for t, g, _ in out["E"].sizes] == [(0.0, 1)]


def test_goodput_work_model_slows_progress_by_the_efficiency():
    """With an efficiency of 0.5 at the job's batch, 100,000 samples of work on 4 GPUs (400/s) take
    500 s instead of 250 s."""

    class Half:
        b0 = 1

        def efficiency(self, batch, samples):
            return 0.5

        def noise_scale(self, batch, samples):
            return None

        def next_change(self, samples):
            return float("inf")

    class HalfEfficient(Simulation):
        @staticmethod
        def _grad_trace(model):
            return Half()

    jobs = [toy_job("A", 0.0, 100_000)]
    cfg = SimConfig(nodes=1, gpus_per_node=4, planner=PlannerConfig(cooldown_s=0.0))
    plain = Simulation(jobs, EqualShare(), cfg, model_for_job=lambda w: MODEL).run()
    good = HalfEfficient(jobs, EqualShare(), replace(cfg, work_model="goodput"), model_for_job=lambda w: MODEL).run()
    assert plain.jobs[0].jct_s == pytest.approx(250.0)
    assert good.jobs[0].jct_s == pytest.approx(500.0)


@pytest.mark.parametrize("objective", ["throughput", "goodput"])
def test_goodput_work_model_on_measured_profiles(objective):
    from slurm_elastic.policies import get_policy

    jobs = synthetic(rate_per_h=20, hours=1, seed=5)
    cfg = SimConfig(nodes=4, work_model="goodput")
    res = Simulation(jobs, get_policy("dp", objective=objective), cfg).run()
    assert res.stopped == "done" and summarize(res)["jobs_completed"] == len(jobs)
    for j in res.jobs:
        assert j.processed == pytest.approx(j.total_samples, rel=1e-9)
    # The measured efficiencies (< 1 above an app's initial batch) made some job take longer.
    base = Simulation(jobs, get_policy("dp", objective=objective), SimConfig(nodes=4)).run()
    assert any(g.jct_s > b.jct_s + 1.0 for g, b in zip(res.jobs, base.jobs, strict=True))


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_a_share_of_jobs_reports_no_work_left_the_same_jobs_every_cycle(share):
    # silent_share: some users' loops say their dataset size and epochs, others' do not; which jobs are
    # silent is a property of the job (a hash of its name), not of the cycle
    seen: dict = {}

    class Recording(EqualShare):
        def allocate(self, problem):
            for r in problem.jobs:
                seen.setdefault(r.job_id, set()).add(r.remaining_samples is None)
            return super().allocate(problem)

    jobs = synthetic(rate_per_h=40, hours=1, seed=5)
    # every report as it comes (no trust rule, which withholds a claim until it is borne out)
    Simulation(jobs, Recording(), SimConfig(nodes=4, horizon_s=3 * 3600, silent_share=share, trust_claims=False)).run()
    assert len(seen) == len(jobs) and all(len(v) == 1 for v in seen.values())
    silent = sum(v == {True} for v in seen.values())
    if share == 0.0:
        assert silent == 0
    elif share == 1.0:
        assert silent == len(jobs)
    else:
        assert 0.25 * len(jobs) < silent < 0.75 * len(jobs)
