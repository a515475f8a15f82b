"""Against a real local Slurm (no mocks): the cluster itself, and the backend's reads and actions.

Tests taking ``versioned_cluster`` run once per Slurm version of the machine: the host's, and the
other Debian release's in a chroot (conftest.py), so both JSON dialects are exercised live. Tests
taking ``backend`` run once more per backend: the CLI, and pyslurm (a worker process running the
real PyslurmBackend against that cluster: on the host, or inside the chroot with its pyslurm build).
"""

import os
import shutil
import subprocess
import sys
import time

import pytest

from slurm_elastic.backends.base import JobNotRequeueable, SlurmError
from slurm_elastic.backends.pyslurm_worker import PyslurmWorker
from slurm_elastic.cluster import ClusterConfig, LocalCluster
from slurm_elastic.spec import Decision, parse_decision
from tests.conftest import free_ports

pytestmark = pytest.mark.slurm

SPEC = "elastic:min_gpus=1,max_gpus=8,min_batch=64,max_batch=1024,max_local_batch=128"

REPORT = """#!/bin/bash
echo "start restart=${SLURM_RESTART_COUNT:-0} nodes=$SLURM_JOB_NODELIST gpus=$SLURM_JOB_GPUS"
srun --ntasks=$SLURM_JOB_NUM_NODES --ntasks-per-node=1 bash -c 'echo "node=$SLURMD_NODENAME cvd=$CUDA_VISIBLE_DEVICES"'
sleep 300
"""


def pyslurm_missing(cluster) -> str | None:
    """Why pyslurm cannot run against ``cluster`` (not built for its Slurm), or None."""
    if cluster.chroot is None:
        import importlib.util

        if importlib.util.find_spec("pyslurm") is None:
            return "pyslurm is not installed in this venv"
        return None
    root = cluster.chroot.path
    if not list(root.glob("usr/local/lib/python3*/dist-packages/pyslurm")) + list(
            root.glob("usr/lib/python3/dist-packages/pyslurm")):
        return f"pyslurm is not installed in the {cluster.config.release} chroot"
    return None


@pytest.fixture(params=["cli", "pyslurm"])
def backend(request, versioned_cluster):
    """The cluster's backend: the CLI one, or pyslurm in a worker against the same slurmctld."""
    c = versioned_cluster
    if request.param == "cli":
        yield c.backend
        return
    why = pyslurm_missing(c)
    if why:
        msg = f"{why}: run scripts/build_pyslurm.sh (needs ../shared/vendor/pyslurm)"
        pytest.fail(msg) if os.environ.get("SLURM_ELASTIC_REQUIRE_SLURM") == "1" else pytest.skip(msg)
    if c.chroot is None:
        w = PyslurmWorker.for_host(str(c.conf_path), bin_dir=c.config.bin)
    else:
        w = PyslurmWorker.for_chroot(c.chroot.path, c.inside(c.conf_path), bin_dir=c.config.bin)
    try:
        yield w
    finally:
        w.close()


def write_script(job_dir, text=REPORT, name="job.sh"):
    path = job_dir / name
    path.write_text(text)
    path.chmod(0o755)
    return path


def scancel(cluster, *ids):
    cluster.run_tool("scancel", *map(str, ids), timeout=30)


def test_sinfo_lists_sixteen_idle_gpus(versioned_cluster, backend):
    c = versioned_cluster
    out = c.run_tool("sinfo", "-h", "-N", "-o", "%N %t %G", check=True, timeout=30).stdout.split("\n")
    rows = [line.split() for line in out if line.strip()]
    assert [r[0] for r in rows] == ["node1", "node2", "node3", "node4"]
    assert all(r[2] == "gpu:4" for r in rows)
    nodes = backend.list_nodes()
    assert [n.name for n in nodes] == ["node1", "node2", "node3", "node4"]
    assert sum(n.gpus_total for n in nodes) == 16 and all(n.partitions == ("gpu",) for n in nodes)
    assert all(n.state == "IDLE" for n in nodes) or any(j.is_active for j in backend.list_jobs())
    # Both backends read the same nodes. Read until they agree: a node's flags change between two reads
    # while a job of an earlier test on this cluster completes (seen in CI: IDLE+COMPLETING, then IDLE).
    deadline = time.monotonic() + 30
    while (nodes := backend.list_nodes()) != (other := c.backend.list_nodes()) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert nodes == other or any(j.is_active for j in backend.list_jobs())


