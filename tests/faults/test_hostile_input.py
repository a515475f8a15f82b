"""Malformed, out-of-range, huge, unicode and shell-metacharacter elastic specs, on the real cluster.

Through the daemon (jobs submitted without the submit plugin, so that bad specs reach it) and through
``sbatch`` with the plugin loaded (where they must be refused at submit). Each hostile spec embeds a
command that would create a canary file if any part of the chain handed it to a shell.
Plus hypothesis fuzzing of the whole cycle (spec parser -> problem -> policy -> planner) and of the
backend's JSON reading, byte-mutated; the number of cases run is recorded.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import pytest
from faultlib import jobs_by_id, scancel
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_elastic.cluster import ClusterError
from slurm_elastic.daemon.config import config_from_dict
from slurm_elastic.daemon.loop import Daemon

B = "min_batch=32,max_batch=256,max_local_batch=64"


def hostile(canary: Path) -> list[tuple[str, str | None]]:
    """(comment, the field the error must name) or None for a spec that is valid and must be capped."""
    c = str(canary)
    return [
        (f"elastic:min_gpus=1;touch {c},max_gpus=2,{B}", "min_gpus"),
        (f"elastic:min_gpus=1,max_gpus=2,{B},profile=$(touch {c})", "profile"),
        (f"elastic:min_gpus=1,max_gpus=2,{B},ckpt_dir=/tmp/`touch {c}`", "ckpt_dir"),
        (f"elastic:min_gpus=1,max_gpus=2,{B},ckpt_dir=/tmp/x;touch {c}", "ckpt_dir"),
        (f"elastic:min_gpus=1,max_gpus=2,{B},profile=a|touch {c}", "profile"),
        (f"elastic:min_gpus=1,max_gpus=2,{B},profile=x&&touch {c}", "profile"),
        (f"elastic:min_gpus=1,max_gpus=4,{B},batch=1000000000000000000", "batch"),
        (f"elastic:min_gpus=1,max_gpus=1000000000000000000,{B}", "max_gpus"),
        ("elastic:min_gpus=1,max_gpus=4,min_batch=32,max_batch=1000000000000000000,max_local_batch=64", "max_batch"),
        (f"elastic:min_gpus=\uff11,max_gpus=2,{B}", "min_gpus"),
        (f"elastic:m\u00edn_gpus=1,max_gpus=2,{B}", "m\u00edn_gpus"),
        (f"elastic:min_gpus=1,max_gpus=2,{B},profile=r\u00e9sum\u00e9\U0001f680", "profile"),
        (f"elastic:min_gpus=-1,max_gpus=2,{B}", "min_gpus"),
        (f"elastic:min_gpus=1,max_gpus=2,{B},weight=nan", "weight"),
        (f"elastic:min_gpus=1,max_gpus=2,{B},weight=1e308", "weight"),
        (f"elastic:min_gpus=1,max_gpus=2,max_gpus=3,{B}", "max_gpus"),
        (f"elastic:min_gpus=2,max_gpus=1,{B}", "min_gpus"),
        (f"elastic:min_gpus=1,max_gpus=2,{B},points=1x64@1e400", "points"),
        (f"elastic:min_gpus=1,max_gpus=2,{B},points=1x1000000000000000000@5", "points"),
        (f"elastic:min_gpus=1,max_gpus=2,{B},profile=" + "A" * 900, "profile"),  # ~1 KB (Slurm refuses longer)
        (f"elastic:min_gpus=1,max_gpus=4,{B},gpus_per_node=8", "gpus_per_node"),
        (f"elastic:min_gpus=1,max_gpus=2,{B},ckpt_dir=/a/../etc", "ckpt_dir"),
        (f"elastic:min_gpus=1,max_gpus=2,{B},restart_s=-5", "restart_s"),
        ("elastic:min_gpus=1,max_gpus=2,min_batch=32,max_batch=256", "max_local_batch"),
        (f"elastic:min_gpus=1,max_gpus=100000,{B}", None),  # valid: GPUs far past the cluster
    ]


@pytest.mark.slurm
def test_hostile_specs_through_the_daemon_are_reported_never_acted_on(slurm_cluster, tmp_path, caplog, reliability):
    canary = tmp_path / "pwned"
    cases = hostile(canary)
    reliability("bad input", f"{len(cases)} hostile specs to the daemon (no plugin)",
                "malformed, out of range, 10^18 batch/GPUs, unicode, ; $( ) ` | && in fields, 1 KB field",
                "cycle completes; each bad job reported naming job and field, never touched (no decision, "
                "not released); the valid 100000-GPU job placed within the 16 GPUs; no shell ran (canary absent)")
    os.chmod(tmp_path, 0o755)
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nsleep 300\n")
    ids = []
    try:
        for comment, _ in cases:
            ids.append(slurm_cluster.sbatch(["--hold", "--requeue", "-o", "/dev/null", "--gres=gpu:1",
                                             f"--comment={comment}", str(script)], cwd=tmp_path))
        recs = jobs_by_id(slurm_cluster, ids, include_finished=False)
        assert [recs[j].comment for j in ids] == [c for c, _ in cases]  # Slurm kept every byte
        cfg = config_from_dict({"state_dir": str(tmp_path / "state"), "metrics_address": "", "cooldown_s": 0})
        d = Daemon(cfg, backend=slurm_cluster.backend)
        d.open()
        try:
            with caplog.at_level(logging.WARNING, logger="slurm_elastic"):
                results = [d.cycle() for _ in range(2)]
            assert all(r is not None for r in results)
            errors = results[0].snapshot.errors
            for jid, (comment, field) in zip(ids, cases, strict=True):
                if field is None:
                    assert jid not in errors
                    continue
                assert jid in errors, (jid, comment)
                msg = str(errors[jid])
                assert f"job {jid}" in msg and f"field '{field}'" in msg, msg
            logged = {r.kv.get("job") for r in caplog.records if r.getMessage() == "bad elastic spec; job not managed"}
            assert {j for j, (_, f) in zip(ids, cases, strict=True) if f} <= logged
            acted = {x.action.job_id for r in results for x in r.results}
            bad = {j for j, (_, f) in zip(ids, cases, strict=True) if f}
            assert not acted & bad, acted & bad
        finally:
            d.close()
        recs = jobs_by_id(slurm_cluster, ids, include_finished=False)
        for jid in bad:
            assert recs[jid].is_pending and recs[jid].held and not recs[jid].admin_comment, recs[jid]
        big = recs[ids[-1]]
        assert not big.held and 1 <= big.gpus_total <= 16 and big.admin_comment.startswith("elastic-decision:"), big
        assert not canary.exists()
        lost = len(set(ids) - set(recs))
    finally:
        scancel(slurm_cluster, ids)
    reliability.jobs(lost=lost, left_held=int(big.held))
    reliability.figure("specs rejected", f"{len(bad)}/{len(cases) - 1}")


@pytest.mark.slurm
@pytest.mark.parametrize("lua_cluster", ["host"], indirect=True)  # the host's Slurm only (issue 24)
def test_hostile_specs_through_sbatch_and_the_plugin_are_refused_at_submit(lua_cluster, tmp_path, reliability):
    canary = tmp_path / "pwned"
    cases = hostile(canary)
    reliability("bad input", f"{len(cases)} hostile specs to sbatch with job_submit_elastic.lua",
                "the same specs, submitted with --requeue", "each bad one refused by sbatch with a message "
                "naming the field; the valid one accepted and held; no shell ran (canary absent)")
    os.chmod(tmp_path, 0o755)
    refused = 0
    accepted = []
    try:
        for comment, field in cases:
            argv = ["--requeue", "--gres=gpu:1", "-o", "/dev/null", f"--comment={comment}", str(lua_cluster.script)]
            if field is None:
                accepted.append(lua_cluster.sbatch(argv))
                continue
            with pytest.raises(ClusterError) as e:
                lua_cluster.sbatch(argv)
            assert "slurm-elastic: invalid elastic spec" in str(e.value), (comment, str(e.value))
            assert f"field '{field}'" in str(e.value), (comment, str(e.value))
            refused += 1
        (jid,) = accepted
        rec = lua_cluster.backend.get_job(jid)
        assert rec.is_pending and rec.held
        assert not canary.exists()
    finally:
        scancel(lua_cluster, accepted)
    reliability.figure("refused at submit", f"{refused}/{len(cases) - 1}")


# ----- fuzzing ---------------------------------------------------------------------------------
COUNTS: dict[str, int] = {}
BASE = "elastic:min_gpus=1,max_gpus=8,min_batch=32,max_batch=1024,max_local_batch=128"
KEYS = ["min_gpus", "max_gpus", "min_batch", "max_batch", "max_local_batch", "batch", "gpus", "min_local_batch",
        "max_accum", "gpus_per_node", "profile", "points", "weight", "restart_s", "ckpt_dir", "colour"]
VALUES = st.one_of(st.integers(-5, 2**62).map(str), st.sampled_from(["0", "1e18", "nan", "inf", "-0", "1x64@100",
                                                                    "$(id)", "`id`", ";", "/tmp/%j", "cifar10"]),
                   st.text(max_size=12))
ITEMS = st.tuples(st.sampled_from(KEYS), VALUES).map(lambda kv: f"{kv[0]}={kv[1]}")
COMMENTS = st.one_of(st.lists(ITEMS, max_size=10).map(lambda xs: BASE + "," + ",".join(xs)),
                     st.lists(ITEMS, max_size=10).map(lambda xs: "elastic:" + ",".join(xs)),
                     st.text(max_size=80).map(lambda s: "elastic:" + s))


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(COMMENTS, min_size=1, max_size=6), st.sampled_from(["dp", "fixed-batch", "static"]))
def _fuzz_cycle(tmp_path_factory, comments, policy):
    from slurm_elastic.backends.simulated import SimulatedSlurm

    COUNTS["cycle"] = COUNTS.get("cycle", 0) + 1
    sim = SimulatedSlurm(nodes=2, gpus_per_node=4)
    ids = [sim.submit(name=f"j{i}", gpus_per_node=1, comment=c, duration_s=1e6, held=True) for i, c in enumerate(comments)]
    cfg = config_from_dict({"state_dir": str(tmp_path_factory.mktemp("fz")), "metrics_address": "", "cooldown_s": 0,
                            "policy": policy, "max_gpus_per_user": 6, "max_gpus_per_job": 5})
    d = Daemon(cfg, backend=sim, ack=sim, clock=lambda: sim.now)
    d.open()
    try:
        for _ in range(2):
            r = d.cycle()
            assert r is not None
            for jid, err in r.snapshot.errors.items():
                assert f"job {jid}" in str(err) and getattr(err, "field", None)
            for x in r.results:
                assert x.action.job_id not in r.snapshot.errors
                assert x.status != "error", x
            sim.advance_to(sim.now + 30)
        running = [sim.get_job(j) for j in ids if sim.get_job(j) is not None and sim.get_job(j).is_running]
        assert sum(j.gpus_total for j in running) <= 8
        assert all(j.gpus_total <= 5 for j in running)
    finally:
        d.close()


def test_fuzz_the_whole_cycle_with_hostile_specs(tmp_path_factory, reliability):
    reliability("fuzz", "hypothesis: random/hostile specs through a full daemon cycle (simulated backend)",
                "1-6 jobs per case, 3 policies, per-user cap 6 and per-job cap 5",
                "no exception; every bad spec reported with job and field and never acted on; no action "
                "error; GPUs within capacity and caps")
    COUNTS["cycle"] = 0
    _fuzz_cycle(tmp_path_factory)
    assert COUNTS["cycle"] >= 100
    reliability.figure("hypothesis cases", COUNTS["cycle"])


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
CAPTURES = sorted(p for p in FIXTURES.glob("slurm-*/squeue_*.json")) + sorted(FIXTURES.glob("slurm-*/nodes_*.json"))


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(range(len(CAPTURES))), st.data())
def _fuzz_bytes(index, data):
    from slurm_elastic.backends.base import SlurmParseError
    from slurm_elastic.backends.cli import CliBackend

    COUNTS["bytes"] = COUNTS.get("bytes", 0) + 1
    text = CAPTURES[index].read_text()
    kind = data.draw(st.sampled_from(["truncate", "flip", "splice", "dup"]))
    n = len(text)
    if kind == "truncate":
        text = text[: data.draw(st.integers(0, n - 1))]
    elif kind == "flip":
        for _ in range(data.draw(st.integers(1, 8))):
            i = data.draw(st.integers(0, n - 1))
            text = text[:i] + data.draw(st.sampled_from(list('{}[]",:0-9ae \\\x00\u00e9'))) + text[i + 1:]
    elif kind == "splice":
        i, j = sorted(data.draw(st.tuples(st.integers(0, n), st.integers(0, n))))
        text = text[:i] + text[j:]
    else:
        i = data.draw(st.integers(0, n))
        text = text[:i] + text[i:i + 200] + text[i:]

    def runner(argv, **kw):
        return subprocess.CompletedProcess(argv, 0, stdout=text, stderr="")

    b = CliBackend(runner=runner)
    b._version = (22, 5, 8) if "22.05" in str(CAPTURES[index]) else (24, 11, 5)
    try:
        if CAPTURES[index].name.startswith("squeue"):
            b.list_jobs()
        else:
            b.list_nodes()
    except SlurmParseError:
        pass


def test_fuzz_backend_json_reading_byte_mutated_captures(reliability):
    reliability("fuzz", "hypothesis: captured squeue/node JSON (22.05 and 24.11) truncated, byte-flipped, "
                "spliced, duplicated, read through CliBackend", f"{len(CAPTURES)} captures",
                "only SlurmParseError ever escapes (the daemon skips the cycle on it)")
    assert CAPTURES
    COUNTS["bytes"] = 0
    _fuzz_bytes()
    assert COUNTS["bytes"] >= 100
    reliability.figure("hypothesis cases", COUNTS["bytes"])


def test_spec_and_decision_fuzz_counts_from_the_unit_suite_are_reported(reliability):
    """Re-run the unit suite's spec and decision fuzzers (tests/unit/test_spec.py) and count their cases."""
    import importlib.util

    spec_path = Path(__file__).resolve().parents[1] / "unit" / "test_spec.py"
    m = importlib.util.spec_from_file_location("_unit_test_spec", spec_path)
    mod = importlib.util.module_from_spec(m)
    m.loader.exec_module(mod)
    counted = {"parser": 0, "decision": 0}
    from slurm_elastic import spec as spec_mod

    real_parse, real_decision = spec_mod.parse_spec, spec_mod.parse_decision

    def parse(*a, **k):
        counted["parser"] += 1
        return real_parse(*a, **k)

    def decision(*a, **k):
        counted["decision"] += 1
        return real_decision(*a, **k)

    mod.parse_spec, mod.parse_decision = parse, decision
    reliability("fuzz", "hypothesis: elastic spec and decision parsers (tests/unit/test_spec.py fuzzers)",
                "arbitrary text and key=value soups", "only SpecError, naming job and field; what parses round-trips")
    mod.test_parser_never_raises_anything_but_spec_error()
    mod.test_decision_parser_never_raises_anything_but_spec_error()
    assert counted["parser"] >= 500 and counted["decision"] >= 100
    reliability.figure("hypothesis cases", f"{counted['parser']} spec + {counted['decision']} decision")
    json.dumps(counted)


