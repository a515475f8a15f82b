"""A job that will not die does not stall the cycle (issue 24 item 7), live on every Slurm version of the
machine (``lua_cluster``: host 22.05 and the chroot's 24.11). Job S acknowledges the stop (it writes
``stop-ack.<job>.<restart>.json`` in its ckpt_dir, as the in-job library does) and ignores TERM, so
Slurm needs KillWait (``cluster.kill_wait_s``) to end it at a requeue or a cancel. The daemon runs its
own loop (``run_forever`` in a thread); the test shrinks S by lowering the per-job cap and submits T
(room for it is free) the moment S has acknowledged. Before the fix ``requeue_hold`` waited inside
the cycle for Slurm to finish the requeue (about KillWait), and T's start waited with it.
"""

from __future__ import annotations

import threading
import time

import pytest
from faultlib import scancel, wait_for

from slurm_elastic.daemon.config import config_from_dict
from slurm_elastic.daemon.loop import Daemon
from tests.chroot_paths import same_path_on_host

pytestmark = [pytest.mark.slurm]

STUCK = """#!/bin/bash
trap '' TERM
exec srun {task}
"""
# The task: acknowledges USR2 as the in-job library does (train/protocol.py: stop-ack.<job>.<restart>.json,
# written atomically), and ignores TERM (its sleeps inherit that): only KillWait's SIGKILL ends it.
TASK = """#!/bin/bash
trap '' TERM
ack() {
  f="{ckpt}/stop-ack.$SLURM_JOB_ID.${SLURM_RESTART_COUNT:-0}.json"
  printf '{"job_id": "%s", "restart_count": %s}\\n' "$SLURM_JOB_ID" "${SLURM_RESTART_COUNT:-0}" > "$f.tmp"
  mv "$f.tmp" "$f"
}
trap ack USR2
# its first step at this start, as the in-job library reports it (the planner resizes only a job that stepped)
r="${SLURM_RESTART_COUNT:-0}"
printf '{"format": 1, "starts": [{"restart_count": %s, "first_step": %s}]}\n' "$r" "$(date +%s)" > "{ckpt}/.t.tmp"
mv "{ckpt}/.t.tmp" "{ckpt}/throughput.json"
while true; do sleep 0.2; done
"""


