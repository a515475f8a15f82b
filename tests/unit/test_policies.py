"""Policy semantics: admission, backfill and starvation, preemption, restart costs, reasons, baselines."""

from __future__ import annotations

import pytest

from slurm_elastic.policies import POLICY_NAMES, AllocationProblem, JobRequest, get_policy
from slurm_elastic.profiles.base import ThroughputModel
from slurm_elastic.spec import ElasticSpec


class Amdahl(ThroughputModel):
    """step = compute(local batch) + sync(k): a clean, sub-linear scaling model for readable tests."""

    def __init__(self, per_sample=0.001, fixed=0.01, sync=0.02):
        self.per_sample, self.fixed, self.sync = per_sample, fixed, sync

    def step_time(self, gpus, nodes, local_batch):
        s = self.sync * (gpus > 1) + 0.01 * (nodes > 1)
        return self.fixed + self.per_sample * local_batch + s, s


MODEL = Amdahl()


def spec(min_gpus=1, max_gpus=8, min_batch=32, max_batch=1024, max_local=256, **kw):
    return ElasticSpec(min_gpus, max_gpus, min_batch, max_batch, max_local, **kw)


def job(i, s=None, running=0, batch=None, **kw):
    return JobRequest(i, s or spec(), MODEL, running, batch, **kw)


def solve(jobs, gpus=16, node_size=4, policy="dp", **kw):
    opts = kw.pop("options", {})
    if policy == "dp":  # these tests pin the paper's throughput objective and priority admission;
        opts.setdefault("objective", "throughput")  # goodput/completion and joint admission are tested apart
        opts.setdefault("admission", "priority")
    return get_policy(policy, **opts).allocate(AllocationProblem(gpus, node_size, tuple(jobs), **kw))


def test_registry():
    assert set(POLICY_NAMES) == {"dp", "fixed-batch", "static", "pollux-dp", "tiresias", "sia", "gavel"}
    for name in POLICY_NAMES + ("fixed_batch",):
        assert get_policy(name).name in POLICY_NAMES
    with pytest.raises(KeyError, match="unknown policy"):
        get_policy("magic")


def test_running_jobs_keep_their_minimum_without_preemption():
    jobs = [job(0, spec(min_gpus=8, max_gpus=16), wait_s=1e6),  # pending, high priority, large
            job(1, spec(min_gpus=2), running=4, batch=256), job(2, spec(min_gpus=2), running=4, batch=256)]
    a = solve(jobs, gpus=8)
    assert a.jobs[1].gpus >= 2 and a.jobs[2].gpus >= 2
    assert a.jobs[0].gpus == 0 and "needs 8 GPUs, 4 left" in a.jobs[0].reason


def test_preemption_lets_priority_win():
    jobs = [job(0, spec(min_gpus=8, max_gpus=16)), job(1, spec(min_gpus=2), running=4, batch=256)]
    a = solve(jobs, gpus=8, allow_preemption=True)
    assert a.jobs[0].gpus == 8 and a.jobs[1].gpus == 0
    assert a.jobs[1].reason.startswith("preempted")
    assert solve(jobs, gpus=8).jobs[1].gpus > 0  # without preemption it keeps running


def test_backfill_small_job_passes_blocked_large_one():
    jobs = [job(0, running=4, batch=256, s=spec(min_gpus=4)), job(1, spec(min_gpus=8, max_gpus=8)), job(2)]
    a = solve(jobs, gpus=8)
    assert a.jobs[1].gpus == 0 and a.jobs[1].reason == "pending: needs 8 GPUs, 4 left after higher-priority minimums"
    assert a.jobs[2].gpus >= 1 and a.jobs[2].reason.startswith("admitted")
    # a job larger than the whole pool is not a blocker: it cannot run here at all
    big = solve([job(1, spec(min_gpus=16, max_gpus=16), wait_s=1e6), job(2)], gpus=8)
    assert big.jobs[1].reason.startswith("pending: no allowed GPU count <= 8") and big.jobs[2].gpus > 0


def test_starving_job_stops_later_jobs_from_passing():
    jobs = [job(0, running=4, batch=256, s=spec(min_gpus=4)), job(1, spec(min_gpus=8, max_gpus=8), wait_s=7200),
            job(2)]
    a = solve(jobs, gpus=8, options={"starvation_s": 3600})
    assert a.jobs[1].gpus == 0 and a.jobs[2].gpus == 0
    assert "held for starving job 1" in a.jobs[2].reason
    # once the running job's minimum leaves room, the starving job is admitted first
    jobs[0] = job(0, running=4, batch=256, s=spec(min_gpus=1))
    b = solve(jobs, gpus=9, options={"starvation_s": 3600})
    assert b.jobs[1].gpus == 8 and b.jobs[0].gpus == 1


