"""Nothing a user writes sets the cost of a cycle (issue 24): specs with the widest ranges the parser (and
the plugin) accept go through the caps, problem building, every policy and a whole daemon cycle, and each
finishes. A worker thread with a join timeout turns a hang into a failure: the timeout is a correctness
guard (before the fix a cap cut listed 2**40 batches and never returned), not a speed assertion."""

from __future__ import annotations

import threading

import pytest

from slurm_elastic.backends.simulated import SimulatedSlurm
from slurm_elastic.daemon.caps import CappedPolicy
from slurm_elastic.daemon.config import config_from_dict
from slurm_elastic.daemon.loop import Daemon
from slurm_elastic.policies import POLICY_NAMES, get_policy
from slurm_elastic.policies.base import AllocationProblem, JobRequest
from slurm_elastic.profiles import load_profile
from slurm_elastic.spec import (
    MAX_ACCUM_LIMIT,
    MAX_BATCH_LIMIT,
    MAX_GPUS_LIMIT,
    ElasticSpec,
    SpecError,
    parse_spec,
)

GUARD_S = 120.0
B, G, A = MAX_BATCH_LIMIT, MAX_GPUS_LIMIT, MAX_ACCUM_LIMIT
# The widest specs parse_spec accepts, and the shapes that used to be slow (a narrow micro-batch with the
# most accumulation steps: every share needs a divisor search; a batch range far above max_local_batch).
HOSTILE = {
    "widest": f"elastic:min_gpus=1,max_gpus={G},min_batch=1,max_batch={B},max_local_batch={B},max_accum={A}",
    "narrow-local": f"elastic:min_gpus=1,max_gpus={G},min_batch=1,max_batch={B},max_local_batch=7,"
                    f"min_local_batch=7,max_accum={A}",
    "high-range": f"elastic:min_gpus=1,max_gpus={G},min_batch={B - 4096},max_batch={B},max_local_batch=4093,"
                  f"max_accum={A}",
    "shaped": f"elastic:min_gpus=2,max_gpus={G},min_batch=1,max_batch={B},max_local_batch={B},max_accum={A},"
              f"gpus_per_node=2,batch={B}",
}


def finishes(fn, *args, **kw):
    """fn(*args) on a thread; fail (not hang) if it does not return within GUARD_S."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn(*args, **kw)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(GUARD_S)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} did not finish within {GUARD_S:.0f} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_the_limits_are_what_the_parser_accepts():
    for comment in HOSTILE.values():
        parse_spec(comment)
    with pytest.raises(SpecError, match="exceeds the limit"):
        parse_spec(f"elastic:min_gpus=1,max_gpus=8,min_batch=1,max_batch={B + 1},max_local_batch=8")
    with pytest.raises(SpecError, match="exceeds the limit"):
        parse_spec(f"elastic:min_gpus=1,max_gpus=8,min_batch=1,max_batch=8,max_local_batch={1 << 40}")


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_spec_arithmetic_on_hostile_ranges_is_bounded(name):
    spec = parse_spec(HOSTILE[name])
    counts = finishes(spec.allowed_gpu_counts, 8, most=64)
    assert counts and max(counts) <= 64
    for k in counts:
        b = finishes(spec.nearest_batch, k, B // 3)
        if b is not None:
            assert spec.split_batch(k, b) is not None
    lo, hi = spec.share_bounds(1)
    if hi - lo >= 1 << 16:
        with pytest.raises(ValueError, match="more than"):
            spec.feasible_batches(1)  # a listing refuses a huge range instead of walking it


def _jobs(names, running=False):
    model = load_profile("cifar10")
    jobs = []
    for i, name in enumerate(names):
        spec = parse_spec(HOSTILE[name])
        jobs.append(JobRequest(i + 1, spec, model, running_gpus=2 if running else 0,
                               running_batch=spec.nearest_batch(2, 4096) if running else None))
    return tuple(jobs)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_every_policy_finishes_on_hostile_ranges(policy):
    jobs = _jobs(sorted(HOSTILE)) + tuple(
        JobRequest(10 + j.job_id, j.spec, j.model, j.running_gpus, j.running_batch) for j in _jobs(sorted(HOSTILE), True))
    res = finishes(get_policy(policy).allocate, AllocationProblem(64, 8, jobs))
    assert sum(a.gpus for a in res.jobs.values()) <= 64
    for j in jobs:
        a = res.jobs[j.job_id]
        if a.gpus:
            assert j.spec.split_batch(a.gpus, a.batch) == (a.local_batch, a.accum)


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_caps_finish_on_hostile_ranges(policy):
    # The finding: two valid specs from one user at the widest ranges, cap 3 GPUs per user: the cap cut the
    # second job and listed its 2**40 batches. Now the cut takes the nearest batch from the bounds.
    jobs = _jobs(["widest", "widest", "narrow-local", "high-range"])
    users = {1: "eve", 2: "eve", 3: "ann", 4: "bob"}
    capped = CappedPolicy(get_policy(policy), max_gpus_per_user=3, max_gpus_per_job=G, user_of=users)
    res = finishes(capped.allocate, AllocationProblem(16, 4, jobs))
    assert res.jobs[1].gpus + res.jobs[2].gpus <= 3
    for j in jobs:
        a = res.jobs[j.job_id]
        if a.gpus:
            assert a.gpus <= 3 and j.spec.split_batch(a.gpus, a.batch) == (a.local_batch, a.accum)


def test_problem_building_and_a_daemon_cycle_finish_on_hostile_ranges(tmp_path):
    sim = SimulatedSlurm(nodes=4, gpus_per_node=4)
    model = load_profile("cifar10")
    for name in ("widest", "widest"):
        sim.submit(name="eve", gpus_per_node=1, comment=HOSTILE[name], user="eve", total_samples=1e12, model=model)
    for name in ("narrow-local", "high-range", "shaped"):
        sim.submit(name=name, gpus_per_node=1, comment=HOSTILE[name], user="mallory", total_samples=1e12, model=model)
    ok = sim.submit(name="ann", gpus_per_node=1, user="ann", total_samples=1e6, model=model,
                    comment="elastic:min_gpus=1,max_gpus=4,min_batch=128,max_batch=1024,max_local_batch=256,"
                            "profile=cifar10")
    cfg = config_from_dict({"state_dir": str(tmp_path), "metrics_address": "", "cooldown_s": 0,
                            "max_gpus_per_user": 3, "policy": "dp"})

    def three_cycles():  # the daemon's SQLite handle belongs to the thread that opens it
        d = Daemon(cfg, backend=sim, ack=sim, clock=lambda: sim.now)
        d.open()
        try:
            for _ in range(3):
                d.cycle()
                sim.advance_to(sim.now + 20)
        finally:
            d.close()

    finishes(three_cycles)
    assert sim.get_job(ok).is_running, sim.get_job(ok)
    running = [j for j in sim.active.values() if j.state == "RUNNING"]
    assert sum(j.gpus_per_node * j.num_nodes for j in running if j.user == "eve") <= 3


def test_spec_bounds_round_trip():
    s = ElasticSpec(1, G, 1, B, B, max_accum=A)
    assert parse_spec(s.to_comment()) == s
