"""Issue 24, live: operator config is validated like user input. A stop signal of KILL and a poll interval
of 1e308 are refused at start (``slurm-elastic daemon --once`` exits non-zero naming the key) and at
SIGHUP reload (the old configuration kept: the next resize still sends USR2). Uses only the cluster
object's API (backend, bin, env), so it runs on any Slurm version the fixture brings up."""

from __future__ import annotations

import subprocess
import sys

import pytest
from faultlib import write_config

from slurm_elastic.daemon.config import config_from_dict
from slurm_elastic.daemon.loop import Daemon

pytestmark = [pytest.mark.slurm]


@pytest.mark.parametrize("key,value", [("signal", "KILL"), ("poll_interval_s", 1e308), ("signal", "TERM"),
                                       ("cooldown_s", float("nan"))])
def test_bad_operator_values_refused_at_start_and_reload(lua_cluster, tmp_path, reliability, key, value):
    reliability("operators", f"config {key} = {value!r}",
                "`slurm-elastic daemon --once` with it; then a running daemon's SIGHUP reload to it",
                "refused at start (exit != 0, the key named); at reload the old configuration is kept")
    c = lua_cluster
    bad = write_config(tmp_path / "bad.toml", tmp_path / "s1", partitions=["gpu"], slurm_bin=c.config.bin,
                       **{key: value})
    r = subprocess.run([sys.executable, "-m", "slurm_elastic.cli", "daemon", "--config", str(bad), "--once"],
                       env=c.env, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode != 0 and key in r.stderr, r.stderr[-2000:]
    d = Daemon(config_from_dict({"state_dir": str(tmp_path / "s2"), "metrics_address": "", "partitions": ["gpu"],
                                 "poll_interval_s": 2, "slurm_bin": str(c.config.bin)}), backend=c.backend,
               config_path=str(bad))
    d.open()
    try:
        assert d.cycle() is not None
        d.reload()
        assert d.config.signal == "USR2" and d.config.poll_interval_s == 2.0
        assert d.config.cooldown_s == config_from_dict({}).cooldown_s
        assert d.enactor is None or d.enactor.signal_name == "USR2"
        assert d.cycle() is not None
    finally:
        d.close()
