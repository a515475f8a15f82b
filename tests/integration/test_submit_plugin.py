"""plugins/job_submit_elastic.lua loaded into a real slurmctld, exercised through sbatch and scontrol."""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from slurm_elastic.cluster import ClusterConfig, ClusterError, LocalCluster
from tests.conftest import free_ports

pytestmark = pytest.mark.slurm

PLUGIN = Path(__file__).resolve().parents[2] / "plugins" / "job_submit_elastic.lua"
GOOD = "elastic:min_gpus=1,max_gpus=8,min_batch=128,max_batch=4096,max_local_batch=512,batch=256"


@pytest.fixture(scope="module")
def lua_cluster():
    from tests.conftest import slurm_unavailable_reason

    if slurm_unavailable_reason():
        pytest.skip(slurm_unavailable_reason())
    state = Path(tempfile.mkdtemp(prefix="se-lua-"))
    os.chmod(state, 0o755)  # other users (nobody) must read slurm.conf and reach the munge socket
    cluster = LocalCluster(state, ClusterConfig(nodes=2, gpus_per_node=4, job_submit_lua=str(PLUGIN),
                                                ctld_port=free_ports(4, start=27000)))
    cluster.up()
    work = state / "jobs"
    work.mkdir()
    os.chmod(work, 0o755)
    script = work / "job.sh"
    script.write_text("#!/bin/bash\nsleep 120\n")
    script.chmod(0o755)
    cluster.script = script
    try:
        yield cluster
    finally:
        ids = [str(j.job_id) for j in cluster.backend.list_jobs()]
        if ids:
            subprocess.run(["/usr/bin/scancel", *ids], env=cluster.env, capture_output=True, timeout=30, check=False)
        cluster.down()


def sbatch(cluster, comment, *extra, user=None):
    argv = ["--gres=gpu:1", "-o", "/dev/null", "-D", str(cluster.script.parent), *extra]
    if comment is not None:
        argv.append(f"--comment={comment}")
    return cluster.sbatch([*argv, str(cluster.script)], user=user)


@pytest.mark.parametrize(
    "comment, field",
    [
        (GOOD + ",colour=blue", "colour"),
        (GOOD.replace("max_gpus=8", "max_gpus=eight"), "max_gpus"),
        (GOOD.replace("min_gpus=1", "min_gpus=9"), "min_gpus"),
        (GOOD.replace(",max_local_batch=512", ""), "max_local_batch"),
        (GOOD + ",weight=0", "weight"),
        ("elastic:min_gpus=3,max_gpus=3,min_batch=100,max_batch=101,max_local_batch=512", "max_batch"),
        (GOOD + ",profile=$(reboot)", "profile"),
        (GOOD + ",ckpt_dir=/a/../etc", "ckpt_dir"),
    ],
)
def test_sbatch_prints_the_field_of_a_malformed_spec(lua_cluster, comment, field):
    with pytest.raises(ClusterError) as e:
        sbatch(lua_cluster, comment, "--requeue")
    assert f"field '{field}'" in str(e.value)
    assert "slurm-elastic: invalid elastic spec" in str(e.value)


def test_elastic_jobs_need_requeue(lua_cluster):
    with pytest.raises(ClusterError, match="--requeue"):
        sbatch(lua_cluster, GOOD, "--no-requeue")


def test_valid_elastic_job_is_held_and_plain_jobs_pass(lua_cluster):
    b = lua_cluster.backend
    jid = sbatch(lua_cluster, GOOD + ",ckpt_dir=/scratch/ckpt/%j", "--requeue")
    plain = sbatch(lua_cluster, None)
    job = b.get_job(jid)
    assert job.is_pending and job.held and job.comment == GOOD + ",ckpt_dir=/scratch/ckpt/%j"
    lua_cluster.wait_job(plain, lambda j: j is not None and j.is_running, timeout=30)
    # The daemon (root) may update and release it: slurm_job_modify lets its calls through.
    b.update_job(jid, gpus_per_node=2, num_nodes=1, num_tasks=2, start_now=True,
                 admin_comment="elastic-decision:gpus=2,nodes=1,batch=256,local_batch=128,accum=1,seq=1")
    b.release(jid)
    job = lua_cluster.wait_job(jid, lambda j: j is not None and j.is_running, timeout=30)
    assert job.gpus_per_node == 2


