"""Lightning and the HF Trainer made elastic, end to end on the local Slurm cluster: the template runs
the integration worker (tests/integration/elastic_workers.py) on 1 node x 2 GPUs at the spec's batch
24; the daemon's enactment steps (USR2 to the steps, wait for the ack, requeue-hold, update with a
decision in AdminComment, release) resize it to 3 GPUs at batch 48, then to 1 GPU at batch 36 (18 x 2
accumulation); it finishes. Checked from its logs and checkpoint: every sample of every epoch once, no
step replayed, the lr factor sqrt(B/24) at each batch, AdamW's step count over all starts.
"""

from __future__ import annotations

import math
import subprocess
import sys
import time
from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from elastic_workers import HF_WORKER, LIGHTNING_WORKER, read_steps  # noqa: E402

from slurm_elastic.spec import Decision  # noqa: E402
from slurm_elastic.train.protocol import read_ack, read_done  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.torch, pytest.mark.slow]

SPEC = "elastic:min_gpus=1,max_gpus=8,min_batch=24,max_batch=96,max_local_batch=24,batch=24,max_accum=2"
TEMPLATE = __import__("pathlib").Path(__file__).resolve().parents[2] / "sbatch_templates" / "elastic_ddp.sbatch"


def _wait(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what()
        time.sleep(0.3)


@pytest.mark.parametrize("fw", ["lightning", "hf"])
def test_framework_job_resized_twice_on_slurm(slurm_cluster, job_dir, fw):
    pytest.importorskip("lightning" if fw == "lightning" else "transformers")
    c, b = slurm_cluster, slurm_cluster.backend
    worker = job_dir / "train.py"
    worker.write_text(LIGHTNING_WORKER if fw == "lightning" else HF_WORKER)
    ckpt, out, log = job_dir / "ckpt", job_dir / "out", job_dir / "job.out"
    out.mkdir()
    out.chmod(0o777)
    n = 144
    export = ",".join(["ALL", f"ELASTIC_PYTHON={sys.executable}", f"ELASTIC_TRAIN_SCRIPT={worker}",
                       f"ELASTIC_CKPT_DIR={ckpt}", "ELASTIC_REQUEUE_WAIT=300", "ELASTIC_SELF_REQUEUE=0",
                       "OMP_NUM_THREADS=1", "HF_HUB_OFFLINE=1"])
    jid = c.sbatch([f"--export={export}", "-o", str(log), f"--comment={SPEC}", "--nodes=1", "--gres=gpu:2",
                    str(TEMPLATE), "--ckpt-dir", str(ckpt), "--out-dir", str(out), "--n", str(n), "--epochs", "2",
                    "--lr-scaling", "sqrt", "--step-delay", "0.4"], cwd=job_dir)
    text = lambda: log.read_text() if log.exists() else "no log"  # noqa: E731
    starts = [(2, 24), (3, 48), (1, 36)]
    resizes = [Decision(gpus=3, nodes=1, batch=48, local_batch=16, accum=1, seq=1),
               Decision(gpus=1, nodes=1, batch=36, local_batch=18, accum=2, seq=2)]
    try:
        for restart, d in enumerate(resizes):
            seen = out / f"seen.s{restart}.r0.txt"
            _wait(lambda s=seen: s.exists() and len(s.read_text().splitlines()) >= 2, 240, text)
            b.signal(jid, "USR2")
            _wait(lambda r=restart: read_ack(ckpt, jid, r) is not None, 90, text)
            _wait(lambda r=restart: f"start {r}: training step ended with exit code 75" in text(), 60, text)
            b.requeue_hold(jid)
            c.wait_job(jid, lambda j: j is not None and j.is_pending and j.held, timeout=30)
            time.sleep(2)  # a start in the same second as the requeue can see "Job credential revoked"
            b.update_job(jid, gpus_per_node=d.gpus, num_nodes=1, start_now=True, admin_comment=d.to_admin_comment())
            b.release(jid)
            c.wait_job(jid, lambda j: j is not None and j.is_running, timeout=60)
        done = c.wait_job(jid, lambda j: j is None or not j.is_active, timeout=400)
        assert done is not None and done.state == "COMPLETED", text()
    finally:
        subprocess.run(["/usr/bin/scancel", str(jid)], env=c.env, capture_output=True, timeout=30, check=False)

    per_epoch = {0: Counter(), 1: Counter()}
    steps = []
    for restart, (world, batch) in enumerate(starts):
        ranks = read_steps(out, restart, world)
        assert len({len(r) for r in ranks}) == 1, text()
        for rows in zip(*ranks, strict=True):
            assert len({(row[0], row[1]) for row in rows}) == 1
            per_epoch[rows[0][0]].update(i for row in rows for i in row[2])
            steps.append(rows[0][1])
            assert all(row[3] == pytest.approx(math.sqrt(batch / 24), rel=1e-12) for row in rows)
    assert steps == list(range(len(steps)))
    for e, counts in per_epoch.items():
        assert sorted(counts) == list(range(n)) and max(counts.values()) == 1, f"epoch {e}"
    state = torch.load(ckpt / "checkpoint.pt")
    assert [(h["world_size"], h["global_batch"]) for h in state["history"]] == starts
    assert [h["decision_seq"] for h in state["history"]] == [None, 1, 2]
    assert {float(s["step"]) for s in state["optimizer"]["state"].values()} == {float(len(steps))}
    assert read_done(ckpt, jid)["optimizer_steps"] == len(steps)
    print(f"{fw} on Slurm: job {jid}, {len(steps)} steps over starts {starts}")
