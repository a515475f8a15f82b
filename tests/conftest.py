"""Shared fixtures. ``slurm_cluster`` starts a real local Slurm (4 nodes x 4 fake GPUs) once per session.

The cluster lives in a fresh temporary state dir on free ports, so it never touches a cluster that a
developer has running; it is stopped (by pid) at the end of the session. Tests marked ``slurm`` are
skipped with a clear reason when Slurm is not installed or the tests do not run as root.

``versioned_cluster`` is the same cluster parametrized over every Slurm version of this machine: the
host's (``host``, which is ``slurm_cluster`` itself) and the other Debian release's Slurm in a
debootstrap chroot (``trixie`` on Debian 12 -> 24.11, ``bookworm`` on Debian 13 -> 22.05; see
slurm_elastic/chroot.py). The chroot is built by ``slurm-elastic cluster prepare`` (scripts/setup.sh
runs it); when it is missing the chroot cases are skipped, except under
``SLURM_ELASTIC_REQUIRE_SLURM=1`` (CI), where the fixture builds it (once, under a lock).
``SLURM_ELASTIC_SLURM_VERSIONS=host`` (comma-separated) restricts the versions.
``pools_cluster`` (issue 13) is a second session cluster per version, started only by the tests that
take it: two partitions with typed fake GPUs and two node sizes (a100: 2 x a100:4, v100: 2 x v100:8).
Job scripts for a versioned cluster must lie where its daemons see them: use ``versioned_job_dir``
(or ``cluster.job_dir()``), and run Slurm tools with ``cluster.tool(...)``/``cluster.run_tool(...)``.

``make test`` runs the suite in two pytest-xdist processes (``-n 2 --dist loadgroup``); each process
has its own session clusters. So: pick ports for a cluster or a daemon with ``free_ports`` (reserved per
process; ``cluster.find_free_port_block`` alone can hand two processes the same block), and a test that
uses a cluster other than the host's plain one is kept in one process with that cluster's other tests
(``cluster_groups``). The fault suite's RELIABILITY rows travel with the reports to the controller.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SHARED_DATA = REPO.parent / "shared" / "data"
_T0 = time.time()
RELIABILITY: dict[str, list[dict]] = {}  # nodeid -> its RELIABILITY rows as last reported (tests/faults)


def pytest_runtest_logreport(report):
    """Collect the fault suite's rows from the reports (in the pytest-xdist controller too)."""
    for key, rows in report.user_properties:
        if key == "reliability_rows":
            RELIABILITY[report.nodeid] = rows


def pytest_sessionfinish(session, exitstatus):
    """Write the RELIABILITY rows (JSON, and the markdown table where SLURM_ELASTIC_RELIABILITY_DOC asks)."""
    if hasattr(session.config, "workerinput") or not RELIABILITY:
        return  # a pytest-xdist worker's rows went to the controller with its reports
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from tests.faults.reliability import render

    rows = [row for rows in RELIABILITY.values() for row in rows]
    wall = time.time() - _T0
    out = Path(os.environ.get("SLURM_ELASTIC_RELIABILITY_JSON",
                              Path(tempfile.gettempdir()) / "slurm-elastic-reliability.json"))
    try:
        out.write_text(json.dumps({"wall_s": wall, "rows": rows}, indent=2))
    except OSError:
        pass
    doc = os.environ.get("SLURM_ELASTIC_RELIABILITY_DOC")
    if doc:
        Path(doc).write_text(render(rows, wall))


def free_ports(count: int, start: int) -> int:
    """``cluster.find_free_port_block`` made safe between the processes of one test run (pytest-xdist
    workers): a block handed out is recorded with this pid until the process ends, and no other process
    gets it, even before its daemons bind it. Tests pick ports for clusters and daemons with this."""
    import fcntl

    from slurm_elastic.cluster import ClusterError, port_free
    from slurm_elastic.daemon.lease import _pid_alive

    d = Path(tempfile.gettempdir()) / f"slurm-elastic-test-ports-{os.getuid()}"
    try:
        d.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(d)
    if not os.path.isdir(d) or os.path.islink(d) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise RuntimeError(f"{d} is not a private directory of uid {os.getuid()}")
    with open(d / "lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = d / "reserved.json"
        try:
            taken = {int(p): int(pid) for p, pid in json.loads(path.read_text()).items()}
        except (OSError, ValueError, AttributeError):
            taken = {}
        taken = {p: pid for p, pid in taken.items() if _pid_alive(pid)}
        port = start
        while port + count < 40000:
            block = range(port, port + count)
            if not any(p in taken for p in block) and all(port_free(p) for p in block):
                taken.update({p: os.getpid() for p in block})
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(taken))
                tmp.replace(path)
                return port
            port += count
    raise ClusterError(f"no block of {count} free ports from {start}")


