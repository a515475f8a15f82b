"""Shared fixtures. ``slurm_cluster`` starts a real local Slurm (4 nodes x 4 fake GPUs) once per session.

The cluster lives in a fresh temporary state dir on free ports, so it never touches a cluster that a
developer has running; it is stopped (by pid) at the end of the session. Tests marked ``slurm`` are
skipped with a clear reason when Slurm is not installed or the tests do not run as root.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"


def slurm_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root"
    for tool in ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged", "/usr/bin/sbatch"):
        if not os.access(tool, os.X_OK):
            return f"{tool} is missing (apt-get install slurm-wlm munge)"
    return None


def pytest_collection_modifyitems(config, items):
    reason = slurm_unavailable_reason()
    if reason is None:
        return
    if os.environ.get("SLURM_ELASTIC_REQUIRE_SLURM") == "1":
        # In CI a missing Slurm is a failure, not a skip.
        return
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "slurm" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def slurm_cluster():
    """A running LocalCluster: 4 nodes x 4 GPUs, cred_expire 10 s. Yields the cluster object."""
    from slurm_elastic.cluster import ClusterConfig, LocalCluster, find_free_port_block

    reason = slurm_unavailable_reason()
    if reason:
        pytest.fail(reason) if os.environ.get("SLURM_ELASTIC_REQUIRE_SLURM") == "1" else pytest.skip(reason)
    state = Path(tempfile.mkdtemp(prefix="se-cluster-"))
    port = find_free_port_block(8, start=21000)
    cluster = LocalCluster(state, ClusterConfig(nodes=4, gpus_per_node=4, ctld_port=port, cred_expire=10))
    cluster.up()
    try:
        yield cluster
    finally:
        _cancel_all(cluster)
        cluster.down()
        if os.environ.get("SLURM_ELASTIC_KEEP_CLUSTER") != "1":
            shutil.rmtree(state, ignore_errors=True)


def _cancel_all(cluster) -> None:
    """Cancel the jobs the test session submitted to its own cluster, so no slurmstepd outlives it."""
    import subprocess

    try:
        jobs = cluster.backend.list_jobs()
    except Exception:
        return
    ids = [str(j.job_id) for j in jobs]
    if ids:
        subprocess.run(["/usr/bin/scancel", *ids], env=cluster.env, capture_output=True, timeout=30, check=False)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                if not cluster.backend.list_jobs():
                    break
            except Exception:
                break
            time.sleep(0.5)


@pytest.fixture
def job_dir(tmp_path):
    """A world-readable working directory for batch scripts and their output."""
    os.chmod(tmp_path, 0o755)
    return tmp_path
