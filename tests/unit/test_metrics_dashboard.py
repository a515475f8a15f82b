"""The daemon's Prometheus metrics as a site sees them: the Grafana dashboard queries only what a real daemon
renders (names, the labels it groups and filters by, the label values it matches), and a second daemon on
the same host keeps running when the metrics port is taken (issue 21)."""

import json
import logging
import re
import socket
from pathlib import Path

import pytest

from slurm_elastic.backends.base import SlurmError
from slurm_elastic.backends.simulated import SimulatedSlurm
from slurm_elastic.daemon.config import config_from_dict
from slurm_elastic.daemon.loop import Daemon
from slurm_elastic.daemon.metrics import Metrics, metric_names
from slurm_elastic.profiles import load_profile

DASHBOARD = Path(__file__).resolve().parents[2] / "packaging" / "grafana" / "slurm-elastic.json"
SPEC_A = "elastic:min_gpus=1,max_gpus=8,min_batch=128,max_batch=4096,max_local_batch=512,batch=256,profile=cifar10"
SPEC_B = "elastic:min_gpus=2,max_gpus=4,min_batch=128,max_batch=2048,max_local_batch=512,batch=256,profile=cifar10"
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "inf", "nan"}
SCRAPE_LABELS = {"instance", "job"}  # added by Prometheus to every series it scrapes


def expressions(dashboard: dict) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def parse_promql(expr: str) -> tuple[set[str], dict[str, set[str]], dict[str, dict[str, str]]]:
    """(metric names, {metric: labels grouped by around it}, {metric: {label: value matched with =}})."""
    expr = expr.replace("$__all", "")
    names: set[str] = set()
    matchers: dict[str, dict[str, str]] = {}
    for m in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*\{([^}]*)\}", expr):
        names.add(m.group(1))
        for lm in re.finditer(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!=|!~|=)\s*"([^"]*)"', m.group(2)):
            if lm.group(2) == "=":
                matchers.setdefault(m.group(1), {})[lm.group(1)] = lm.group(3)
            else:
                matchers.setdefault(m.group(1), {}).setdefault(lm.group(1), None)
    bare = re.sub(r"\{[^}]*\}|\[[^\]]*\]|\"[^\"]*\"", " ", expr)
    groups = re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", bare)
    bare = re.sub(r"\b(?:by|without)\s*\([^)]*\)", " ", bare)
    for m in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", bare):
        if not m.group(2) and m.group(1).lower() not in PROMQL_WORDS:
            names.add(m.group(1))  # a function is followed by "(", a metric is not
    grouped = {n: {lab.strip() for g in groups for lab in g.split(",") if lab.strip()} for n in names}
    return names, grouped, matchers


def test_the_parser_tells_metrics_from_functions_and_labels():
    names, grouped, matchers = parse_promql(
        'sum by (kind, outcome) (increase(slurm_elastic_actions_total{instance=~"$instance",kind="start"}[1h])) '
        '/ time() - max(slurm_x)')
    assert names == {"slurm_elastic_actions_total", "slurm_x"}
    assert grouped["slurm_elastic_actions_total"] == {"kind", "outcome"}
    assert matchers["slurm_elastic_actions_total"] == {"instance": None, "kind": "start"}


def rendered_by_a_daemon(tmp_path) -> str:
    """What a daemon really renders after admitting, growing and shrinking jobs and skipping a cycle."""
    sim = SimulatedSlurm(nodes=2, gpus_per_node=4, checkpoint_s=5, restart_s=10)
    model = load_profile("cifar10")
    cfg = config_from_dict({"state_dir": str(tmp_path), "metrics_address": "", "cooldown_s": 0, "restart_cost_s": 5,
                            "ack_timeout_s": 600})
    d = Daemon(cfg, backend=sim, ack=sim, clock=lambda: sim.now)
    d.open()
    try:
        sim.submit(name="A", gpus_per_node=1, comment=SPEC_A, total_samples=4e6, model=model)
        for _ in range(3):
            d.cycle()
            sim.advance_to(sim.now + 20)
        sim.submit(name="B", gpus_per_node=1, comment=SPEC_B, total_samples=2e5, model=model)
        for _ in range(20):
            d.cycle()
            sim.advance_to(sim.now + 5)
        real = sim.list_jobs

        def down():
            raise SlurmError("slurmctld down")
        sim.list_jobs = lambda *a, **k: down()
        d.cycle()
        sim.list_jobs = real
        d.cycle()
        return d.metrics.render()
    finally:
        d.close()


