"""slurm_elastic.doctor against ``scontrol show config``/``show partition`` captured from real Slurm 22.05.8 and
24.11.5 (tests/fixtures/doctor-*/, scripts/capture_fixtures.py --doctor): a good slurm.conf and broken copies
(JobRequeue=0 with and without the plugin, Slurm preemption, DisableRootJobs=YES), plus facts the command
gathers (plugin file, state dir, munge, backend) varied one at a time."""

import json
import os
from pathlib import Path

import pytest

from slurm_elastic import doctor as d
from slurm_elastic.backends.dialects import parse_config, parse_nodes
from slurm_elastic.daemon.config import config_from_dict

FIX = Path(__file__).resolve().parents[1] / "fixtures"
PLUGIN = (Path(__file__).resolve().parents[2] / "plugins" / "job_submit_elastic.lua").read_text()
VERSIONS = ["22.05", "24.11"]


def facts(version: str, case: str, tmp_path: Path, **cfg) -> d.SiteFacts:
    base = FIX / f"doctor-{version}"
    config = parse_config((base / f"config_{case}.txt").read_text())
    manifest = json.loads((base / "MANIFEST.json").read_text())["cases"][case]
    state = tmp_path / "state"
    state.mkdir(mode=0o755, exist_ok=True)
    os.chmod(state, 0o755)
    return d.SiteFacts(
        slurm_config=config,
        partitions_text=(base / f"partitions_{case}.txt").read_text(),
        nodes=parse_nodes(json.loads((FIX / f"slurm-{version}" / "nodes_idle.json").read_text())),
        plugin_path="/etc/slurm/job_submit.lua",
        plugin_text=PLUGIN if manifest["job_submit_lua"] else None,
        shipped_plugin_text=PLUGIN,
        daemon_config=config_from_dict({"state_dir": str(state), **cfg}),
        state_dir={"exists": True, "is_dir": True, "is_symlink": False, "uid": 0, "mode": 0o755},
        munge=(True, "munge -n | unmunge works"),
        backend=("pyslurm", "pyslurm imports and matches"),
    )


def by_name(checks):
    return {c.name: c for c in checks}


@pytest.mark.parametrize("version", VERSIONS)
def test_the_captured_good_config_passes(version, tmp_path):
    checks = d.diagnose(facts(version, "good", tmp_path))
    assert [c.line() for c in checks if c.level != d.OK] == []
    got = by_name(checks)
    assert set(got) >= {"config", "slurm", "requeue", "job_submit", "gres", "partitions", "preemption", "root_jobs",
                        "restart", "state_dir", "munge", "tools", "backend"}
    assert version in got["slurm"].what  # SLURM_VERSION read from the capture
    assert "16 GPUs on 4 nodes" in got["gres"].what
    assert d.exit_code(checks) == 0


@pytest.mark.parametrize("version", VERSIONS)
def test_no_requeue_and_no_plugin_fails_with_the_fix(version, tmp_path):
    checks = by_name(d.diagnose(facts(version, "no_requeue", tmp_path)))
    assert checks["requeue"].level == d.FAIL and "JobRequeue=0" in checks["requeue"].what
    assert "JobRequeue=1" in checks["requeue"].fix
    assert checks["job_submit"].level == d.WARN and "JobSubmitPlugins=lua" in checks["job_submit"].fix
    assert d.exit_code(list(checks.values())) == 1


@pytest.mark.parametrize("version", VERSIONS)
def test_requeue_enforced_by_the_plugin_is_enough(version, tmp_path):
    checks = by_name(d.diagnose(facts(version, "requeue_by_plugin", tmp_path)))
    assert checks["requeue"].level == d.OK and "plugin refuses" in checks["requeue"].what
    # the same config with a site plugin that is not ours: nothing enforces --requeue
    f = facts(version, "requeue_by_plugin", tmp_path)
    f.plugin_text = "function slurm_job_submit(job_desc, part_list, submit_uid) return slurm.SUCCESS end\n"
    checks = by_name(d.diagnose(f))
    assert checks["requeue"].level == d.FAIL
    assert checks["job_submit"].level == d.WARN and "not slurm-elastic's plugin" in checks["job_submit"].what


@pytest.mark.parametrize("version", VERSIONS)
def test_slurm_preemption_fails(version, tmp_path):
    checks = by_name(d.diagnose(facts(version, "preempt", tmp_path)))
    c = checks["preemption"]
    assert c.level == d.FAIL and "preempt/partition_prio" in c.what and "REQUEUE" in c.what
    assert "PreemptType=preempt/none" in c.fix


@pytest.mark.parametrize("version", VERSIONS)
def test_root_jobs_disabled_fails_unless_the_lease_is_off(version, tmp_path):
    c = by_name(d.diagnose(facts(version, "no_root_jobs", tmp_path)))["root_jobs"]
    assert c.level == d.FAIL and "DisableRootJobs=YES" in c.what and "lease" in c.what
    c = by_name(d.diagnose(facts(version, "no_root_jobs", tmp_path, lease_ttl_s=0)))["root_jobs"]
    assert c.level == d.WARN


@pytest.mark.parametrize("version", VERSIONS)
def test_root_jobs_disabled_on_the_lease_partition(version, tmp_path):
    f = facts(version, "good", tmp_path, partitions=["gpu"])
    f.partitions_text = f.partitions_text.replace("DisableRootJobs=NO", "DisableRootJobs=YES")
    c = by_name(d.diagnose(f))["root_jobs"]
    assert c.level == d.FAIL and "partition gpu" in c.what


