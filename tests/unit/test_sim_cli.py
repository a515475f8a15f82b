"""``slurm-elastic simulate`` end to end through click."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from slurm_elastic.cli import main

TRACE = """arrival_s,name,kind,profile,gpus,batch,total_samples,duration_s
0,a,elastic,cifar10,2,512,2e6,
30,b,elastic,bert,1,12,2e5,
60,s,static,,4,,,900
90,c,elastic,yolov3,4,64,1e5,
"""
KEYS = {"jobs_total", "jobs_completed", "avg_jct_s", "median_jct_s", "p95_jct_s", "avg_queue_s", "gpu_utilization",
        "rescales"}


def test_simulate_compare_json(tmp_path):
    w = tmp_path / "t.csv"
    w.write_text(TRACE)
    out = tmp_path / "m.json"
    r = CliRunner().invoke(main, ["simulate", "--workload", str(w), "--compare", "dp,fixed-batch,static",
                                  "--nodes", "2", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "avg JCT" in r.output
    data = json.loads(out.read_text())
    assert set(data) == {"dp", "fixed-batch", "static"}
    for m in data.values():
        assert KEYS <= set(m)
        assert m["jobs_total"] == 4 and m["jobs_completed"] == 4
        assert 0 <= m["gpu_utilization"] <= 1
    # Same inputs, same numbers (wall times aside).
    r2 = CliRunner().invoke(main, ["simulate", "--workload", str(w), "--compare", "dp,fixed-batch,static",
                                   "--nodes", "2", "--json", "-"])
    again = json.loads(r2.output[r2.output.index("{"):])
    strip = lambda d: {p: {k: v for k, v in m.items() if k not in ("sim_wall_s", "policy_solve_s")} for p, m in d.items()}  # noqa: E731
    assert strip(again) == strip(data)


def test_simulate_errors_name_the_line(tmp_path):
    w = tmp_path / "t.csv"
    w.write_text(TRACE + "120,d,elastic,cifar10,2,512,,\n")
    r = CliRunner().invoke(main, ["simulate", "--workload", str(w)])
    assert r.exit_code != 0 and "t.csv:6" in r.output and "total_samples" in r.output
    good = tmp_path / "good.csv"
    good.write_text(TRACE)
    r = CliRunner().invoke(main, ["simulate", "--workload", str(good), "--policy", "nosuch"])
    assert r.exit_code != 0 and "unknown policy 'nosuch'" in r.output
    r = CliRunner().invoke(main, ["simulate"])
    assert r.exit_code != 0 and "--workload" in r.output


def test_simulate_write_trace_roundtrip(tmp_path):
    out = tmp_path / "syn.csv"
    r = CliRunner().invoke(main, ["simulate", "--rate", "20", "--jobs", "15", "--seed", "4", "--write-trace", str(out)])
    assert r.exit_code == 0, r.output
    r2 = CliRunner().invoke(main, ["simulate", "--workload", str(out), "--policy", "static", "--json", "-", "--nodes", "4"])
    assert r2.exit_code == 0, r2.output
    assert json.loads(r2.output[r2.output.index("{"):])["static"]["jobs_total"] == 15


def test_simulate_plots_and_sweep(tmp_path):
    pytest.importorskip("matplotlib")
    w = tmp_path / "t.csv"
    w.write_text(TRACE)
    figs = tmp_path / "figs"
    r = CliRunner().invoke(main, ["simulate", "--workload", str(w), "--compare", "dp,static", "--nodes", "2",
                                  "--plot", str(figs), "--progress"])
    assert r.exit_code == 0, r.output
    for name in ("jct_cdf.png", "utilization.png"):
        assert (figs / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = CliRunner().invoke(main, ["simulate", "--sweep", "10,30", "--hours", "1", "--compare", "dp,static",
                                  "--nodes", "2", "--plot", str(figs), "--json", str(tmp_path / "s.json")])
    assert r.exit_code == 0, r.output
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["dp"]["rate_per_h"] == [10.0, 30.0] and len(s["dp"]["runs"]) == 2
    assert (figs / "sweep.png").read_bytes()[:4] == b"\x89PNG"
