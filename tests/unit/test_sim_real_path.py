"""The simulator drives the real cycle: the registry's policies, the planner and the enactor.

No policy is re-implemented for simulation: ``Simulation`` calls ``enact.run_cycle`` (the daemon's
cycle), which calls ``policy.allocate`` of ``policies.get_policy(name)`` and ``planner.plan``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from slurm_elastic import enact, planner
from slurm_elastic.policies import get_policy
from slurm_elastic.sim.engine import SimConfig, Simulation
from slurm_elastic.sim.metrics import summarize
from slurm_elastic.sim.workloads import read_pollux, synthetic

POLLUX_1 = Path(__file__).resolve().parents[3] / "shared" / "data" / "pollux" / "workloads" / "workload-1.csv"


def spy(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def wrapper(*a, **kw):
        out = real(*a, **kw)
        calls.append(out)
        return out

    monkeypatch.setattr(module, name, wrapper)
    return calls


@pytest.mark.parametrize("policy", ["dp", "fixed-batch", "static"])
def test_simulation_runs_the_registry_policy_through_the_planner(monkeypatch, policy):
    plans = spy(monkeypatch, planner, "plan")
    cycles = spy(monkeypatch, enact, "run_cycle")
    pol = get_policy(policy)
    allocs = spy(monkeypatch, pol, "allocate")
    jobs = synthetic(rate_per_h=40, hours=1.5, seed=2)
    res = Simulation(jobs, pol, SimConfig(nodes=4)).run()
    assert res.stopped == "done" and res.policy == policy
    # one plan per cycle, and one more per re-solve (a grow with no place: enact.RESOLVES); the cycle's
    # own plan is the one carried out
    used = [c.plan for c in cycles]
    assert len(cycles) == res.cycles <= len(plans) and all(any(p is u for p in plans) for u in used)
    assert allocs and all(a.policy == policy for a in allocs)
    started = sum(len(p.of_kind("start")) for p in used)
    held_again = sum(len(p.of_kind("hold")) for p in used)
    assert started == len(jobs) + held_again  # every job started by a planner action, none behind its back
    resized = sum(len(p.of_kind("resize")) for p in used)
    assert resized == summarize(res)["rescales"]
    if policy == "static":
        assert resized == 0
    for j in res.jobs:
        assert j.processed == pytest.approx(j.total_samples, rel=1e-9)
    assert res.peak_gpus_in_use <= 16


@pytest.mark.skipif(not POLLUX_1.exists(), reason="shared/data not beside the checkout")
def test_pollux_workload_conservation_under_dp():
    jobs = read_pollux(POLLUX_1)[:60]
    res = Simulation(jobs, get_policy("dp"), SimConfig()).run()
    m = summarize(res)
    assert m["jobs_completed"] == 60 and res.stopped == "done"
    assert res.peak_gpus_in_use <= 64 and all(g <= 64 for _, g in res.timeline)
    for j in res.jobs:
        assert j.processed == pytest.approx(j.total_samples, rel=1e-9)
        assert j.start_s >= j.arrival_s and j.end_s > j.start_s
    assert 0 < m["gpu_utilization"] <= 1
