"""An out-of-memory failure live: real Slurm, the real template, real gloo DDP (2 ranks), the daemon.

The job (tests/integration/oom_stand_in.py) raises torch.OutOfMemoryError in any step whose local batch
is above 32, after 2 steps and a checkpoint. Its spec allows only batch 128 on 2 GPUs, so it starts at
2 x 64. Checked from what the job wrote and Slurm and the daemon did (no mocks):

- the job reports the failure (oom.<job>.0.json, the stop ack) and waits to be requeued;
- the daemon learns "local batch <= 63" for the job, restarts it at once at 2 x 32 x 2 accumulation
  (the first start had not stepped long, was in no cooldown: the restart goes past both);
- the second start resumes from the first start's checkpoint (2 steps restored) and the job completes;
- status shows the limit; a fresh daemon on the same state has it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from slurm_elastic.daemon.config import load_config  # noqa: E402
from slurm_elastic.daemon.loop import Daemon  # noqa: E402
from slurm_elastic.demo import TEMPLATE, write_daemon_config  # noqa: E402
from slurm_elastic.spec import parse_decision  # noqa: E402
from slurm_elastic.train.protocol import oom_path, parse_oom  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.torch, pytest.mark.slow]

WORKER = Path(__file__).with_name("oom_stand_in.py")
SPEC = "elastic:min_gpus=2,max_gpus=2,min_batch=128,max_batch=128,max_local_batch=64,max_accum=4,batch=128"


def test_out_of_memory_is_learned_the_job_restarts_below_it_from_its_checkpoint(slurm_cluster, tmp_path):
    c = slurm_cluster
    work = tmp_path / "oom"
    work.mkdir()
    work.chmod(0o755)
    cfg_path = work / "elastic.toml"
    write_daemon_config(cfg_path, work / "state", 9788)
    cfg_path.write_text(cfg_path.read_text() + 'metrics_address = ""\n')
    export = ",".join(["ALL", f"ELASTIC_PYTHON={sys.executable}", f"ELASTIC_TRAIN_SCRIPT={WORKER}",
                       "OMP_NUM_THREADS=1", "ELASTIC_REQUEUE_WAIT=120"])
    d = Daemon(load_config(cfg_path), backend=c.backend)
    d.open()
    job = None
    t0 = time.monotonic()
    try:
        job = c.sbatch([f"--export={export}", "--hold", "--job-name=oom", "-o", str(work / "job.out"),
                        f"--comment={SPEC}", "--nodes=1", "--gres=gpu:1", str(TEMPLATE), "--oom-above", "32"],
                       cwd=work)
        ckpt = work / "elastic-ckpt" / str(job)
        text = "local batch <= 63 on its GPUs: out of memory at 64"
        decisions, shown, reopened = [], None, False
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            d.cycle()
            rec = c.backend.get_job(job, include_finished=True)
            if rec is None or not rec.is_active:
                break
            dec = parse_decision(rec.admin_comment, job)
            if dec is not None and (not decisions or decisions[-1] != dec):
                decisions.append(dec)
            if len(decisions) == 2 and rec.is_running and not reopened:
                # the second start runs: status shows the limit, and a fresh daemon on the same state has it
                st = subprocess.run([sys.executable, "-m", "slurm_elastic.cli", "status", "--state-dir",
                                     str(work / "state"), "--json", "-j", str(job)], env=c.env,
                                    capture_output=True, text=True, timeout=60)
                shown = [r for r in json.loads(st.stdout)["jobs"] if r["jobid"] == job] if st.returncode == 0 else st
                d.close()
                d = Daemon(load_config(cfg_path), backend=c.backend)
                d.open()
                reopened = d.models.oom.notes(job)
            time.sleep(1)
        out = (work / "job.out").read_text() if (work / "job.out").exists() else ""
        rec = c.backend.get_job(job, include_finished=True)
        assert rec is not None and rec.state == "COMPLETED", (rec, decisions, out[-3000:])
        starts = [json.loads(line) for line in out.splitlines() if line.startswith('{"restart"')]
        assert [(s["restart"], s["local_batch"], s["accum"]) for s in starts] == [(0, 64, 1), (1, 32, 2)], out[-3000:]
        assert starts[1]["restored_steps"] == 2  # from the first start's checkpoint, written before the failure
        report = parse_oom(json.loads(oom_path(ckpt, job, 0).read_text()), job, 0)
        assert report == {"local_batch": 64, "accum": 1, "world_size": 2, "global_batch": 128}
        assert [(x.gpus, x.local_batch, x.accum) for x in decisions] == [(2, 64, 1), (2, 32, 2)], decisions
        log = d.db.decisions(job)
        restart = [x for x in log if x["action"] == "resize"]
        assert restart and restart[0]["reason"].startswith("out of memory at local batch 64"), log
        assert shown and shown[0]["limits"] == text and text in shown[0]["reason"], shown
        assert reopened == [text]  # kept across a daemon restart
        # release -> first step of each start (the stability guard's scale: planner.settle_s)
        from slurm_elastic.train.protocol import read_report

        firsts = {st["restart_count"]: st["first_step"] for st in read_report(ckpt)["starts"]}
        released = [x["ts"] for x in log if x["action"] in ("start", "resize") and x["status"] == "done"]
        lat = [f"{firsts[i] - ts:.1f} s" for i, ts in enumerate(released) if i in firsts]
        print(f"job {job}: decisions {[(x.gpus, x.local_batch, x.accum) for x in decisions]}, "
              f"{time.monotonic() - t0:.0f} s from submit to completion; release -> first step per start: {lat}")
    finally:
        d.close()
        if job is not None:
            subprocess.run(["/usr/bin/scancel", str(job)], env=c.env, capture_output=True, timeout=30, check=False)
