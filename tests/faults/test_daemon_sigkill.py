"""The daemon SIGKILLed after every step of a resize, on the real cluster with a real torch DDP job.

One elastic job (the template, torch DDP on CPU) is admitted at 2 GPUs under a per-job cap of 2. The
cap is then raised to 4, so the daemon grows it 2 -> 4, and every daemon life is SIGKILLed right after
one step of that one resize, in order: after the USR2 signal, after the checkpoint ack was seen, after
``scontrol requeuehold``, after the update, after the release. Each next life starts on the same state
directory and must pick up from what the SQLite intent says; the last life is the plain
``slurm-elastic daemon``. Then: the job completes, nothing is left held, the job was restarted exactly
once (the one resize of the decision log), and every sample of every epoch was seen exactly once.
"""

from __future__ import annotations

import json
import os

import pytest
from faultlib import (
    DaemonProc,
    assert_exactly_once,
    jobs_by_id,
    scancel,
    submit_template_job,
    wait_for,
    write_config,
)

pytest.importorskip("torch")

pytestmark = [pytest.mark.slurm, pytest.mark.torch, pytest.mark.slow]

STEPS = ["signal", "ack", "requeue_hold", "update", "release"]
EPOCHS, N = 8, 3 * 400
# 0.3 s a step: about 45 s of training at 2 GPUs, so a daemon slowed by a loaded CI machine still signals the
# job well before it finishes (at 0.1 s a step the job could end before the first life's signal: CI saw it)
STEP_DELAY = 0.3
# One batch: the grow this test is about must not hang on the job's own noise scale. With a batch range
# (32-512), CI once saw the job report a small one and dp shrink it 2 -> 1 at batch 32 ('+13% goodput').
ONE_BATCH = "elastic:min_gpus=1,max_gpus=4,min_batch=64,max_batch=64,max_local_batch=32,batch=64"


def test_sigkill_after_every_step_of_a_resize_then_restart(slurm_cluster, tmp_path, reliability):
    reliability("daemon crash", "SIGKILL of the daemon after each resize step (5 kills, real torch DDP job)",
                "after signal, ack, requeuehold, update, release; restarted on the same state dir each time",
                "job completes; 0 held; restarts == resizes in the decision log (1); samples exactly once; "
                "no open intent")
    os.chmod(tmp_path, 0o755)
    state = tmp_path / "state"
    cfg = tmp_path / "elastic.toml"
    logs = []
    jid = 0
    daemon = None
    try:
        jid = submit_template_job(slurm_cluster, tmp_path, "A", spec=ONE_BATCH, epochs=EPOCHS, step_delay=STEP_DELAY)
        write_config(cfg, state, max_gpus_per_job=2)
        daemon = DaemonProc.cli(slurm_cluster, cfg, tmp_path / "life0.log")
        wait_for(lambda: (j := slurm_cluster.backend.get_job(jid)) and j.is_running, 60, "the job to start")
        first = tmp_path / "A" / "samples"
        wait_for(lambda: list(first.glob(f"samples.{jid}.s0.r*.txt")), 120, "the job to train at its first size")
        assert daemon.stop() == 0
        assert slurm_cluster.backend.get_job(jid).gpus_total == 2
        # now the daemon wants it at 4 (a cheap restart: dp's rescale margin over the seconds the job has
        # held its size must not be what delays the resize this test is about)
        write_config(cfg, state, max_gpus_per_job=4, restart_cost_s=0.5)
        fired = []
        for i, step in enumerate(STEPS, 1):
            marker = tmp_path / f"fault-{step}.json"
            log = tmp_path / f"life{i}.log"
            logs.append(log)
            d = DaemonProc.faulty(slurm_cluster, cfg, log, step, jid, marker)
            try:
                wait_for(lambda d=d: d.proc.poll() is not None
                         or not ((j := slurm_cluster.backend.get_job(jid, include_finished=True)) and j.is_active),
                         180, f"life {i} to be killed after {step}", poll=1)
            finally:
                if d.proc.poll() is None:
                    d.stop()
            rc = d.wait(timeout=5)
            now = slurm_cluster.backend.get_job(jid, include_finished=True)
            assert rc == -9, (f"life {i} ({step}) exited {rc}; job {jid} is "
                              f"{now.state if now else 'gone'}:\n{log.read_text()[-3000:]}")
            info = json.loads(marker.read_text())
            assert info["fault"] == f"after:{step}" and info["pid"] == d.proc.pid
            fired.append(step)
        daemon = DaemonProc.cli(slurm_cluster, cfg, tmp_path / "life6.log")
        job = slurm_cluster.wait_job(jid, lambda j: j is not None and not j.is_active, timeout=300, poll=1)
        daemon.stop()
    finally:
        if daemon:
            daemon.stop()
        left = jobs_by_id(slurm_cluster, [jid], include_finished=False)
        scancel(slurm_cluster, left)
    out = (tmp_path / "A" / "job.out").read_text()
    assert job.state == "COMPLETED", (job, out[-3000:])
    assert fired == STEPS
    from slurm_elastic.daemon.state import StateDB

    db = StateDB(state, readonly=True)
    decisions = db.decisions(jid)
    intents = db.open_intents()
    db.close()
    done = [d for d in decisions if d["status"] == "done"]
    resizes = [d for d in done if d["action"] == "resize"]
    assert [d["action"] for d in done if d["action"] == "start"] == ["start"]
    assert len(resizes) == 1 and (resizes[0]["gpus_from"], resizes[0]["gpus_to"]) == (2, 4), decisions
    assert not [d for d in decisions if d["status"] == "error"], decisions
    assert not intents, intents
    # Restarted exactly as often as it was resized: one requeue, the second start at 4 GPUs, no third.
    assert job.restart_count == 1, job
    assert out.count(f"job {jid} start 1 on 1 node(s) x 4 GPU(s)") == 1, out[-3000:]
    assert f"job {jid} start 2 on" not in out
    assert_exactly_once(tmp_path / "A", jid, EPOCHS, N)
    held = [j for j in slurm_cluster.backend.list_jobs() if j.job_id == jid]
    assert not held
    recovered = "\n".join(p.read_text() for p in logs[1:]) + (tmp_path / "life6.log").read_text()
    assert "resize re-adopted" in recovered and "resize had completed" in recovered
    reliability.jobs(completed=int(job.state == "COMPLETED"), lost=int(job.state != "COMPLETED"), left_held=len(held))
    reliability.figure("daemon lives", len(STEPS) + 2)
