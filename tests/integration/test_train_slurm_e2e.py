"""End to end on the local Slurm cluster: the elastic DDP template with the spiral example is submitted
with sbatch, trains on 1 node x 2 GPUs, is stopped with USR2 (scancel --signal), requeue-held, resized to
2 nodes x 3 GPUs with a daemon decision in its AdminComment, released, and finishes. From its
checkpoint and sample logs: every sample of every epoch was used exactly once, and the parameters match
an uninterrupted single-process run with the same global batch.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from slurm_elastic.spec import Decision  # noqa: E402
from slurm_elastic.train.protocol import EXIT_CHECKPOINTED, read_ack, read_done, read_throughput  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.torch, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "sbatch_templates" / "elastic_ddp.sbatch"
EXAMPLE = REPO / "examples" / "train_elastic_spiral.py"
SPEC = "elastic:min_gpus=1,max_gpus=8,min_batch=24,max_batch=96,max_local_batch=24,batch=48"
N_PER_CLASS, EPOCHS, BATCH = 200, 3, 48
EXAMPLE_ARGS = ["--epochs", str(EPOCHS), "--n-per-class", str(N_PER_CLASS), "--lr-scaling", "sqrt"]


def _samples(rec: Path, job: str, restart: int, world: int) -> list[list[tuple[int, int, list[int]]]]:
    out = []
    for r in range(world):
        rows = []
        for line in (rec / f"samples.{job}.s{restart}.r{r}.txt").read_text().splitlines():
            e, s, idx = (line.split(" ", 2) + [""])[:3]
            rows.append((int(e), int(s), [int(i) for i in idx.split(",") if i]))
        out.append(rows)
    return out


def _scancel(cluster, jid: int) -> None:
    subprocess.run(["/usr/bin/scancel", str(jid)], env=cluster.env, capture_output=True, timeout=30, check=False)


def test_template_stop_requeue_resize_release_resumes_exactly(slurm_cluster, job_dir):
    c, b = slurm_cluster, slurm_cluster.backend
    ckpt, rec, log = job_dir / "ckpt", job_dir / "rec", job_dir / "job.out"
    export = ",".join([
        "ALL", f"ELASTIC_PYTHON={sys.executable}", f"ELASTIC_TRAIN_SCRIPT={EXAMPLE}", f"ELASTIC_CKPT_DIR={ckpt}",
        "ELASTIC_REQUEUE_WAIT=300", "ELASTIC_SELF_REQUEUE=0", "OMP_NUM_THREADS=1",
    ])
    jid = c.sbatch([f"--export={export}", "-o", str(log), f"--comment={SPEC}", "--nodes=1", "--gres=gpu:2",
                    str(TEMPLATE), *EXAMPLE_ARGS, "--record-samples", str(rec), "--step-delay", "0.15"], cwd=job_dir)
    t0 = time.monotonic()
    try:
        c.wait_job(jid, lambda j: j is not None and j.is_running, timeout=30)
        # Let it train a few steps at 2 GPUs, then ask for a checkpoint the way the daemon does.
        first = rec / f"samples.{jid}.s0.r0.txt"
        deadline = time.monotonic() + 90
        while not (first.exists() and len(first.read_text().splitlines()) >= 4):
            assert time.monotonic() < deadline, log.read_text() if log.exists() else "no log"
            time.sleep(0.2)
        b.signal(jid, "USR2")
        deadline = time.monotonic() + 60
        while (ack := read_ack(ckpt, jid, 0)) is None:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert ack["world_size"] == 2 and ack["global_batch"] == BATCH and ack["exit_code"] == EXIT_CHECKPOINTED
        assert 0 < ack["samples_seen"] < EPOCHS * 3 * N_PER_CLASS
        # The batch shell keeps the allocation after the tasks exited 75, waiting to be requeued.
        deadline = time.monotonic() + 30
        while "ended with exit code 75" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert b.get_job(jid).is_running
        b.requeue_hold(jid)
        held = c.wait_job(jid, lambda j: j is not None and j.is_pending and j.held, timeout=30)
        assert held.restart_count == 1
        # Slurm revokes the job's credential at the requeue; a start within the same second fails with
        # "Job credential revoked", so let a second boundary pass before StartTime=now + release.
        time.sleep(2)
        decision = Decision(gpus=6, nodes=2, batch=BATCH, local_batch=8, accum=1, seq=1)
        b.update_job(jid, gpus_per_node=3, num_nodes=2, start_now=True, admin_comment=decision.to_admin_comment())
        b.release(jid)
        job = c.wait_job(jid, lambda j: j is not None and j.is_running, timeout=60)
        assert (job.gpus_per_node, job.node_count, job.restart_count) == (3, 2, 1)
        done = c.wait_job(jid, lambda j: j is None or not j.is_active, timeout=240)
        text = log.read_text()
        assert done is not None and done.state == "COMPLETED", text
    finally:
        _scancel(c, jid)
    print(f"e2e job {jid}: {time.monotonic() - t0:.1f} s from submit to completion")

    text = log.read_text()
    assert f"job {jid} start 0 on 1 node(s) x 2 GPU(s) = 2 tasks" in text
    assert f"job {jid} start 1 on 2 node(s) x 3 GPU(s) = 6 tasks" in text
    assert "global batch 48 = 6 x 8 x 1 accum (from decision)" in text
    assert read_done(ckpt, jid)["samples_seen"] == EPOCHS * 3 * N_PER_CLASS

    # Exactly once: every sample of every epoch, over both starts and all ranks.
    n = 3 * N_PER_CLASS
    per_epoch = {e: Counter() for e in range(EPOCHS)}
    steps = []
    for restart, world in ((0, 2), (1, 6)):
        ranks = _samples(rec, str(jid), restart, world)
        assert len({len(r) for r in ranks}) == 1  # all ranks did the same number of steps
        for rows in zip(*ranks):
            assert len({(row[0], row[1]) for row in rows}) == 1
            per_epoch[rows[0][0]].update(i for row in rows for i in row[2])
            steps.append(rows[0][1])
    assert steps == list(range(len(steps)))  # no step replayed or skipped across the resize
    for e, counts in per_epoch.items():
        assert sorted(counts) == list(range(n)) and max(counts.values()) == 1, f"epoch {e}"

    state = torch.load(ckpt / "checkpoint.pt")
    assert [(h["world_size"], h["global_batch"]) for h in state["history"]] == [(2, BATCH), (6, BATCH)]
    points = {(p["gpus"], p["batch"]) for p in read_throughput(ckpt)}
    assert (6, BATCH) in points

    # Equivalence: the same example uninterrupted in one process (no Slurm) with the same global batch.
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["OMP_NUM_THREADS"] = "1"
    ref = job_dir / "ref-ckpt"
    r = subprocess.run([sys.executable, str(EXAMPLE), "--ckpt-dir", str(ref), "--batch", str(BATCH), *EXAMPLE_ARGS],
                       env=env, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    ref_state = torch.load(ref / "checkpoint.pt")
    diff = max(float((state["model"][k] - ref_state["model"][k]).abs().max()) for k in ref_state["model"])
    print(f"e2e: max |param difference| (2 GPUs -> 2x3 GPUs) vs uninterrupted 1 process: {diff:.2e}")
    print("e2e: " + [line for line in text.splitlines() if "spiral: test accuracy" in line][-1])
    assert diff <= 1e-5