def slurm_unavailable_reason() -> str | None:
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root"
    for tool in ("/usr/sbin/slurmctld", "/usr/sbin/slurmd", "/usr/sbin/munged", "/usr/bin/sbatch"):
        if not os.access(tool, os.X_OK):
            return f"{tool} is missing (apt-get install slurm-wlm munge)"
    return None


# The session clusters a test may use, by fixture name; a test's cluster is "<kind>-<version>".
CLUSTER_KINDS = {"slurm_cluster": "cluster", "versioned_cluster": "cluster", "pools_cluster": "pools",
                 "lua_cluster": "lua"}


def cluster_groups(items) -> dict[str, str]:
    """{nodeid: group} for the tests that use a session cluster. Under pytest-xdist (``--dist loadgroup``)
    a group runs in one worker, so each cluster starts once per run; a test that uses two clusters joins
    their groups. The host's plain cluster is not grouped: its tests are most of the live time, so they
    spread over the workers, each starting its own (about 2 s). The plugin cluster's tests of every version
    are one group: they useradd the same users per module for each version, and a worker that removes them
    while another runs the other version's case breaks it (seen: a job of a deleted user is a bad spec)."""
    parent: dict[str, str] = {}

    def find(k: str) -> str:
        while parent.setdefault(k, k) != k:
            k = parent[k]
        return k

    used = {}
    for item in items:
        params = item.callspec.params if hasattr(item, "callspec") else {}
        keys = {kind if kind == "lua" else f"{kind}-{params.get(name, 'host')}" for name, kind in CLUSTER_KINDS.items()
                if name in getattr(item, "fixturenames", ())} - {"cluster-host"}
        if keys:
            used[item.nodeid] = keys
            first, *rest = sorted(keys)
            for k in rest:
                parent[find(k)] = find(first)
    return {nodeid: find(min(keys)) for nodeid, keys in used.items()}


def pytest_collection_modifyitems(config, items):
    if config.pluginmanager.hasplugin("xdist"):
        groups = cluster_groups(items)
        for item in items:
            if item.nodeid in groups:
                item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
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
    from slurm_elastic.cluster import ClusterConfig, LocalCluster

    reason = slurm_unavailable_reason()
    if reason:
        pytest.fail(reason) if os.environ.get("SLURM_ELASTIC_REQUIRE_SLURM") == "1" else pytest.skip(reason)
    state = Path(tempfile.mkdtemp(prefix="se-cluster-"))
    port = free_ports(8, start=21000)
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
    cluster.cancel_jobs(timeout=30)


def _chroot_release() -> str | None:
    from slurm_elastic.chroot import ChrootError, other_release

    try:
        return other_release()
    except ChrootError:
        return None


def slurm_versions() -> list[str]:
    """The versions ``versioned_cluster`` runs over: 'host' and the chroot release (if this is Debian).

    ``SLURM_ELASTIC_CHROOT_RELEASES`` (comma-separated) replaces the chroot releases, e.g.
    ``bookworm,trixie`` on a Debian 12 machine also runs 22.05 inside a chroot, as a Debian 13 host does.
    """
    wanted = os.environ.get("SLURM_ELASTIC_SLURM_VERSIONS")
    versions = ["host"]
    chroots = os.environ.get("SLURM_ELASTIC_CHROOT_RELEASES")
    if chroots is not None:
        versions += [r for r in chroots.split(",") if r]
    elif _chroot_release():
        versions.append(_chroot_release())
    if wanted:
        versions = [v for v in versions if v in wanted.split(",")]
    return versions


