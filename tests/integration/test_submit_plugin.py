"""plugins/job_submit_elastic.lua loaded into a real slurmctld, exercised through sbatch and scontrol."""

import os
import subprocess
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
