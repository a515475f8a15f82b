"""Scope and privilege, with unprivileged test users submitting their own jobs to a cluster that runs
the submit plugin and has a managed partition (``gpu``: node1-2) and an unmanaged one (``other``: node3).

The daemon manages only ``gpu``, with a per-user cap of 3 GPUs and a per-job cap of 2 whatever the
specs ask (max_gpus=8). The users then try to forge the daemon's decision (AdminComment, which only an
operator may write) for their own and another user's job, release their held jobs, and write the
daemon's state; every attempt must be refused and change nothing.
"""

from __future__ import annotations

import os
import subprocess

import pytest
from faultlib import jobs_by_id, scancel, unix_users, wait_for

from slurm_elastic.daemon.config import config_from_dict
from slurm_elastic.daemon.loop import Daemon
from slurm_elastic.spec import parse_decision

pytestmark = [pytest.mark.slurm]
USERS = ("sefault1", "sefault2")
SPEC = "elastic:min_gpus=1,max_gpus=8,min_batch=32,max_batch=1024,max_local_batch=128,batch=64"
FORGED = "AdminComment=elastic-decision:gpus=8,nodes=2,batch=512,local_batch=64,accum=1,seq=99"


@pytest.fixture(scope="module")
def users():
    with unix_users(USERS):
        yield USERS


def run_as(cluster, user, *argv):
    return subprocess.run(["runuser", "-u", user, "--", *argv], env=cluster.env, capture_output=True, text=True,
                          timeout=30, check=False)


@pytest.mark.parametrize("lua_cluster", ["host"], indirect=True)  # the host's Slurm only (issue 24)
def test_scope_caps_and_forgery(lua_cluster, users, tmp_path, reliability):
    reliability("scope and privilege", "2 unprivileged users (useradd) submit their own jobs; forgery attempts",
                "specs asking 8 GPUs; a job in an unmanaged partition; users write AdminComment (own and other "
                "user's job), release their held job, write the daemon's state dir",
                "only managed-partition jobs touched; per-job cap 2 and per-user cap 3 hold in Slurm; every "
                "forgery refused by Slurm/the plugin and the daemon's decision unchanged; state not writable")
    u1, u2 = users
    c = lua_cluster
    sb = lambda user, *extra: c.sbatch(["--requeue", "--gres=gpu:1", "-o", "/dev/null", f"--comment={SPEC}",  # noqa: E731
                                        *extra, str(c.script)], cwd=c.script.parent, user=user)
    ids = []
    os.chmod(tmp_path, 0o755)  # users can reach the state dir: only its own modes protect it
    state = tmp_path / "state"
    d = None
    try:
        j1, j2 = sb(u1, "--partition=gpu"), sb(u1, "--partition=gpu")
        j3 = sb(u2, "--partition=gpu")
        j4 = sb(u1, "--partition=other")
        ids += [j1, j2, j3, j4]
        recs = jobs_by_id(c, ids)
        assert {recs[j].user for j in (j1, j2, j4)} == {u1} and recs[j3].user == u2
        assert all(r.held for r in recs.values())  # the plugin held them for the daemon
        cfg = config_from_dict({"state_dir": str(state), "metrics_address": "", "cooldown_s": 3600,
                                "partitions": ["gpu"], "max_gpus_per_user": 3, "max_gpus_per_job": 2})
        d = Daemon(cfg, backend=c.backend)
        d.open()
        for _ in range(2):
            assert d.cycle() is not None
        placed = wait_for(lambda: (r := jobs_by_id(c, [j1, j2, j3])) and all(x.is_running for x in r.values()) and r,
                          60, "the three managed jobs to run")
        gpus = {j: placed[j].gpus_total for j in (j1, j2, j3)}
        assert all(1 <= g <= 2 for g in gpus.values()), gpus  # per-job cap 2 although max_gpus=8
        assert gpus[j1] + gpus[j2] <= 3, gpus  # per-user cap 3
        decisions = {j: placed[j].admin_comment for j in (j1, j2, j3)}
        assert all(parse_decision(v, j).gpus == gpus[j] for j, v in decisions.items())
        other = c.backend.get_job(j4)
        assert other.is_pending and other.held and not other.admin_comment  # unmanaged partition: untouched
        # Forgery and privilege attempts, each refused, each changing nothing.
        attempts = [
            (u1, ["scontrol", "update", f"JobId={j1}", FORGED]),  # own running job's decision
            (u1, ["scontrol", "update", f"JobId={j3}", FORGED]),  # another user's job
            (u1, ["scontrol", "update", f"JobId={j4}", FORGED]),  # own held job
            (u1, ["scontrol", "release", str(j4)]),  # start behind the daemon's back
            (u2, ["scontrol", "update", f"JobId={j1}", "Comment=elastic:min_gpus=8,max_gpus=8,min_batch=32,"
                  "max_batch=1024,max_local_batch=128"]),  # another user's spec
            (u1, ["/usr/bin/touch", str(state / "state.sqlite3")]),
            (u1, ["/usr/bin/touch", str(state / "forged")]),
            (u1, ["/usr/bin/touch", str(state / "daemon.lock")]),
        ]
        for user, argv in attempts:
            if argv[0] == "scontrol":
                argv = [f"{c.config.bin}/scontrol", *argv[1:]]
            r = run_as(c, user, *argv)
            assert r.returncode != 0, (user, argv, r.stdout, r.stderr)
        assert not (state / "forged").exists()
        after = jobs_by_id(c, ids)
        assert {j: after[j].admin_comment for j in (j1, j2, j3)} == decisions
        assert after[j4].held and not after[j4].admin_comment and after[j1].comment == SPEC
        r2 = d.cycle()  # the daemon still sees its own decisions and the caps still hold
        assert r2 is not None and not [x for x in r2.results if x.action.job_id == j4]
        after = jobs_by_id(c, ids)
        assert after[j1].gpus_total + after[j2].gpus_total <= 3 and after[j3].gpus_total <= 2
        held = sum(1 for j in (j1, j2, j3) if after[j].held)
    finally:
        if d:
            d.close()
        scancel(c, ids)
    reliability.jobs(lost=0, left_held=held)
    reliability.figure("forgery attempts refused", f"{len(attempts)}/{len(attempts)}")
    reliability.figure("GPUs j1+j2 (user cap 3)", gpus[j1] + gpus[j2])