@pytest.fixture(scope="session", params=slurm_versions())
def versioned_cluster(request):
    """A running 4 x 4 LocalCluster for each Slurm version of this machine (ids: host, trixie|bookworm)."""
    if request.param == "host":
        yield request.getfixturevalue("slurm_cluster")
        return
    from slurm_elastic.chroot import ChrootRoot
    from slurm_elastic.cluster import ClusterConfig, LocalCluster

    require = os.environ.get("SLURM_ELASTIC_REQUIRE_SLURM") == "1"
    if os.geteuid() != 0:
        pytest.skip("a chroot cluster needs root")
    root = ChrootRoot(request.param)
    if not root.is_complete():
        if not require:
            pytest.skip(f"no {request.param} chroot in {root.path}: run "
                        f"'slurm-elastic cluster prepare --slurm {request.param}' (scripts/setup.sh does)")
        t0 = time.monotonic()
        info = root.ensure()
        print(f"\nbuilt the {request.param} chroot in {time.monotonic() - t0:.0f} s: {info}")
    base = root.path / "srv" / "slurm-elastic"
    base.mkdir(parents=True, exist_ok=True)
    state = Path(tempfile.mkdtemp(prefix="se-test-", dir=base))  # inside the root: the daemons see it
    port = free_ports(8, start=22000)
    cluster = LocalCluster(state, ClusterConfig(nodes=4, gpus_per_node=4, ctld_port=port, cred_expire=10,
                                                release=request.param))
    t0 = time.monotonic()
    try:
        cluster.up()
    except BaseException:
        if os.environ.get("SLURM_ELASTIC_KEEP_CLUSTER") != "1":  # its logs are in the error message
            shutil.rmtree(state, ignore_errors=True)
        raise
    print(f"\n{request.param} cluster up in {time.monotonic() - t0:.1f} s: Slurm {cluster.backend.version()}")
    try:
        yield cluster
    finally:
        _cancel_all(cluster)
        cluster.down()
        if os.environ.get("SLURM_ELASTIC_KEEP_CLUSTER") != "1":
            shutil.rmtree(state, ignore_errors=True)


@pytest.fixture(scope="session", params=slurm_versions())
def pools_cluster(request):
    """A running two-pool LocalCluster per Slurm version (issue 13): partition a100 with 2 nodes x a100:4 and
    partition v100 with 2 nodes x v100:8 (MaxTime 2 h, MaxNodes 2), typed fake GPUs, node features = the
    type (cluster.TWO_POOLS). Started once, only by the tests that ask for it."""
    from slurm_elastic.chroot import ChrootRoot
    from slurm_elastic.cluster import TWO_POOLS, ClusterConfig, LocalCluster

    reason = slurm_unavailable_reason()
    require = os.environ.get("SLURM_ELASTIC_REQUIRE_SLURM") == "1"
    if reason:
        pytest.fail(reason) if require else pytest.skip(reason)
    release, base = None, None
    if request.param != "host":
        release = request.param
        root = ChrootRoot(release)
        if not root.is_complete():
            if not require:
                pytest.skip(f"no {release} chroot in {root.path}: run 'slurm-elastic cluster prepare --slurm {release}'")
            root.ensure()
        base = root.path / "srv" / "slurm-elastic"
        base.mkdir(parents=True, exist_ok=True)
    state = Path(tempfile.mkdtemp(prefix="se-pools-", dir=base))
    port = free_ports(6, start=26000)
    cluster = LocalCluster(state, ClusterConfig(pools=[dict(p) for p in TWO_POOLS], ctld_port=port, cred_expire=10,
                                                release=release))
    t0 = time.monotonic()
    try:
        cluster.up()
    except BaseException:
        if os.environ.get("SLURM_ELASTIC_KEEP_CLUSTER") != "1":
            shutil.rmtree(state, ignore_errors=True)
        raise
    print(f"\n{request.param} two-pool cluster up in {time.monotonic() - t0:.1f} s: Slurm {cluster.backend.version()}")
    try:
        yield cluster
    finally:
        _cancel_all(cluster)
        cluster.down()
        if os.environ.get("SLURM_ELASTIC_KEEP_CLUSTER") != "1":
            shutil.rmtree(state, ignore_errors=True)


@pytest.fixture
def versioned_job_dir(versioned_cluster):
    """A fresh job directory that the versioned cluster's daemons (and sbatch) can see."""
    path = versioned_cluster.job_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def job_dir(tmp_path):
    """A world-readable working directory for batch scripts and their output."""
    os.chmod(tmp_path, 0o755)
    return tmp_path