def run_as(cluster, user, *argv):
    return subprocess.run(["runuser", "-u", user, "--", *argv], env=cluster.env, capture_output=True, text=True,
                          timeout=30, check=False)


def test_a_user_cannot_release_their_own_held_elastic_job_nor_forge_a_decision(lua_cluster):
    b = lua_cluster.backend
    jid = sbatch(lua_cluster, GOOD, "--requeue", user="nobody")
    assert b.get_job(jid).held and b.get_job(jid).user == "nobody"
    r = run_as(lua_cluster, "nobody", "/usr/bin/scontrol", "release", str(jid))
    assert r.returncode != 0
    assert b.get_job(jid).held and b.get_job(jid).is_pending
    r = run_as(lua_cluster, "nobody", "/usr/bin/scontrol", "update", f"JobId={jid}",
               "AdminComment=elastic-decision:gpus=8,nodes=2,batch=512,local_batch=64,accum=1,seq=9")
    assert r.returncode != 0 and b.get_job(jid).admin_comment == ""
    # A user's edit of their spec is validated again.
    r = run_as(lua_cluster, "nobody", "/usr/bin/scontrol", "update", f"JobId={jid}",
               "Comment=elastic:min_gpus=1,max_gpus=8,min_batch=128,max_batch=64,max_local_batch=512")
    assert r.returncode != 0 and b.get_job(jid).comment == GOOD
    # A plain job of the same user is not affected by the plugin.
    plain = sbatch(lua_cluster, None, "--hold", user="nobody")
    assert run_as(lua_cluster, "nobody", "/usr/bin/scontrol", "release", str(plain)).returncode == 0


# ----- the site install and slurm-elastic doctor on this cluster (issue 22; docs/INSTALL.md) ---------------
REPO = Path(__file__).resolve().parents[2]


def _doctor(cluster, config_path):
    env = {**cluster.env, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "slurm_elastic.cli", "doctor", "--config", str(config_path)],
                          env=env, capture_output=True, text=True, timeout=180, check=False)


