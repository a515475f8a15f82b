"""sim/mixed.py: rigid and elastic jobs in one queue through the daemon's cycle, against plain Slurm."""

from __future__ import annotations

import math

from slurm_elastic.sim.mixed import as_rigid, mix, mixed_markdown, mixed_study
from slurm_elastic.sim.workloads import synthetic


def test_mix_keeps_the_trace_and_makes_the_chosen_share_elastic():
    base = synthetic(rate_per_h=20.0, seed=1, jobs=20, node_size=4)
    m = mix(base, 0.25, 1, 4)
    assert [w.name for w in m] == [w.name for w in base] and sum(w.elastic for w in m) == 5
    r = as_rigid(base[0], 4)
    assert r.gpus == base[0].spec.requested_gpus and r.duration_s > 0


def test_rigid_jobs_wait_at_most_a_cycle_plus_a_rescale_more_than_under_plain_slurm():
    doc = mixed_study(jobs=50, nodes=4, rate_per_h=40.0, fractions=(0.5,))
    (row,) = doc["rows"]
    assert row["stopped"] == "done" and row["unfinished"] == 0 and row["delay_n"] == row["rigid"] > 0
    assert row["delay_max_s"] <= doc["bound_s"]
    assert row["elastic_jct_mean_s"] < row["elastic_jct_plain_mean_s"]
    assert not math.isnan(row["rigid_wait_plain_mean_s"]) and "| 50% |" in mixed_markdown(doc)


def test_simulated_slurm_groups_types_and_drain():
    from slurm_elastic.backends.simulated import SimulatedSlurm

    sim = SimulatedSlurm(groups=((2, 4, "k80", "k80"), (1, 8, "v100", "v100")))
    nodes = {n.name: n for n in sim.list_nodes()}
    assert [(n.gpus_total, n.partitions, n.gpu_type) for n in nodes.values()] == [
        (4, ("k80",), "k80"), (4, ("k80",), "k80"), (8, ("v100",), "v100")]
    sim.drain("sim0000")
    assert "DRAIN" in sim.list_nodes()[0].state_flags and not sim.list_nodes()[0].usable
    a = sim.submit(name="r", gpus_per_node=4, num_nodes=1, duration_s=100, gpu_type="k80")
    b = sim.submit(name="r2", gpus_per_node=4, num_nodes=1, duration_s=100, partition="k80")
    c = sim.submit(name="r3", gpus_per_node=8, num_nodes=1, duration_s=100)
    jobs = {j.job_id: j for j in sim.list_jobs()}
    assert jobs[a].nodes == ("sim0001",) and jobs[a].gpu_type == "k80"
    assert jobs[b].state == "PENDING"  # the k80 node left is drained; v100 is not in its partition
    assert jobs[c].nodes == ("sim0002",)


def test_type_aware_allocation_beats_type_blind_and_runs_inside_the_pools():
    from slurm_elastic.sim.mixed import hetero_study

    doc = hetero_study(jobs=30, nodes_per_type=2)
    aware, blind = doc["rows"]
    assert aware["finished"] == blind["finished"] == 30
    assert aware["jct_mean_s"] < blind["jct_mean_s"]


def test_the_issues_scenario_rigid_8_gpu_job_starts_within_two_cycles_and_a_rescale():
    """4 x 4 GPUs, two elastic jobs of 1-16 GPUs fill the cluster; a plain 2 x 4 GPU job arrives."""
    from dataclasses import replace

    from slurm_elastic.policies import get_policy
    from slurm_elastic.sim.engine import SimConfig, Simulation
    from slurm_elastic.sim.workloads import WorkloadJob, app_spec, profile_model, samples_in

    spec = replace(app_spec("cifar10", gpus=8, batch=1024, node_size=4), min_gpus=1, max_gpus=16)
    total = samples_in(spec, profile_model("cifar10"), 4 * 3600.0, 4)
    wl = [WorkloadJob("e1", 0.0, spec, total_samples=total), WorkloadJob("e2", 1.0, spec, total_samples=total),
          WorkloadJob("rigid", 1830.0, None, gpus=8, duration_s=600.0)]
    cfg = SimConfig(nodes=4, gpus_per_node=4, interval_s=60.0, horizon_s=4000.0)
    res = Simulation(wl, get_policy("dp"), cfg).run()
    out = {o.name: o for o in res.jobs}
    assert sum(s[1] for o in (out["e1"], out["e2"]) for s in o.sizes[:1]) >= 12  # they filled the cluster
    wait = out["rigid"].start_s - out["rigid"].arrival_s
    print(f"rigid 8-GPU job waited {wait:.1f} s")
    assert wait <= 2 * cfg.interval_s + cfg.rescale_cost_s