@pytest.mark.parametrize("version", VERSIONS)
def test_plugin_missing_or_stale(version, tmp_path):
    f = facts(version, "good", tmp_path)
    f.plugin_text = None
    c = by_name(d.diagnose(f))["job_submit"]
    assert c.level == d.FAIL and "missing" in c.what and "/etc/slurm/job_submit.lua" in c.fix
    f.plugin_text = PLUGIN.replace("local DAEMON_UIDS = { [0] = true }", "local DAEMON_UIDS = { [0] = true, [64030] = true }")
    assert by_name(d.diagnose(f))["job_submit"].level == d.OK  # the line a site edits
    f.plugin_text = PLUGIN.replace("MAX_BATCH = 16777216", "MAX_BATCH = 1024")
    c = by_name(d.diagnose(f))["job_submit"]
    assert c.level == d.WARN and "differs" in c.what


@pytest.mark.parametrize("version", VERSIONS)
def test_gres(version, tmp_path):
    f = facts(version, "good", tmp_path)
    f.slurm_config = {**f.slurm_config, "GresTypes": "(null)"}
    assert by_name(d.diagnose(f))["gres"].level == d.FAIL
    f = facts(version, "good", tmp_path, partitions=["gpu"])
    from dataclasses import replace
    f.nodes = [replace(n, gpus_total=0) for n in f.nodes]
    checks = by_name(d.diagnose(f))
    assert checks["gres"].level == d.FAIL and checks["partitions"].level == d.FAIL
    f = facts(version, "good", tmp_path)
    f.nodes = [replace(n, gpu_type="a100,v100") if i == 0 else n for i, n in enumerate(f.nodes)]
    assert by_name(d.diagnose(f))["gres"].level == d.WARN


def test_managed_partition_that_slurm_lacks(tmp_path):
    c = by_name(d.diagnose(facts("24.11", "good", tmp_path, partitions=["a100"])))["partitions"]
    assert c.level == d.FAIL and "'a100' not found" in c.what


def test_cred_expire_default_is_slow(tmp_path):
    f = facts("22.05", "good", tmp_path)
    f.slurm_config = {**f.slurm_config, "AuthInfo": "socket=/run/munge/munge.socket.2"}
    c = by_name(d.diagnose(f))["restart"]
    assert c.level == d.WARN and "cred_expire=120" in c.what


def test_state_dir_rules(tmp_path):
    f = facts("24.11", "good", tmp_path)
    for state, level in [({"exists": False}, d.OK),
                         ({"exists": True, "is_symlink": True, "is_dir": False}, d.FAIL),
                         ({"exists": True, "is_dir": False}, d.FAIL),
                         ({"exists": True, "is_dir": True, "uid": 0, "mode": 0o777}, d.FAIL),
                         ({"exists": True, "is_dir": True, "uid": 1234, "mode": 0o755}, d.WARN)]:
        f.state_dir = state
        assert by_name(d.diagnose(f))["state_dir"].level == level, state


def test_munge_backend_tools_and_config_errors(tmp_path):
    f = facts("24.11", "good", tmp_path)
    f.munge = (False, "unmunge refused the credential")
    f.backend = ("", 'backend = "pyslurm" cannot be used: pyslurm 22.5.3 was built for another Slurm')
    f.missing_tools = ["scancel"]
    f.daemon_config_error = "elastic.toml: unknown key 'polll_interval_s'"
    checks = by_name(d.diagnose(f))
    assert all(checks[k].level == d.FAIL for k in ("munge", "backend", "tools", "config"))
    assert "scancel" in checks["tools"].what and "polll_interval_s" in checks["config"].what


def test_slurm_unreachable_still_checks_the_rest(tmp_path):
    f = facts("24.11", "good", tmp_path)
    f.slurm_config, f.slurm_error = None, "scontrol: Unable to contact slurm controller"
    checks = d.diagnose(f)
    names = [c.name for c in checks]
    assert names[:2] == ["config", "slurm"] and "requeue" not in names and "munge" in names
    assert d.exit_code(checks) == 1


def test_submit_plugins_and_partition_fields():
    assert d.submit_plugins({"JobSubmitPlugins": "lua,job_submit/pbs"}) == ["lua", "pbs"]
    assert d.submit_plugins({"JobSubmitPlugins": "(null)"}) == []
    text = (FIX / "doctor-22.05" / "partitions_good.txt").read_text()
    assert d.partition_fields(text)["gpu"]["DisableRootJobs"] == "NO"


def test_the_commands_fact_gathering_helpers(tmp_path):
    from slurm_elastic.commands.doctor import (
        DEFAULT_MUNGE_SOCKET,
        _read_bounded,
        _state_dir_facts,
        munge_socket,
    )

    config = parse_config((FIX / "doctor-22.05" / "config_good.txt").read_text())
    assert munge_socket(config).endswith("/good/munge/munge.socket")
    assert munge_socket({"AuthInfo": "(null)"}) == DEFAULT_MUNGE_SOCKET
    real = tmp_path / "job_submit.lua"
    real.write_text(PLUGIN)
    link = tmp_path / "link.lua"
    link.symlink_to(real)
    assert _read_bounded(real) == PLUGIN
    assert _read_bounded(tmp_path / "none.lua") is None
    assert _read_bounded(link).startswith("-- unreadable")  # never through a symlink
    assert _state_dir_facts(str(tmp_path / "none")) == {"exists": False}
    d = tmp_path / "state"
    d.mkdir()
    os.chmod(d, 0o750)
    facts_ = _state_dir_facts(str(d))
    assert facts_["is_dir"] and not facts_["is_symlink"] and facts_["mode"] == 0o750
    (tmp_path / "state-link").symlink_to(d)
    assert _state_dir_facts(str(tmp_path / "state-link"))["is_symlink"]