def labels_of(text: str) -> dict[str, dict[str, set[str]]]:
    out: dict[str, dict[str, set[str]]] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ", line)
        if m and not line.startswith("#"):
            labs = out.setdefault(m.group(1), {})
            for lm in re.finditer(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"', m.group(2) or ""):
                labs.setdefault(lm.group(1), set()).add(lm.group(2))
    return out


def test_every_metric_the_dashboard_queries_is_rendered_by_the_daemon(tmp_path):
    dashboard = json.loads(DASHBOARD.read_text())
    text = rendered_by_a_daemon(tmp_path)
    rendered = labels_of(text)
    assert set(rendered) == metric_names(text)
    assert set(Metrics.HELP) <= set(rendered), set(Metrics.HELP) - set(rendered)  # the run covers every metric
    queried: set[str] = set()
    for expr in expressions(dashboard):
        names, grouped, matchers = parse_promql(expr)
        assert names, expr
        queried |= names
        for name in names:
            assert name in rendered, f"{name} (in {expr!r}) is not exported by the daemon"
            labels = set(rendered[name]) | SCRAPE_LABELS
            assert grouped[name] <= labels, f"{expr!r} groups by {grouped[name] - labels}, which {name} lacks"
            for label, value in matchers.get(name, {}).items():
                assert label in labels, f"{expr!r} matches on {label}, which {name} lacks"
                if value is not None:
                    assert value in rendered[name][label], f"{expr!r}: {label}={value!r} never rendered"
    # the four: GPUs per job, decisions, cycle time, skipped cycles
    assert {"slurm_elastic_job_gpus", "slurm_elastic_actions_total", "slurm_elastic_cycle_seconds",
            "slurm_elastic_cycles_skipped_total"} <= queried
    var = next(v for v in dashboard["templating"]["list"] if v["name"] == "instance")
    assert parse_promql(var["definition"].replace("label_values(", "(").split(",")[0] + ")")[0] <= set(rendered)


def test_the_dashboard_is_grafana_json():
    d = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and d["uid"] and d["title"]
    for p in d["panels"]:
        assert p["datasource"]["uid"] == "${datasource}" and set(p["gridPos"]) == {"x", "y", "w", "h"}


def test_a_second_daemon_on_the_host_runs_without_metrics_when_the_port_is_taken(tmp_path, caplog):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    sim = SimulatedSlurm(nodes=1, gpus_per_node=4)
    cfg = config_from_dict({"state_dir": str(tmp_path), "metrics_address": "127.0.0.1", "metrics_port": port})
    d = Daemon(cfg, backend=sim, ack=sim, clock=lambda: sim.now)
    try:
        with caplog.at_level(logging.ERROR, logger="slurm_elastic"):
            d.open()
        assert d.server is None
        rec = next(r for r in caplog.records if r.getMessage().startswith("metrics endpoint not started"))
        assert rec.kv["address"] == f"127.0.0.1:{port}" and "metrics_port" in rec.kv["error"]
        assert d.cycle() is not None  # it schedules as usual
    finally:
        d.close()
        taken.close()


@pytest.mark.parametrize("render", ['a{x="1"} 2\n# HELP b\nb 3\n', "c 1\n"])
def test_metric_names(render):
    assert metric_names(render) <= {"a", "b", "c"}