def test_backend_talks_to_the_version_it_was_started_with(versioned_cluster):
    """The chroot cluster really runs the other release's Slurm (not the host's tools by accident)."""
    c = versioned_cluster
    version = c.backend.version_tuple()
    ctld = c.slurm_version()
    print(f"{c.label}: squeue {c.backend.version()}, slurmctld {ctld}")
    assert version[:2] == ctld
    raw = c.backend.raw_jobs()
    meta = raw["meta"].get("Slurm") or raw["meta"].get("slurm")
    assert int(meta["version"]["major"]) == version[0] and int(meta["version"]["minor"]) == version[1]
    if c.chroot is not None:
        assert c.pids()["slurmctld"] and os.readlink(f"/proc/{c.pids()['slurmctld']}/root") == str(c.chroot.path)
        assert c.chroot.stamp()["slurm"].split()[-1] == c.backend.version()
        from slurm_elastic.chroot import host_release

        if os.access("/usr/sbin/slurmctld", os.X_OK) and c.config.release != host_release():
            # the host's own Slurm is another version
            host = subprocess.run(["/usr/sbin/slurmctld", "-V"], capture_output=True, text=True, timeout=30).stdout
            assert host.split()[1].split(".")[:2] != [str(ctld[0]), f"{ctld[1]:02d}"], host


def test_second_up_is_a_no_op(versioned_cluster):
    before = versioned_cluster.pids()
    again = LocalCluster(versioned_cluster.state_dir)
    assert again.up() is False
    assert again.pids() == before
    assert again.config == versioned_cluster.config


def test_requeue_hold_resize_release_restarts_with_new_gpus_and_nodes(versioned_cluster, backend, versioned_job_dir):
    c, b, job_dir = versioned_cluster, backend, versioned_job_dir
    log = job_dir / "out.txt"
    jid = c.sbatch(["--requeue", "--open-mode=append", "-o", str(log), "--gres=gpu:2", f"--comment={SPEC}",
                    str(write_script(job_dir))], cwd=job_dir)
    try:
        job = c.wait_job(jid, lambda j: j is not None and j.is_running, timeout=30)
        assert (job.gpus_per_node, job.gpus_total, job.node_count, job.restart_count) == (2, 2, 1, 0)
        assert job.comment == SPEC and job.requeueable
        b.requeue_hold(jid)
        held = b.get_job(jid)
        assert held.is_pending and held.held and held.restart_count == 1
        decision = Decision(gpus=8, nodes=2, batch=512, local_batch=64, seq=1)
        b.update_job(jid, gpus_per_node=4, num_nodes=2, num_tasks=8, start_now=True,
                     admin_comment=decision.to_admin_comment())
        t0 = time.monotonic()
        b.release(jid)
        job = c.wait_job(jid, lambda j: j is not None and j.is_running, timeout=15)
        restart_s = time.monotonic() - t0
        print(f"{c.label} (Slurm {b.version()}): restarted {restart_s:.1f} s after release")
        assert (job.gpus_per_node, job.gpus_total, job.node_count, job.restart_count) == (4, 8, 2, 1)
        assert len(job.nodes) == 2 and not job.held
        assert parse_decision(job.admin_comment, jid) == decision
        # The job itself saw the restart, the new nodes, and 4 GPUs on each of them.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and log.read_text().count("cvd=") < 3:
            time.sleep(0.3)
        text = log.read_text()
        assert "start restart=1" in text
        second_start = text.split("start restart=1", 1)[1]
        cvds = [line.split("cvd=")[1] for line in second_start.splitlines() if "cvd=" in line]
        assert sorted(cvds) == ["0,1,2,3", "0,1,2,3"], text
    finally:
        scancel(c, jid)


def test_held_job_and_admin_comment_round_trip(versioned_cluster, backend, versioned_job_dir):
    c, b, job_dir = versioned_cluster, backend, versioned_job_dir
    jid = c.sbatch(["--hold", "--gres=gpu:1", "--account=ml-lab", f"--comment={SPEC}", "-o", "/dev/null",
                    str(write_script(job_dir))])
    try:
        job = b.get_job(jid)
        assert job.is_pending and job.held and job.comment == SPEC and job.admin_comment == ""
        assert job.account == "ml-lab"  # what an account's weight grant is looked up by (daemon/caps.py)
        b.update_job(jid, admin_comment="elastic-decision:gpus=2,nodes=1,batch=128,local_batch=64,accum=1,seq=4")
        assert parse_decision(b.get_job(jid).admin_comment).seq == 4
        b.update_job(jid, gpus_per_node=3, num_nodes=1, num_tasks=3, start_now=True)
        b.release(jid)
        job = c.wait_job(jid, lambda j: j is not None and j.is_running, timeout=15)
        assert job.gpus_per_node == 3 and job.node_count == 1 and not job.held
        b.hold(jid)  # holding a running job does not stop it (Slurm semantics) ...
        assert b.get_job(jid).is_running
    finally:
        scancel(c, jid)


