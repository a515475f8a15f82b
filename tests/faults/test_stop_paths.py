"""``slurm-elastic stop`` run by root on a user's job whose checkpoint directory is hostile, on the live
plugin cluster (``lua_cluster``) with one unprivileged user (useradd h3s_u1).

The user's job directory holds ``stop-request.<job>.0`` as a symlink to a root-owned file in a root-only
directory (our own stand-in for /etc, never the real one), then also a FIFO as ``stop-ack.<job>.0.json``.
Root's ``stop --timeout 3`` must end at once, non-zero, naming the path, before signalling; the target
stays as it was, no root-owned file appears in the user's directory, and the job keeps running (stop
never holds or cancels a job it has not seen checkpointed). An honest job of the same user is stopped
by the same command: its stop-request is created by the user (owned by its uid), the job acknowledges,
and stop cancels it.

The jobs are bash scripts that act like the training library's stop protocol: wait for the request file,
then write the ack atomically; USR2 is ignored (a batch job without steps gets none anyway).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from faultlib import REPO, jobs_by_id, scancel, unix_users, wait_for

from tests.chroot_paths import chroot_users, same_path_on_host

pytestmark = [pytest.mark.slurm]
USER = "h3s_u1"
SPEC = "elastic:min_gpus=1,max_gpus=1,min_batch=64,max_batch=64,max_local_batch=64,batch=64"
ACKER = """\
#!/bin/bash
# $1: the checkpoint directory. Acknowledges a stop request as slurm_elastic.train would.
trap '' USR2
d="$1"; r="${SLURM_RESTART_COUNT:-0}"
while [ ! -e "$d/stop-request.$SLURM_JOB_ID.$r" ]; do sleep 0.2; done
printf '{"job_id": "%s", "restart_count": %s, "optimizer_steps": 1, "epoch": 0, "offset": 0, "samples_seen": 64, \
"checkpoint": "%s/checkpoint.pt"}\\n' "$SLURM_JOB_ID" "$r" "$d" > "$d/.ack.tmp"
mv "$d/.ack.tmp" "$d/stop-ack.$SLURM_JOB_ID.$r.json"
exec sleep 300
"""


@pytest.fixture
def users(lua_cluster):
    """The user, known inside a chroot cluster too, whose job directories the host sees where Slurm says."""
    base = lua_cluster.job_dir("h3s").parent
    with unix_users([USER]) as found, chroot_users(lua_cluster, [USER]), same_path_on_host(lua_cluster, base):
        yield found


def stop_cli(c, job: int, timeout_s: float) -> tuple[subprocess.CompletedProcess, float]:
    """The host's Slurm: the real command line. A chroot cluster's Slurm answers only its own client tools,
    which the command cannot be pointed at: the command's own function over the cluster's backend."""
    t0 = time.monotonic()
    if c.chroot is not None:
        import contextlib
        import io

        import click

        from slurm_elastic.commands.stop import stop_job

        out, rc, err = io.StringIO(), 0, ""
        with contextlib.redirect_stdout(out):
            try:
                stop_job(c.backend, job, timeout_s)
            except click.ClickException as e:
                rc, err = 1, f"Error: {e.format_message()}"
        return subprocess.CompletedProcess([], rc, out.getvalue(), err), time.monotonic() - t0
    env = dict(c.env, PATH=f"{c.config.bin}:{os.environ.get('PATH', '')}")
    r = subprocess.run([sys.executable, "-m", "slurm_elastic.cli", "stop", "--timeout", f"{timeout_s:g}", str(job)],
                       env=env, cwd=str(REPO), capture_output=True, text=True, timeout=120, check=False)
    return r, time.monotonic() - t0


def entries(d: Path) -> dict[str, tuple[int, int]]:
    """name -> (uid, mode) of everything in ``d``, links not followed."""
    return {p.name: ((st := os.lstat(p)).st_uid, st.st_mode) for p in d.iterdir()}


def test_root_stop_on_hostile_paths_acts_only_as_the_jobs_user(lua_cluster, users, reliability):
    reliability("user files", "root runs `slurm-elastic stop --timeout 3` on a user's job with a hostile ckpt dir",
                "stop-request.<job>.0 a symlink to a root-owned file in a root-only dir; then also stop-ack.<job>.0.json "
                "a FIFO; and an honest job of the same user",
                "each stop exits non-zero at once (no hang) naming the path, before signalling; the target unchanged; "
                "no root-owned file in the user's dirs; the job still running, not held; the honest job stopped: its "
                "stop-request created as the user (owned by its uid), cancelled after its ack")
    c, pw = lua_cluster, users[USER]
    base = c.job_dir()
    ids: list[int] = []
    try:
        etc = base / "rootonly"
        etc.mkdir()
        os.chmod(etc, 0o700)
        target = etc / "target.conf"
        target.write_text("# root's file: must stay as it is\n")
        os.chmod(target, 0o644)
        before = (target.read_bytes(), os.stat(target).st_mtime_ns, os.stat(target).st_uid, os.stat(target).st_size)
        script = base / "acker.sh"
        script.write_text(ACKER)
        os.chmod(script, 0o755)

        def userdir(name):
            p = base / name
            p.mkdir()
            os.chmod(p, 0o755)
            os.chown(p, pw.pw_uid, pw.pw_gid)
            return p

        def submit(name, d):
            jid = c.sbatch(["--requeue", "--gres=gpu:1", "-o", "/dev/null", "--partition=gpu", f"--job-name=h3s-{name}",
                            f"--comment={SPEC},ckpt_dir={c.inside(d)}", str(script), str(d)], cwd=d, user=pw.pw_name)
            ids.append(jid)
            return jid

        hostile, honest = userdir("hostile"), userdir("honest")
        hj, oj = submit("hostile", hostile), submit("honest", honest)
        # The plugin holds elastic jobs for the daemon; there is none here, so root releases them.
        r = c.run_tool("scontrol", "release", f"{hj},{oj}")
        assert r.returncode == 0, r.stderr
        recs = wait_for(lambda: (x := jobs_by_id(c, [hj, oj], include_finished=False)) and len(x) == 2
                        and all(j.is_running for j in x.values()) and x, 60, "both jobs to run")
        assert recs[hj].user_id == pw.pw_uid and recs[hj].restart_count == 0

        # 1. The stop-request is a symlink to root's file.
        link = hostile / f"stop-request.{hj}.0"
        link.symlink_to(target)
        os.lchown(link, pw.pw_uid, pw.pw_gid)
        r1, t1 = stop_cli(c, hj, 3)
        print(f"\nstop, symlinked request ({t1:.1f} s, exit {r1.returncode}): {r1.stderr.strip()}")
        assert r1.returncode != 0 and t1 < 15, (r1.stdout, r1.stderr)
        assert f"job {hj}: refusing to write stop-request: {c.inside(link)} is a symlink" in r1.stderr, r1.stderr
        assert "asked to checkpoint" not in r1.stdout

        # 2. And the ack is a FIFO: refused unopened (the old code blocked here for good).
        fifo = hostile / f"stop-ack.{hj}.0.json"
        os.mkfifo(fifo)
        os.chown(fifo, pw.pw_uid, pw.pw_gid)
        r2, t2 = stop_cli(c, hj, 3)
        print(f"stop, FIFO ack ({t2:.1f} s, exit {r2.returncode}): {r2.stderr.strip()}")
        assert r2.returncode != 0 and t2 < 15, (r2.stdout, r2.stderr)
        assert f"job {hj}: refusing to read stop-ack: {c.inside(fifo)} is a FIFO" in r2.stderr, r2.stderr

        after = (target.read_bytes(), os.stat(target).st_mtime_ns, os.stat(target).st_uid, os.stat(target).st_size)
        assert after == before and sorted(p.name for p in etc.iterdir()) == ["target.conf"]
        assert all(uid == pw.pw_uid for uid, _ in entries(hostile).values()), entries(hostile)

        # 3. The honest job of the same user: stopped, its request file the user's.
        r3, t3 = stop_cli(c, oj, 60)
        print(f"stop, honest job ({t3:.1f} s, exit {r3.returncode}): {r3.stdout.strip()}")
        assert r3.returncode == 0, (r3.stdout, r3.stderr)
        assert "stopped after step 1" in r3.stdout and "kept; job cancelled" in r3.stdout, r3.stdout
        req = os.lstat(honest / f"stop-request.{oj}.0")
        assert (req.st_uid, req.st_gid) == (pw.pw_uid, pw.pw_gid)
        owners = entries(honest)
        assert all(uid == pw.pw_uid for uid, _ in owners.values()), owners
        ended = c.wait_job(oj, lambda j: j is None or not j.is_active, timeout=60)
        assert ended is None or ended.state == "CANCELLED", ended

        # The hostile job: still running, not held, never requeued.
        time.sleep(1)
        final = jobs_by_id(c, [hj])[hj]
        lost = 0 if final.is_running else 1
        left_held = 1 if final.held else 0
        assert final.is_running and not final.held and final.restart_count == 0, final
    finally:
        scancel(c, ids)
        shutil.rmtree(base, ignore_errors=True)
    reliability.jobs(lost=lost, left_held=left_held)
    reliability.figure("stop s (symlink / FIFO / honest)", f"{t1:.1f} / {t2:.1f} / {t3:.1f}")
    reliability.figure("root-owned files in the user's dirs", 0)
