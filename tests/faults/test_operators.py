"""Operators win, one definition of "elastic", and what cannot restart is never stopped: live rows on
the plugin cluster (``lua_cluster``: managed partition ``gpu`` = node1-2, 8 GPUs) with two unprivileged
users (useradd h11b_u1/h11b_u2) and the daemon as root, driven cycle by cycle in this process (a
second daemon and an unknown partition also as ``slurm-elastic daemon`` processes). Jobs are plain
``sleep`` scripts: a USR2 would kill one, so a job still running proves it was never signalled.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from faultlib import jobs_by_id, scancel, unix_users, wait_for, write_config

from slurm_elastic.daemon.config import ConfigError, config_from_dict
from slurm_elastic.daemon.loop import Daemon

pytestmark = [pytest.mark.slurm]
USERS = ("h11b_u1", "h11b_u2")
SPEC = "elastic:min_gpus=1,max_gpus=8,min_batch=32,max_batch=1024,max_local_batch=128,batch=64"


@pytest.fixture(scope="module")
def users():
    with unix_users(USERS):
        yield USERS


def run_as(c, user, *argv):
    cmd = list(argv)
    if cmd[0] in ("scontrol", "sbatch"):
        cmd[0] = f"{c.config.bin}/{cmd[0]}"
    if user != "root":
        cmd = ["runuser", "-u", user, "--", *cmd]
    return subprocess.run(cmd, env=c.env, capture_output=True, text=True, timeout=30, check=False)


def submit(c, user, spec=SPEC, *extra):
    argv = ["--requeue", "--gres=gpu:1", "-o", "/dev/null", "--partition=gpu", *extra, str(c.script)]
    if spec is not None:
        argv.insert(0, f"--comment={spec}")
    return c.sbatch(argv, cwd=c.script.parent, user=user)


def daemon(c, state, **over):
    # No resize unless a test asks for one (cooldown 0): a USR2 would kill these sleep jobs.
    cfg = {"state_dir": str(state), "metrics_address": "", "cooldown_s": 3600, "partitions": ["gpu"],
           "poll_interval_s": 2}
    cfg.update(over)
    d = Daemon(config_from_dict(cfg), backend=c.backend)
    d.open()
    return d


def cycles(d, n):
    for _ in range(n):
        assert d.cycle() is not None, "the cycle did not run"
        time.sleep(1)


def running(c, ids, timeout=60):
    return wait_for(lambda: (r := jobs_by_id(c, ids)) and all(r[j].is_running for j in ids) and r, timeout,
                    f"jobs {ids} to run")


@pytest.mark.parametrize("lua_cluster", ["host"], indirect=True)  # the host's Slurm only (issue 24)
def test_comment_edits_after_submit(lua_cluster, users, tmp_path, reliability, caplog):
    reliability("one definition of elastic", "Comment edits after submit by unprivileged users and an admin",
                "users: \\x1f/NBSP/space before elastic:, removing elastic:, release, adding elastic: to a plain "
                "job, min_gpus above max_gpus, a valid min_gpus raise; admin: removes elastic: from a held job, "
                "adds it to a running plain job",
                "every user edit refused with a readable code, job unchanged and still held; the valid raise is "
                "planned (job runs with >= min_gpus); the admin's edits named in the daemon log, the de-elasticised "
                "job released (not held forever); the other user's job placed in the same cycles")
    c, (u1, u2) = lua_cluster, users
    ids, d = [], None
    try:
        # Submit time: a hidden prefix is refused by the plugin with the spec error (sbatch prints it).
        for bad in ("\x1f" + SPEC, "\u00a0" + SPEC, " " + SPEC, "Elastic:" + SPEC[8:]):
            r = run_as(c, u1, "sbatch", "--parsable", "--requeue", f"--comment={bad}", "-o", "/dev/null",
                       str(c.script))
            assert r.returncode != 0 and "field 'comment'" in r.stderr, (bad, r.stderr)
        a, b, held_b = submit(c, u1), submit(c, u2), submit(c, u1)
        plain = submit(c, u2, None, "--hold")
        ids += [a, b, held_b, plain]
        messages = {}
        for name, user, argv in [
            ("\\x1f prefix", u1, ["scontrol", "update", f"JobId={a}", "Comment=\x1f" + SPEC]),
            ("NBSP prefix", u1, ["scontrol", "update", f"JobId={a}", "Comment=\u00a0" + SPEC]),
            ("remove elastic:", u1, ["scontrol", "update", f"JobId={a}", "Comment=plain now"]),
            ("release", u1, ["scontrol", "release", str(a)]),
            ("Requeue=0", u1, ["scontrol", "update", f"JobId={a}", "Requeue=0"]),
            ("min_gpus > max_gpus", u1, ["scontrol", "update", f"JobId={a}", "Comment=" + SPEC.replace("min_gpus=1", "min_gpus=9")]),
            ("add elastic:", u2, ["scontrol", "update", f"JobId={plain}", "Comment=" + SPEC]),
        ]:
            r = run_as(c, user, *argv)
            assert r.returncode != 0, (name, r.stdout, r.stderr)
            messages[name] = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
        recs = jobs_by_id(c, [a, plain])
        assert recs[a].comment == SPEC and recs[a].held and recs[a].requeueable
        assert recs[plain].comment == "" and recs[plain].held
        assert all(("denied" in m.lower()) or ("invalid" in m.lower()) or ("slurm-elastic" in m) for m in messages.values()), messages
        # A valid raise of min_gpus is accepted (validated) and planned.
        raised = SPEC.replace("min_gpus=1", "min_gpus=2")
        assert run_as(c, u1, "scontrol", "update", f"JobId={a}", f"Comment={raised}").returncode == 0
        # An admin turns a held elastic job plain, and a running plain job elastic.
        d = daemon(c, tmp_path / "state", max_gpus_per_job=2)
        cycles(d, 2)
        placed = running(c, [a, b, held_b])
        assert placed[a].gpus_total >= 2 and placed[a].comment == raised
        plain2 = submit(c, u2, None)
        ids.append(plain2)
        running(c, [plain2])
        other = submit(c, u2, SPEC.replace("min_gpus=1", "min_gpus=2"))  # no room: held by the plugin
        ids.append(other)
        cycles(d, 1)
        assert run_as(c, "root", "scontrol", "update", f"JobId={other}", "Comment=no longer elastic").returncode == 0
        one = SPEC.replace("max_gpus=8", "max_gpus=1")  # its size: no resize (a USR2 would kill the sleep)
        assert run_as(c, "root", "scontrol", "update", f"JobId={plain2}", f"Comment={one}").returncode == 0
        with caplog.at_level("WARNING", logger="slurm_elastic"):
            cycles(d, 2)
        log = "\n".join(r.getMessage() + " " + str(getattr(r, "kv", "")) for r in caplog.records)
        assert f"'job': {other}" in log and "stopped being elastic" in log, log
        assert f"'job': {plain2}" in log and "became elastic" in log, log
        after = jobs_by_id(c, ids)
        assert not after[other].held, "a job that stopped being elastic was left held"
        assert after[b].is_running  # the other user's job kept its place
        left_held = sum(1 for j in ids if after[j].held and j != plain)
    finally:
        if d:
            d.close()
        scancel(c, ids)
    reliability.jobs(lost=0, left_held=left_held)
    for k, v in messages.items():
        reliability.figure(f"user sees ({k})", v[:90])


@pytest.mark.parametrize("lua_cluster", ["host"], indirect=True)  # the host's Slurm only (issue 24)
def test_operator_hold_and_manual_release(lua_cluster, users, tmp_path, reliability):
    reliability("operators win", "an admin's requeuehold of a running elastic job; admin releases",
                "admin `scontrol requeuehold` of a placed job, 3 cycles; admin `scontrol release` of it; admin "
                "`scontrol release` of a job the daemon holds (before it placed it)",
                "the admin's hold is never released by the daemon (status: held by an operator); after the "
                "release the job runs again and is managed; a manual release of the daemon's hold is not fought "
                "(never held again) and the job runs once GPUs free up; the other user's job keeps running")
    c, (u1, u2) = lua_cluster, users
    ids, d = [], None
    try:
        x, y = submit(c, u1, SPEC.replace("max_gpus=8", "max_gpus=2")), submit(c, u2, SPEC.replace("max_gpus=8", "max_gpus=2"))
        ids += [x, y]
        d = daemon(c, tmp_path / "state")
        cycles(d, 1)
        running(c, [x, y])
        assert run_as(c, "root", "scontrol", "requeuehold", str(x)).returncode == 0
        wait_for(lambda: (j := c.backend.get_job(x)) and j.is_pending and j.held and not j.is_completing, 60,
                 "the requeue to finish")
        cycles(d, 3)
        jx = c.backend.get_job(x)
        assert jx.is_pending and jx.held, "the daemon released an operator's hold"
        assert "operator" in (d.db.job_views()[x]["reason"] or "")
        assert c.backend.get_job(y).is_running
        assert run_as(c, "root", "scontrol", "release", str(x)).returncode == 0
        cycles(d, 2)
        running(c, [x])
        # A job held for the daemon (the plugin's submit hold) released by an admin before the daemon
        # placed it: not held again (not fought), and it runs once GPUs free up.
        hog = submit(c, u2, SPEC.replace("min_gpus=1", "min_gpus=4").replace("max_gpus=8", "max_gpus=4"))
        ids.append(hog)
        cycles(d, 1)
        running(c, [hog])
        z = submit(c, u1, SPEC.replace("max_gpus=8", "max_gpus=2"))
        ids.append(z)
        assert c.backend.get_job(z).held  # the plugin's hold, for the daemon
        assert run_as(c, "root", "scontrol", "release", str(z)).returncode == 0
        cycles(d, 2)
        assert not c.backend.get_job(z).held, "the daemon held again a job an operator released"
        scancel(c, [hog])
        wait_for(lambda: (cycles(d, 1), c.backend.get_job(z).is_running)[1], 90, "z to run after the release")
        after = jobs_by_id(c, ids)
        left_held = sum(1 for j in (x, y, z) if after[j].held)
    finally:
        if d:
            d.close()
        scancel(c, ids)
    reliability.jobs(lost=0, left_held=left_held)


@pytest.mark.parametrize("lua_cluster", ["host"], indirect=True)  # the host's Slurm only (issue 24)
def test_second_daemon_and_unknown_partition(lua_cluster, users, tmp_path, reliability):
    reliability("operators win", "a second daemon (own state dir) on the same cluster; an unknown partition",
                "daemon A holds the cluster; `slurm-elastic daemon --once` with another state dir; then a "
                "config with partitions [gpu, nope] at start and at SIGHUP reload",
                "B refuses to act, naming A's lease job (the pending job stays held for A), leaves no placeholder; "
                "A places the job next cycle; the unknown partition is refused at start (exit != 0, named) and "
                "at reload (old config kept)")
    c, (u1, _) = lua_cluster, users
    ids, d = [], None
    try:
        d = daemon(c, tmp_path / "a")
        cycles(d, 1)
        lease = d.lease.job_id
        assert lease is not None and c.backend.get_job(lease).held
        j = submit(c, u1, SPEC.replace("max_gpus=8", "max_gpus=2"))
        ids.append(j)
        conf = write_config(tmp_path / "b.toml", tmp_path / "b", partitions=["gpu"], slurm_bin=c.config.bin)
        r = subprocess.run([sys.executable, "-m", "slurm_elastic.cli", "daemon", "--config", str(conf), "--once"],
                           env=c.env, capture_output=True, text=True, timeout=120, check=False)
        assert "refusing to act" in r.stderr and f"lease job {lease}" in r.stderr, r.stderr[-2000:]
        jj = c.backend.get_job(j)
        assert jj.is_pending and jj.held and not jj.admin_comment, "the second daemon acted"
        leases = [x for x in c.backend.list_jobs() if x.admin_comment.startswith("elastic-lease:")]
        assert [x.job_id for x in leases] == [lease], "the second daemon left its placeholder behind"
        cycles(d, 1)
        running(c, [j])
        # An unknown partition: refused at start, and at reload the old configuration stays.
        bad = write_config(tmp_path / "bad.toml", tmp_path / "a2", partitions=["gpu", "nope"], slurm_bin=c.config.bin)
        r2 = subprocess.run([sys.executable, "-m", "slurm_elastic.cli", "daemon", "--config", str(bad), "--once"],
                            env=c.env, capture_output=True, text=True, timeout=120, check=False)
        assert r2.returncode != 0 and "'nope' not found in Slurm" in r2.stderr, r2.stderr[-2000:]
        with pytest.raises(ConfigError):
            daemon(c, tmp_path / "a3", partitions=["nope"])
        d.config_path = bad
        d.reload()
        assert d.config.partitions == ("gpu",)
        cycles(d, 1)
        left_held = int(c.backend.get_job(j).held)
    finally:
        if d:
            d.close()
        scancel(c, ids)
    assert not [x for x in c.backend.list_jobs() if x.admin_comment.startswith("elastic-lease:")]
    reliability.jobs(lost=0, left_held=left_held)


@pytest.mark.parametrize("lua_cluster", ["host"], indirect=True)  # the host's Slurm only (issue 24)
def test_non_requeueable_job_is_never_signalled(lua_cluster, users, tmp_path, reliability):
    reliability("never stop what cannot restart", "an elastic job Slurm will not requeue (Requeue=0 set by an admin)",
                "job X runs at 8 GPUs; an admin sets Requeue=0; a second user's job arrives (the policy would "
                "shrink X for it); 4 cycles",
                "X never signalled (its sleep would die on USR2): still running at 8 GPUs, restart count 0, "
                "status and log say 'not requeueable'; the other job waits, cycles keep running")
    c, (u1, u2) = lua_cluster, users
    ids, d = [], None
    try:
        x = submit(c, u1)
        ids.append(x)
        d = daemon(c, tmp_path / "state", cooldown_s=0)
        cycles(d, 1)
        size = running(c, [x])[x].gpus_total
        assert run_as(c, "root", "scontrol", "update", f"JobId={x}", "Requeue=0").returncode == 0
        assert not c.backend.get_job(x).requeueable
        y = submit(c, u2)
        ids.append(y)
        cycles(d, 4)
        jx = c.backend.get_job(x)
        assert jx.is_running and jx.gpus_total == size and jx.restart_count == 0
        assert "not requeueable" in (d.db.job_views()[x]["reason"] or "")
        assert not [r for r in d.db.decisions(x) if r["action"] in ("resize", "preempt")]
        jy = c.backend.get_job(y)
        assert jy is not None and (jy.is_running or jy.held)  # placed if GPUs are left, else waiting held
        left_held = int(c.backend.get_job(x).held)
        y_state = "running" if jy.is_running else "waiting (held for the daemon)"
    finally:
        if d:
            d.close()
        scancel(c, ids)
    reliability.jobs(lost=0, left_held=left_held)
    reliability.figure("GPUs of the non-requeueable job", size)
    reliability.figure("other user's job", y_state)
