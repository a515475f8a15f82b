"""No path around the hold (issue 24 item 4), live on every Slurm version of the machine (``lua_cluster``:
host 22.05 and the chroot's 24.11). Two unprivileged users under a per-user cap of 3 GPUs; the owner
runs ``scontrol requeue`` on her running elastic job and on a finished one. Before the fix the job went
back to PENDING without the daemon's hold, Slurm started it at its last size, and the user held more
than the cap (12 under 8 on 22.05, 4 under 3 on 24.11). Jobs are ``sleep`` scripts of fixed size
(min = max): no resize is planned (a USR2 would kill them), so every size change here is Slurm's or
the owner's.
"""

from __future__ import annotations

import subprocess
import time

import pytest
from faultlib import jobs_by_id, scancel, unix_users

from slurm_elastic.daemon.config import config_from_dict
from slurm_elastic.daemon.loop import Daemon
from tests.chroot_paths import chroot_users

pytestmark = [pytest.mark.slurm]
USERS = ("h1rq_u1", "h1rq_u2")
CAP = 3


def spec(k: int) -> str:
    return f"elastic:min_gpus={k},max_gpus={k},min_batch=32,max_batch=1024,max_local_batch=128,batch=64"


@pytest.fixture
def users(lua_cluster):
    with unix_users(USERS), chroot_users(lua_cluster, USERS):
        yield USERS


def as_user(c, user, *argv):
    cmd = [*c.prefix, "runuser", "-u", user, "--", f"{c.config.bin}/{argv[0]}", *argv[1:]]
    return subprocess.run(cmd, env=c.env, capture_output=True, text=True, timeout=30, check=False)


def submit(c, user, k, script=None):
    return c.sbatch(["--requeue", "--gres=gpu:1", "-o", "/dev/null", "--partition=gpu", f"--comment={spec(k)}",
                     str(script or c.script)], cwd=c.script.parent, user=user)


def gpus_of(c, user, ids) -> int:
    return sum(j.gpus_total for j in jobs_by_id(c, ids, include_finished=False).values()
               if j.user == user and j.is_running)


def test_owners_requeue_of_a_running_and_a_finished_job_is_held_and_capped(lua_cluster, users, tmp_path, reliability):
    reliability("no path around the hold", f"owner's `scontrol requeue` ({lua_cluster.label} Slurm "
                f"{lua_cluster.backend.version()})",
                f"2 users, per-user cap {CAP}; user 1 requeues her running 2-GPU job while her third job waits "
                "for the cap; user 2 requeues his finished job; user 2 submits another job meanwhile",
                "each requeued job held by the daemon in the cycle that finds it pending (never started by Slurm "
                "at its old size), re-placed under the cap; the cap holds in Slurm after every cycle; the other "
                "user's job placed; nothing lost; only the job waiting for the cap left held")
    c, (u1, u2) = lua_cluster, users
    short = c.script.parent / "short.sh"  # ends at its first run, sleeps once requeued
    short.write_text('#!/bin/bash\nif [ "${SLURM_RESTART_COUNT:-0}" = 0 ]; then sleep 2; else sleep 300; fi\n')
    short.chmod(0o755)
    ids, d, over = [], None, []
    d = Daemon(config_from_dict({"state_dir": str(tmp_path / "state"), "metrics_address": "", "cooldown_s": 3600,
                                 "partitions": ["gpu"], "poll_interval_s": 2, "max_gpus_per_user": CAP}),
               backend=c.backend)
    d.open()

    def cycles(n):
        for _ in range(n):
            assert d.cycle() is not None
            for u in (u1, u2):
                if (g := gpus_of(c, u, ids)) > CAP:
                    over.append((u, g))
            time.sleep(1)

    def wait(pred, timeout, what):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if v := pred():
                return v
            cycles(1)
        views = {j: v.get("reason") for j, v in d.db.job_views().items()}
        states = {j: (r.state, r.held, r.gpus_total, r.restart_count) for j, r in jobs_by_id(c, ids).items()}
        raise AssertionError(f"timed out waiting for {what}: {states} {views}")

    try:
        a, a2 = submit(c, u1, 2), submit(c, u1, 1)
        f, b = submit(c, u2, 1, short), submit(c, u2, 1)
        ids += [a, a2, f, b]
        wait(lambda: all(j.is_running for j in jobs_by_id(c, [a, a2, b]).values()), 60, "a, a2, b to run")
        a3 = submit(c, u1, 1)  # u1 is at her cap: waits, held
        ids.append(a3)
        wait(lambda: (j := jobs_by_id(c, [f]).get(f)) and not j.is_active, 60, "f to finish")
        cycles(2)
        assert jobs_by_id(c, [a3])[a3].held
        # The owners' requeues.
        t0 = time.monotonic()
        r1 = as_user(c, u1, "scontrol", "requeue", str(a))
        r2 = as_user(c, u2, "scontrol", "requeue", str(f))
        assert r1.returncode == 0 and r2.returncode == 0, (r1.stderr, r2.stderr)
        b2 = submit(c, u2, 1)
        ids.append(b2)

        def held_by_daemon(j):
            return [x for x in d.db.decisions() if x["job_id"] == j and x["action"] == "hold"
                    and x["reason"] == "went around the hold"]

        wait(lambda: held_by_daemon(a) and held_by_daemon(f), 60, "the daemon to hold both requeued jobs")
        held_s = round(time.monotonic() - t0, 1)
        wait(lambda: all(j.is_running for j in jobs_by_id(c, [f, b, b2]).values()), 90, "f to run again, b2 to run")
        cycles(3)
        after = jobs_by_id(c, ids)
        views = {j: v.get("reason") or "" for j, v in d.db.job_views().items()}
    finally:
        d.close()
        scancel(c, ids)
    # a's 2 GPUs went back to the pool when the owner requeued it: her waiting 1-GPU job a3 may take one
    # (a is still ending then, never planned); a, held, then waits for the cap. Either way u1 <= CAP.
    assert after[a].restart_count == 1 and after[f].restart_count == 1, after
    assert not over, f"per-user cap {CAP} exceeded in Slurm: {over}"
    assert not after[a2].held and after[b2].is_running and after[f].is_running
    waiting = [j for j in (a, a3) if after[j].held]
    assert len(waiting) <= 1 and all("per-user cap" in views.get(j, "") for j in waiting), (after, views)
    lost = sum(1 for j in ids if not after[j].is_active)
    assert lost == 0, after
    reliability.jobs(lost=lost, left_held=sum(1 for j in ids if after[j].held and "per-user cap" not in views.get(j, "")))
    reliability.figure("held for the cap", ",".join("a" if j == a else "a3" for j in waiting) or "none")
    reliability.figure("s from the requeues to both held", held_s)
    reliability.figure("user GPUs after (cap)", f"{gpus_of_snapshot(after, u1)}/{gpus_of_snapshot(after, u2)} ({CAP})")


def gpus_of_snapshot(recs, user) -> int:
    return sum(j.gpus_total for j in recs.values() if j.user == user and j.is_running)