def test_non_requeueable_job_is_refused_and_keeps_running(versioned_cluster, backend, versioned_job_dir):
    c, b, job_dir = versioned_cluster, backend, versioned_job_dir
    jid = c.sbatch(["--no-requeue", "--gres=gpu:1", "-o", "/dev/null", str(write_script(job_dir))])
    try:
        c.wait_job(jid, lambda j: j is not None and j.is_running, timeout=30)
        assert b.get_job(jid).requeueable is False
        with pytest.raises(JobNotRequeueable):
            b.requeue_hold(jid)
        assert b.get_job(jid).is_running
    finally:
        scancel(c, jid)


def test_failing_scontrol_gives_a_typed_error_with_stderr(versioned_cluster, backend):
    with pytest.raises(SlurmError) as e:
        backend.release(999999)
    assert e.value.returncode != 0 and e.value.stderr and "999999" in " ".join(e.value.argv)
    for change in ({"gpus_per_node": 2}, {"admin_comment": "x"}, {"start_now": True}):
        with pytest.raises(SlurmError) as e:
            backend.update_job(999999, **change)
        assert "Invalid job id" in e.value.stderr or "invalid" in e.value.stderr.lower()
    with pytest.raises(SlurmError):
        backend.signal(999999, "USR2")
    assert backend.get_job(999999) is None


HOSTILE = ['a"b\'c $(touch /tmp/pwned) `id`; | & > <', "x" * 900, "ünïcødé ✓ 日本", "tab\there,comma=eq"]


def test_hostile_comments_and_names_read_back_byte_for_byte(versioned_cluster, backend, versioned_job_dir):
    """Whatever a user puts in a comment or job name comes back unchanged (and is never run)."""
    c, b = versioned_cluster, backend
    script = write_script(versioned_job_dir)
    ids = [c.sbatch(["--hold", "-J", text[:60], f"--comment={text}", "-o", "/dev/null", str(script)])
           for text in HOSTILE]
    try:
        jobs = {j.job_id: j for j in b.list_jobs()}
        for jid, text in zip(ids, HOSTILE, strict=True):
            assert jobs[jid].comment == text and jobs[jid].name == text[:60] and jobs[jid].held
            assert b.get_job(jid) == jobs[jid]
        assert not os.path.exists("/tmp/pwned")
        b.update_job(ids[0], admin_comment=HOSTILE[0])
        assert b.get_job(ids[0]).admin_comment == HOSTILE[0]
        with pytest.raises(ValueError):
            b.update_job(ids[0], admin_comment="two\nlines")
    finally:
        scancel(c, *ids)


def test_signal_reaches_the_batch_shell(versioned_cluster, backend, versioned_job_dir):
    c, b, job_dir = versioned_cluster, backend, versioned_job_dir
    mark = job_dir / "got-usr2"
    script = write_script(job_dir, f"#!/bin/bash\ntrap 'echo usr2 > {c.inside(mark)}' USR2\n"
                                   "for i in $(seq 600); do sleep 0.1; done\n", name="trap.sh")
    jid = c.sbatch(["--gres=gpu:1", "-o", "/dev/null", str(script)], cwd=job_dir)
    try:
        c.wait_job(jid, lambda j: j is not None and j.is_running, timeout=30)
        time.sleep(1)  # the trap is set
        b.signal(jid, "USR2", batch_only=True)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and not mark.exists():
            time.sleep(0.2)
        assert mark.exists() and b.get_job(jid).is_running
    finally:
        scancel(c, jid)


def test_pyslurm_runs_against_the_clusters_own_slurm(versioned_cluster):
    """The pyslurm worker really is the build for this Slurm and, for the chroot, runs inside it."""
    c = versioned_cluster
    why = pyslurm_missing(c)
    if why:
        pytest.fail(why) if os.environ.get("SLURM_ELASTIC_REQUIRE_SLURM") == "1" else pytest.skip(why)
    w = (PyslurmWorker.for_host(str(c.conf_path), bin_dir=c.config.bin) if c.chroot is None else
         PyslurmWorker.for_chroot(c.chroot.path, c.inside(c.conf_path), bin_dir=c.config.bin))
    try:
        from slurm_elastic.backends.choose import major

        version = w.pyslurm_version()
        print(f"{c.label}: pyslurm {version}, slurmctld {c.slurm_version()}")
        assert major(version) == tuple(c.slurm_version())
        if c.chroot is not None:
            assert os.readlink(f"/proc/{w.proc.pid}/root") == str(c.chroot.path)
        assert [n.name for n in w.list_nodes()] == ["node1", "node2", "node3", "node4"]
    finally:
        w.close()


