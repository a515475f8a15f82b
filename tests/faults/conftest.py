"""The fault-injection and bad-input suite (``-m faults``): shared fixtures and the RELIABILITY table.

Every test records its row through the ``reliability`` fixture (what was injected or tried, and the
outcome it *measured*: jobs completed, lost, left held). The row gets the test's pass/fail outcome from
pytest, so a failing check shows as FAIL in the table. The rows travel with the test reports; at the end
of the session tests/conftest.py writes them to ``$SLURM_ELASTIC_RELIABILITY_JSON`` (default: a file in
the temp dir) and, when ``SLURM_ELASTIC_RELIABILITY_DOC`` names a path (e.g. ``docs/RELIABILITY.md``),
renders them there as markdown (tests/faults/reliability.py).
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

if str(Path(__file__).resolve().parents[2]) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.faults.reliability import ROWS, Reliability, test_id  # noqa: E402


@pytest.fixture
def reliability(request):
    return Reliability(request.node.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    mine = [row for row in ROWS if row["test"] == item.nodeid]
    for row in mine:
        if rep.when == "call":
            row["outcome"] = "pass" if rep.passed else ("skip" if rep.skipped else "FAIL")
            row["seconds"] = round(rep.duration, 1)
        elif rep.failed:
            row["outcome"] = "FAIL"
        elif rep.skipped and row["outcome"] == "not run":
            row["outcome"] = "skip"
    if mine:
        # The rows travel with the report: under pytest-xdist the table is written by the controller,
        # which sees every worker's reports but none of their ROWS.
        rep.user_properties.append(("reliability_rows", [dict(row, test=test_id(row["test"]), figures=dict(row["figures"]))
                                                         for row in mine]))


def pytest_collection_modifyitems(config, items):
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).parent == here:
            item.add_marker(pytest.mark.faults)


PLUGIN = Path(__file__).resolve().parents[2] / "plugins" / "job_submit_elastic.lua"


def _lua_versions() -> list[str]:
    from tests.conftest import slurm_versions

    return slurm_versions()


@pytest.fixture(scope="session", params=_lua_versions())
def lua_cluster(request):
    """A second local cluster with plugins/job_submit_elastic.lua loaded and two partitions:
    ``gpu`` (node1, node2: the managed one) and ``other`` (node3). 3 nodes x 4 GPUs, KillWait 5 s
    (``cluster.kill_wait_s``). One per Slurm version of the machine (ids ``host`` and the chroot's
    release, as ``versioned_cluster``); the rows written before the chroot variant existed ask for
    ``host`` only (``@pytest.mark.parametrize("lua_cluster", ["host"], indirect=True)``).

    On a chroot cluster the state dir (and so ``cluster.script`` and ``cluster.job_dir()``) lies
    inside the root; users made for a test must be made known inside it (``tests/chroot_paths.py``:
    ``chroot_users``), and job directories the daemon reads bind-mounted on the host at the path
    Slurm reports (``same_path_on_host``)."""
    import shutil
    import subprocess as sp

    from slurm_elastic.chroot import ChrootRoot
    from slurm_elastic.cluster import ClusterConfig, LocalCluster
    from tests.conftest import free_ports, slurm_unavailable_reason

    require = os.environ.get("SLURM_ELASTIC_REQUIRE_SLURM") == "1"
    reason = slurm_unavailable_reason()
    if reason:
        pytest.fail(reason) if require else pytest.skip(reason)
    release, base = (None, None) if request.param == "host" else (request.param, None)
    if release is not None:
        root = ChrootRoot(release)
        if not root.is_complete():
            if not require:
                pytest.skip(f"no {release} chroot in {root.path}: run 'slurm-elastic cluster prepare --slurm {release}'")
            root.ensure()
        if not list(root.path.glob("usr/lib/*/slurm-wlm/job_submit_lua.so")):
            pytest.fail(f"the {release} chroot has no job_submit_lua.so (slurm_elastic/chroot.py PACKAGES)")
        base = root.path / "srv" / "slurm-elastic"
        base.mkdir(parents=True, exist_ok=True)
    state = Path(tempfile.mkdtemp(prefix="se-faults-lua-", dir=base))
    os.chmod(state, 0o755)  # other users must read slurm.conf and reach the munge socket
    cfg = ClusterConfig(nodes=3, gpus_per_node=4, job_submit_lua=str(PLUGIN), cred_expire=10,
                        ctld_port=free_ports(6, start=27500 if release is None else 27600),
                        release=release)
    cluster = LocalCluster(state, cfg)
    # Two partitions: write_config adds "PartitionName=gpu Nodes=ALL"; narrow it and add "other".
    cfg.extra_conf = []
    orig = cluster.write_config

    def write_config():
        orig()
        conf = cluster.conf_path
        text = conf.read_text()
        for old, new in (("PartitionName=gpu Nodes=ALL Default=YES", "PartitionName=gpu Nodes=node[1-2] Default=YES"),
                         # A killed slurmd is noticed in ~10 s instead of 60 (test_slurm_daemons.py).
                         ("SlurmdTimeout=60", "SlurmdTimeout=10")):
            assert old in text, f"slurm.conf no longer says {old!r}"
            text = text.replace(old, new)
        conf.write_text(text + "PartitionName=other Nodes=node3 MaxTime=INFINITE State=UP\n")

    cluster.write_config = write_config
    try:
        cluster.up()
    except BaseException:
        shutil.rmtree(state, ignore_errors=True)
        raise
    text = cluster.conf_path.read_text()
    cluster.kill_wait_s = int(text.split("KillWait=", 1)[1].split()[0]) if "KillWait=" in text else 30
    work = state / "jobs"
    work.mkdir(exist_ok=True)
    os.chmod(work, 0o755)
    script = work / "job.sh"
    script.write_text("#!/bin/bash\nsleep 300\n")
    script.chmod(0o755)
    cluster.script = script
    print(f"\n{cluster.label} plugin cluster up: Slurm {cluster.backend.version()}")
    try:
        yield cluster
    finally:
        ids = [str(j.job_id) for j in cluster.backend.list_jobs()]
        if ids:
            sp.run(cluster.tool("scancel", *ids), env=cluster.env, capture_output=True, timeout=30, check=False)
        cluster.down()
        shutil.rmtree(state, ignore_errors=True)
