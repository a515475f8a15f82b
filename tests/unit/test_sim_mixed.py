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