def test_status_command_shows_elastic_jobs(slurm_cluster, job_dir):
    c = slurm_cluster
    jid = c.sbatch(["--hold", "--gres=gpu:2", f"--comment={SPEC},batch=256", "-o", "/dev/null",
                    str(write_script(job_dir))])
    bad = c.sbatch(["--hold", "--gres=gpu:1", "--comment=elastic:min_gpus=4,max_gpus=2,min_batch=64,max_batch=128,max_local_batch=64", "-o", "/dev/null",
                    str(write_script(job_dir))])
    plain = c.sbatch(["--hold", "--gres=gpu:1", "-o", "/dev/null", str(write_script(job_dir))])
    try:
        run = [sys.executable, "-m", "slurm_elastic.cli", "status"]
        out = subprocess.run([*run, "-h", "-o", "jobid,st,gpus,range,batch,reason:60"], env=c.env,
                             capture_output=True, text=True, timeout=60, check=True).stdout
        rows = {int(line.split()[0]): line.split(None, 5) for line in out.splitlines()}
        assert rows[jid][1:5] == ["PD", "2", "1-8", "256"]
        assert rows[bad][-1] == "bad spec: min_gpus 4 > max_gpus 2 (min_gpus)"
        assert plain not in rows
        import json

        doc = json.loads(subprocess.run([*run, "--json", "-j", f"{jid},{plain}", "--all"], env=c.env,
                                        capture_output=True, text=True, timeout=60, check=True).stdout)
        assert sorted(r["jobid"] for r in doc["jobs"]) == sorted([jid, plain])
    finally:
        scancel(c, jid, bad, plain)


