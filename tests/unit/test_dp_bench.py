"""``slurm-elastic bench allocator --json``: the keys scripts read, and the cross-checks it reports.

(This checks the command's output, not its speed: speed is what the command prints.)
"""

from __future__ import annotations

import json

from click.testing import CliRunner

from slurm_elastic.commands.bench import bench, random_problem


def test_bench_allocator_json_small():
    r = CliRunner().invoke(bench, ["allocator", "--jobs", "30", "--gpus", "64", "--repeats", "2", "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output.strip().splitlines()[-1])
    assert doc["jobs"] == 30 and doc["gpus"] == 64
    for name in ("dp", "dp_policy", "reference", "milp"):
        s = doc["solvers"][name]
        assert s["status"] == "ok", s
        assert s["median_s"] > 0 and s["peak_rss_mib"] > 0
    assert doc["objectives_equal"] is True and doc["reference_equal"] is True and doc["policy_equal"] is True
    assert doc["dp_size"]["capacity"] > 0 and doc["compile_s"] is not None
    assert set(doc["baselines"]) == {"fixed-batch", "static"}


def test_reference_is_skipped_not_faked_when_too_big():
    r = CliRunner().invoke(bench, ["allocator", "--jobs", "30", "--gpus", "64", "--repeats", "1", "--solvers",
                                   "dp,reference", "--max-ref-ops", "10", "--json"])
    doc = json.loads(r.output.strip().splitlines()[-1])
    assert doc["solvers"]["reference"]["median_s"] is None
    assert doc["solvers"]["reference"]["status"].startswith("skipped")
    assert doc["reference_equal"] is None and doc["objectives_equal"] is None


def test_random_problem_is_seeded():
    a, b = random_problem(50, 128, 3), random_problem(50, 128, 3)
    assert [(j.spec, j.running_gpus, j.running_batch) for j in a.jobs] == \
        [(j.spec, j.running_gpus, j.running_batch) for j in b.jobs]
    assert sum(j.running_gpus for j in a.jobs) <= 128


def test_policies_are_feasible_on_a_bench_instance():
    from test_dp_exact import check_feasible

    from slurm_elastic.policies import get_policy

    problem = random_problem(300, 256, 5)
    for name, opts in (("dp", {}), ("dp", {"admission": "joint"}), ("fixed-batch", {}), ("static", {})):
        alloc = get_policy(name, **opts).allocate(problem)
        check_feasible(problem, alloc)
        for r in problem.jobs:  # no preemption: every running job keeps at least its minimum
            if r.is_running:
                assert alloc.jobs[r.job_id].gpus > 0