def test_doctor_passes_this_cluster_and_fails_a_world_writable_state_dir(lua_cluster, tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    os.chmod(state, 0o755)
    cfg = tmp_path / "elastic.toml"
    cfg.write_text(f'state_dir = "{state}"\n')
    r = _doctor(lua_cluster, cfg)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = {line.split()[1]: line.split()[0] for line in r.stdout.splitlines() if line[:4] in ("OK  ", "WARN", "FAIL")}
    for name in ("slurm", "requeue", "job_submit", "gres", "preemption", "root_jobs", "restart", "state_dir", "munge",
                 "tools", "backend"):
        assert lines.get(name) == "OK", (name, r.stdout)
    assert "8 GPUs on 2 nodes" in r.stdout
    os.chmod(state, 0o777)
    r = _doctor(lua_cluster, cfg)
    assert r.returncode == 1 and "FAIL  state_dir" in r.stdout and f"chmod go-w {state}" in r.stdout


def test_site_install_from_the_wheel_runs_status_as_an_unprivileged_user(lua_cluster):
    """install-site.sh builds the wheel, makes a venv outside the checkout from the system Python (mode 755
    all the way), installs the wheel with --no-index (nothing downloaded) and puts the CLI, unit, plugin,
    templates and config in place; a useradd'ed user then runs `slurm-elastic status` from it."""
    if not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("no system /usr/bin/python3 to make the site venv from")
    root = Path(tempfile.mkdtemp(prefix="se-site-"))  # every path component open to others (pytest's tmp is 700)
    os.chmod(root, 0o755)
    try:
        _install_and_run_status(lua_cluster, root)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _install_and_run_status(lua_cluster, root):
    import pwd

    import click
    import numpy

    r = subprocess.run(["bash", str(REPO / "scripts" / "install-site.sh"), "--root", str(root), "--no-deps",
                        "--extras", "", "--pip-args", "--no-index"],
                       env={**os.environ, "BUILD_PYTHON": sys.executable}, capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    venv = root / "opt" / "slurm-elastic"
    for f in ("usr/local/bin/slurm-elastic", "etc/systemd/system/slurm-elastic.service", "etc/slurm/elastic.toml",
              "usr/share/slurm-elastic/job_submit_elastic.lua", "usr/share/slurm-elastic/sbatch_templates/elastic.sbatch",
              "usr/share/slurm-elastic/grafana/slurm-elastic.json", "usr/share/doc/slurm-elastic/INSTALL.md"):
        assert (root / f).exists(), f
    # status needs click and numpy (the state DB's module): the venv sees copies of the installed ones
    # (--no-deps; nothing is downloaded), wherever this checkout's venv lives (perhaps in a 700 home)
    deps = root / "deps"
    for mod in (click, numpy):
        src = Path(mod.__file__).parent
        for name in (src.name, f"{src.name}.libs"):  # numpy's wheel keeps its OpenBLAS in numpy.libs
            if (src.parent / name).is_dir():
                shutil.copytree(src.parent / name, deps / name)
    (next(venv.glob("lib/python3*/site-packages")) / "deps.pth").write_text(f"{deps}\n")
    subprocess.run(["chmod", "-R", "a+rX", str(deps)], check=True)
    user = "sesite1"  # status prints 8 characters of a user name
    created = False
    try:
        pwd.getpwnam(user)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", user],
                       check=True, capture_output=True, timeout=30)
        created = True
    try:
        jid = sbatch(lua_cluster, GOOD, "--requeue", "-J", "siteinst", user=user)
        env = {**lua_cluster.env, "HOME": "/", "PATH": f"{root}/usr/local/bin:/usr/bin:/bin"}
        env.pop("PYTHONPATH", None)
        runuser = shutil.which("runuser") or "/usr/sbin/runuser"  # before PATH below narrows to the install
        where = subprocess.run([runuser, "-u", user, "--", str(venv / "bin" / "python"), "-c",
                                "import slurm_elastic; print(slurm_elastic.__file__)"],
                               env=env, capture_output=True, text=True, timeout=60, check=False, cwd="/")
        assert where.returncode == 0 and where.stdout.startswith(str(venv)), where.stdout + where.stderr
        st = subprocess.run([runuser, "-u", user, "--", "slurm-elastic", "status"], env=env, capture_output=True,
                            text=True, timeout=60, check=False, cwd="/")
        print(st.stdout)
        assert st.returncode == 0, st.stdout + st.stderr
        rows = [line.split() for line in st.stdout.splitlines()]
        assert rows[0][:4] == ["JOBID", "PARTITION", "NAME", "USER"], st.stdout
        assert [str(jid), "gpu", "siteinst", user, "PD"] in [r[:5] for r in rows], st.stdout
        # and with the daemon's state DB (root's, mode 0644 in a 0755 directory, as the daemon makes it)
        from slurm_elastic.daemon.state import StateDB

        StateDB(root / "var-lib-slurm-elastic").close()
        st = subprocess.run([runuser, "-u", user, "--", "slurm-elastic", "status", "--history", "--state-dir",
                             str(root / "var-lib-slurm-elastic")], env=env, capture_output=True, text=True, timeout=60,
                            check=False, cwd="/")
        assert st.returncode == 0 and "unknown" not in st.stderr, st.stdout + st.stderr
    finally:
        subprocess.run(["/usr/bin/scancel", "-n", "siteinst"], env=lua_cluster.env, capture_output=True,
                       timeout=30, check=False)
        if created:
            subprocess.run(["userdel", user], capture_output=True, timeout=30, check=False)