def test_plan_command_shows_what_the_next_cycle_would_do_and_changes_nothing(slurm_cluster, job_dir, tmp_path):
    """``slurm-elastic plan``: the next cycle's decisions, read from the real Slurm, nothing enacted; a
    spec weight above the user's grant is named in the reason, as status names it."""
    import json

    c = slurm_cluster
    script = str(write_script(job_dir))
    plain = c.sbatch(["--hold", "--gres=gpu:1", f"--comment={SPEC},batch=64", "-o", "/dev/null", script])
    heavy = c.sbatch(["--hold", "--gres=gpu:1", f"--comment={SPEC},batch=64,weight=10", "-o", "/dev/null", script])
    lab = c.sbatch(["--hold", "--gres=gpu:1", "--account=ml-lab", f"--comment={SPEC},batch=64,weight=10", "-o",
                    "/dev/null", script])
    cfg = tmp_path / "elastic.toml"
    cfg.write_text(f'state_dir = "{tmp_path / "state"}"\nmetrics_address = ""\nbackend = "cli"\n'
                   f'slurm_bin = "{c.config.bin}"\nweight_grants = {{"account:ml-lab" = 4}}\n')
    try:
        run = [sys.executable, "-m", "slurm_elastic.cli", "plan", "--config", str(cfg)]
        out = subprocess.run(run, env=c.env, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (out.stdout, out.stderr)
        lines = out.stdout.splitlines()
        assert lines[0].startswith("policy dp: ") and lines[1].split() == ["JOBID", "STATUS", "GPUS", "NEXT", "BATCH",
                                                                          "ACTION", "REASON"], lines
        rows = {int(line.split()[0]): line for line in lines[2:] if line.split()[0].isdigit()}
        assert set(rows) >= {plain, heavy, lab}, lines
        assert "weight 10 counts as 1 (the site's grant to root)" in rows[heavy], rows[heavy]
        # the job's Slurm account, as squeue shows it, earns that account's grant
        assert "weight 10 counts as 4 (the site's grant to account ml-lab)" in rows[lab], rows[lab]
        assert "counts as" not in rows[plain], rows[plain]
        doc = json.loads(subprocess.run([*run, "--json"], env=c.env, capture_output=True, text=True, timeout=120,
                                        check=True).stdout)
        by_id = {r["job_id"]: r for r in doc["jobs"]}
        assert by_id[heavy]["action"] == "start" and "counts as 1" in by_id[heavy]["reason"], by_id[heavy]
        recs = {j.job_id: j for j in c.backend.list_jobs()}
        assert recs[plain].held and recs[heavy].held and recs[lab].held  # a plan enacts nothing
        assert recs[lab].account == "ml-lab" and recs[plain].account != "ml-lab"
    finally:
        scancel(c, plain, heavy, lab)


def test_down_stops_only_its_own_processes(versioned_cluster, tmp_path):
    """A second small cluster of the same version: its down() leaves the session cluster (and, for a
    chroot, the bind mounts that the session cluster still needs) and an unrelated process alive."""
    c = versioned_cluster
    bystander = subprocess.Popen(["sleep", "60"])
    state = tmp_path / "c2" if c.chroot is None else c.chroot.path / "srv" / "slurm-elastic" / f"c2-{os.getpid()}"
    second = LocalCluster(state, ClusterConfig(nodes=2, gpus_per_node=2, release=c.config.release,
                                               ctld_port=free_ports(4, start=26000)))
    try:
        assert second.up() is True
        pids = second.pids()
        assert len(pids["slurmd"]) == 2
        assert second.backend.version() == c.backend.version()
        stopped = second.down()
        assert set(stopped) == {"munged", "slurmctld", "slurmd:node1", "slurmd:node2"}
        for pid in [pids["munged"], pids["slurmctld"], *pids["slurmd"].values()]:
            assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
        assert bystander.poll() is None
        assert c.is_up() and c.backend.list_nodes()
        if c.chroot is not None:
            assert c.chroot.mounted() == c.chroot.wanted_mounts()  # still held by the session cluster
        assert (second.conf_path).exists()  # down removes nothing
        assert second.down() == []  # a second down has nothing to stop
    finally:
        second.down()
        bystander.kill()
        bystander.wait()
        if c.chroot is not None:
            shutil.rmtree(state, ignore_errors=True)


def test_cluster_command_up_status_down_on_each_version(versioned_cluster, tmp_path):
    """`slurm-elastic cluster up|status|down --slurm ...`: idempotent up, status with the version, down by pid."""
    c = versioned_cluster
    slurm = c.config.release or "host"
    from slurm_elastic.chroot import host_release

    if c.chroot is not None and slurm == host_release():
        pytest.skip(f"'--slurm {slurm}' on a {slurm} host means the host's Slurm (tested as [host])")
    state = tmp_path / "cli" if c.chroot is None else c.chroot.path / "srv" / "slurm-elastic" / f"cli-{os.getpid()}"
    port = str(free_ports(4, start=30000))
    cli = [sys.executable, "-m", "slurm_elastic.cli", "cluster"]
    common = ["--state-dir", str(state), "--slurm", slurm]

    def run(*args):
        return subprocess.run([*cli, *args], capture_output=True, text=True, timeout=120, check=False)

    try:
        first = run("up", *common, "--nodes", "2", "--gpus-per-node", "2", "--port", port)
        assert first.returncode == 0, first.stderr
        assert first.stdout.startswith("started: 2 nodes x 2 GPUs, Slurm " + c.backend.version())
        again = run("up", *common, "--nodes", "2", "--gpus-per-node", "2", "--port", port)
        assert again.returncode == 0 and again.stdout.startswith("already up"), again.stdout + again.stderr
        other_shape = run("up", *common, "--nodes", "3", "--gpus-per-node", "2", "--port", port)
        assert other_shape.returncode != 0 and "another shape" in other_shape.stderr
        import json

        info = json.loads(run("status", *common, "--json").stdout)
        assert info["up"] and info["version"] == c.backend.version() and info["slurm"] == slurm
        assert [(n["name"], n["gpus_total"]) for n in info["nodes"]] == [("node1", 2), ("node2", 2)]
        if c.chroot is not None:
            assert info["chroot"] == str(c.chroot.path) and info["mounts"] == c.chroot.wanted_mounts()
        pids = [d["pid"] for d in info["daemons"]]
        down = run("down", *common)
        assert down.returncode == 0 and down.stdout.startswith("stopped: slurmd:node1, slurmd:node2, slurmctld, munged")
        assert all(not os.path.exists(f"/proc/{p}") or open(f"/proc/{p}/stat").read().split()[2] == "Z" for p in pids)
        assert run("down", *common).stdout.startswith("stopped: nothing was running")
        assert c.is_up()  # the session cluster of the same version was left alone
    finally:
        run("down", *common)
        if c.chroot is not None:
            shutil.rmtree(state, ignore_errors=True)