def test_unknown_profile_is_a_bad_spec_not_a_failed_cycle(tmp_path, reliability):
    """Found by the cycle fuzzer: ``profile=0`` (well-formed, unknown) made every daemon cycle raise."""
    from slurm_elastic.backends.simulated import SimulatedSlurm

    reliability("bad input", "a well-formed but unknown profile name", "profile=nosuchmodel next to a good job",
                "the cycle completes; the job is reported naming field 'profile' and never acted on; the good "
                "job is started")
    sim = SimulatedSlurm(nodes=1, gpus_per_node=4)
    bad = sim.submit(name="bad", gpus_per_node=1, comment=BASE + ",profile=nosuchmodel", duration_s=1e6, held=True)
    good = sim.submit(name="good", gpus_per_node=1, comment=BASE, duration_s=1e6, held=True)
    cfg = config_from_dict({"state_dir": str(tmp_path / "s"), "metrics_address": "", "cooldown_s": 0})
    d = Daemon(cfg, backend=sim, ack=sim, clock=lambda: sim.now)
    d.open()
    try:
        r = d.cycle()
    finally:
        d.close()
    assert r is not None
    assert f"job {bad}" in str(r.snapshot.errors[bad]) and "field 'profile'" in str(r.snapshot.errors[bad])
    assert {x.action.job_id for x in r.results} == {good}
    sim.advance_to(sim.now + 30)
    assert sim.get_job(bad).held and not sim.get_job(good).held
    reliability.jobs(lost=0)