def test_a_job_that_ignores_term_delays_only_itself(lua_cluster, tmp_path, reliability):
    c = lua_cluster
    reliability("a job that will not die", f"a job acks the stop and ignores TERM ({c.label} Slurm "
                f"{c.backend.version()}, KillWait {c.kill_wait_s} s)",
                "its shrink (requeuehold waits KillWait for Slurm to end it) while a second job arrives with "
                "room free; then the stuck job cancelled (COMPLETING for KillWait)",
                "no enactor poll or cycle waits for the stuck job (each well under KillWait); the second job "
                "starts within a cycle or two; the stuck job re-placed once Slurm shows it pending; a cancelled "
                "job still COMPLETING is never planned")
    work = c.job_dir()
    ckpt = work / "ckpt"
    ckpt.mkdir()
    task = work / "task.sh"
    task.write_text(TASK.replace("{ckpt}", c.inside(ckpt)))
    task.chmod(0o755)
    script = work / "stuck.sh"
    script.write_text(STUCK.replace("{task}", c.inside(task)))
    script.chmod(0o755)
    spec_s = f"elastic:min_gpus=1,max_gpus=4,min_batch=32,max_batch=1024,max_local_batch=128,batch=64,ckpt_dir={c.inside(ckpt)}"
    spec_t = "elastic:min_gpus=2,max_gpus=2,min_batch=32,max_batch=1024,max_local_batch=128,batch=64"
    ids, polls, cycles_s = [], [], []
    d = Daemon(config_from_dict({"state_dir": str(tmp_path / "state"), "metrics_address": "", "cooldown_s": 0,
                                 "partitions": ["gpu"], "poll_interval_s": 2, "ack_timeout_s": 60,
                                 "restart_cost_s": 1}), backend=c.backend)
    from slurm_elastic.daemon.state import StateDB

    def decisions():
        db = StateDB(tmp_path / "state", readonly=True)
        try:
            return db.decisions()
        finally:
            db.close()

    opened = threading.Event()

    def run():  # the daemon's SQLite connection lives in its own thread: open, loop and close there
        d.open()
        real_poll, real_cycle = d.enactor.poll, d.cycle

        def timed_poll():
            t = time.monotonic()
            try:
                return real_poll()
            finally:
                polls.append(time.monotonic() - t)

        def timed_cycle():
            t = time.monotonic()
            try:
                return real_cycle()
            finally:
                cycles_s.append(time.monotonic() - t)

        d.enactor.poll, d.cycle = timed_poll, timed_cycle
        opened.set()
        try:
            d.run_forever(poll_actions_s=1.0)
        finally:
            d.close()

    with same_path_on_host(c, work):
        loop = threading.Thread(target=run, daemon=True)
        loop.start()
        assert opened.wait(60)
        try:
            s = c.sbatch(["--requeue", "--gres=gpu:1", "-o", str(work / "s.out"), "--partition=gpu",
                          f"--comment={spec_s}", str(script)], cwd=work)
            ids.append(s)
            wait_for(lambda: (j := c.backend.get_job(s)) and j.is_running and j.gpus_total == 4, 60, "S at 4 GPUs")
            time.sleep(3)  # srun's step up, its traps set
            d.policy.max_gpus_per_job = 2  # the daemon now shrinks S to 2
            try:
                ack = wait_for(lambda: next(iter(ckpt.glob(f"stop-ack.{s}.*.json")), None), 60, "S to acknowledge")
            except AssertionError as e:
                db = StateDB(tmp_path / "state", readonly=True)
                try:
                    raise AssertionError(f"{e}; views {db.job_views()}; decisions {db.decisions()}; "
                                         f"job {c.backend.get_job(s)}; ckpt {list(ckpt.iterdir())}") from None
                finally:
                    db.close()
            t_ack = time.monotonic()
            t = c.sbatch(["--requeue", "--gres=gpu:1", "-o", "/dev/null", "--partition=gpu", f"--comment={spec_t}",
                          str(c.script)], cwd=c.script.parent)
            ids.append(t)
            wait_for(lambda: (j := c.backend.get_job(t)) and j.is_running, 60, "T to run")
            t_start = time.monotonic() - t_ack
            s_again = wait_for(lambda: (j := c.backend.get_job(s)) and j.is_running and j.restart_count == 1 and j, 90,
                               "S to run again at its new size")
            t_resize = time.monotonic() - t_ack
            # Cancel S: it ignores TERM, so it is COMPLETING for KillWait; no cycle may plan it.
            n_before = len([x for x in decisions() if x["job_id"] == s])
            time.sleep(2)
            scancel(c, [s])
            t_cancel = time.monotonic()
            seen_completing = wait_for(lambda: (j := c.backend.get_job(s)) is None or j.is_completing or "gone", 10,
                                       "S ending")
            wait_for(lambda: c.backend.get_job(s) is None, c.kill_wait_s + 60, "S to end")
            t_end = time.monotonic() - t_cancel
            time.sleep(3)
        finally:
            d.stop_event.set()
            loop.join(timeout=60)
            scancel(c, ids)
    rows = decisions()
    s_rows = [x for x in rows if x["job_id"] == s]
    planned_after_cancel = [x for x in s_rows[n_before:] if x["action"] in ("start", "resize", "hold")]
    assert ack and 1 <= s_again.gpus_total <= 2, s_again  # re-placed within the lowered cap
    assert not planned_after_cancel, planned_after_cancel
    assert max(polls) < c.kill_wait_s - 1, f"an enactor poll waited for the stuck job: {max(polls):.1f} s"
    assert max(cycles_s) < c.kill_wait_s - 1, f"a cycle waited for the stuck job: {max(cycles_s):.1f} s"
    assert t_start < 8, f"T waited {t_start:.1f} s after S's ack"
    assert t_resize >= c.kill_wait_s - 1  # S really was stuck for KillWait
    reliability.jobs(lost=0, left_held=0)
    reliability.figure("KillWait s", c.kill_wait_s)
    reliability.figure("T running s after S's ack", round(t_start, 1))
    reliability.figure("S re-placed s after its ack", round(t_resize, 1))
    reliability.figure("longest enactor poll s", round(max(polls), 2))
    reliability.figure("longest cycle s", round(max(cycles_s), 2))
    reliability.figure("cancelled S ended s (COMPLETING)", round(t_end, 1))
    reliability.figure("seen while cancelled", str(seen_completing)[:40])