def test_restart_cost_keeps_small_gains_from_rescaling():
    jobs = [job(0, spec(max_gpus=4, restart_s=3000), running=2, batch=512)]
    a = solve(jobs, gpus=4)
    assert a.jobs[0].gpus == 2 and a.jobs[0].batch == 512
    assert a.jobs[0].reason.startswith("kept: gain below restart cost ("), a.jobs[0].reason
    jobs = [job(0, spec(max_gpus=4, restart_s=0.0), running=2, batch=512)]
    b = solve(jobs, gpus=4)
    assert b.jobs[0].gpus == 4 and b.jobs[0].reason.startswith("grown 2->4: +")
    assert b.jobs[0].samples_per_s > a.jobs[0].samples_per_s


def test_shrink_reason_and_capacity():
    jobs = [job(0, running=8, batch=1024), job(1, spec(weight=5.0))]
    a = solve(jobs, gpus=8)
    assert a.gpus_used() <= 8 and a.jobs[1].gpus > 0
    assert a.jobs[0].reason.startswith("shrunk 8->") and "samples/s" in a.jobs[0].reason


def test_capacity_below_running_minimums_stops_lowest_priority():
    jobs = [job(0, spec(min_gpus=4), running=4, batch=256), job(1, spec(min_gpus=4), running=4, batch=256)]
    a = solve(jobs, gpus=6)
    assert a.jobs[0].gpus >= 4 and a.jobs[1].gpus == 0
    assert "running minimums exceed" in a.jobs[1].reason


def test_dp_chooses_batch_with_accumulation_when_it_pays():
    slow_sync = Amdahl(sync=0.5)
    s = spec(min_gpus=4, max_gpus=4, max_batch=4096, max_local=128, max_accum=8)
    a = get_policy("dp", objective="throughput").allocate(AllocationProblem(4, 4, (JobRequest(0, s, slow_sync),)))
    ja = a.jobs[0]
    assert ja.accum > 1 and ja.gpus * ja.local_batch * ja.accum == ja.batch
    assert s.split_batch(ja.gpus, ja.batch) == (ja.local_batch, ja.accum)


def test_joint_admission_may_leave_a_pending_job_out():
    # joint: a pending job starts only if that beats giving its GPUs to others
    jobs = [job(0, spec(min_gpus=1, weight=10.0), running=1, batch=32), job(1, spec(min_gpus=4, weight=0.1))]
    a = solve(jobs, gpus=8, options={"admission": "joint"})
    p = solve(jobs, gpus=8)
    assert p.jobs[1].gpus >= 4  # priority admission starts it
    assert a.objective >= p.objective - 1e-12


def test_fixed_batch_keeps_the_requested_batch():
    jobs = [job(0, spec(batch=384, max_gpus=16)), job(1, spec(batch=96, max_gpus=16)), job(2, spec(batch=1000))]
    a = solve(jobs, gpus=16, policy="fixed-batch")
    for i, b in ((0, 384), (1, 96), (2, 1000)):
        ja = a.jobs[i]
        if ja.gpus:
            assert ja.batch == b and b % ja.gpus == 0
    assert a.gpus_used() <= 16


def test_static_is_fifo_and_never_resizes():
    jobs = [job(0, spec(gpus=4), running=4, batch=256), job(1, spec(gpus=8, max_gpus=8)), job(2, spec(gpus=1))]
    a = solve(jobs, gpus=8, policy="static")
    assert (a.jobs[0].gpus, a.jobs[0].batch) == (4, 256)
    assert a.jobs[1].gpus == 0 and a.jobs[2].gpus == 0
    assert a.jobs[2].reason == "pending: FIFO behind job 1"
    b = solve([jobs[0], jobs[2]], gpus=8, policy="static")
    assert b.jobs[2].gpus == 1 and b.jobs[2].batch == 32


def test_dp_beats_baselines_on_example_mix():
    jobs = [job(i, spec(batch=64, gpus=2)) for i in range(3)]
    res = {p: solve(jobs, gpus=12, policy=p).objective for p in POLICY_NAMES}
    assert res["dp"] >= res["fixed-batch"] >= res["static"] > 0
    assert res["dp"] > res["static"]


def test_the_request_restart_cost_wins_over_the_spec_claim():
    # problem.py hands the policy the measured cost, else the spec's bounded claim, else the default:
    # a spec may not override a measured cost (a claim of days would make the job unshrinkable)
    from slurm_elastic.policies._candidates import _restart_share

    prob = AllocationProblem(8, 4, (), horizon_s=1000.0)
    assert _restart_share(job(0, spec(restart_s=1e6), restart_s=45.0), prob, None) == pytest.approx(0.045)
    assert _restart_share(job(0, spec(restart_s=100.0)), prob, None) == pytest.approx(0.1)  # no figure: the spec's
    assert _restart_share(job(0, spec()), prob, None) == pytest.approx(0.045)  # neither: 45 s
