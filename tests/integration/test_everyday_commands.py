"""Everyday commands on the local Slurm cluster: ``slurm-elastic stop`` then a resubmission that continues
from the checkpoint (exactly once over both jobs), its refusals, and the crash policy (``max_failures=2``)
through a real daemon: two requeues, then the job is left FAILED and the daemon log says so.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("torch")

pytestmark = [pytest.mark.slurm, pytest.mark.torch, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "sbatch_templates" / "elastic.sbatch"
EXAMPLE = REPO / "examples" / "train_elastic_spiral.py"
SPEC = "elastic:min_gpus=1,max_gpus=4,min_batch=24,max_batch=96,max_local_batch=48,batch=48"
N_PER_CLASS, EPOCHS = 100, 3


def _cli(cluster, *args, timeout=300):
    return subprocess.run([sys.executable, "-m", "slurm_elastic.cli", *args], env=cluster.env, capture_output=True,
                          text=True, timeout=timeout, check=False)


def _export(script: Path) -> str:
    return ",".join(["ALL", f"ELASTIC_PYTHON={sys.executable}", f"ELASTIC_TRAIN_SCRIPT={script}",
                     "ELASTIC_REQUEUE_WAIT=120", "ELASTIC_SELF_REQUEUE=0", "OMP_NUM_THREADS=1"])


def test_stop_then_resubmit_continues_from_the_checkpoint(slurm_cluster, job_dir):
    c = slurm_cluster
    rec, log1, log2 = job_dir / "rec", job_dir / "job1.out", job_dir / "job2.out"
    args = ["--epochs", str(EPOCHS), "--n-per-class", str(N_PER_CLASS), "--record-samples", str(rec),
            "--step-delay", "0.1"]
    # Refusals: an unknown job and a job that is not elastic.
    r = _cli(c, "stop", "999999")
    assert r.returncode != 0 and "job 999999 is not known to Slurm" in r.stderr, r.stderr
    plain = c.sbatch(["-o", "/dev/null", "--wrap", "sleep 30"], cwd=job_dir)
    try:
        r = _cli(c, "stop", str(plain))
        assert r.returncode != 0 and f"job {plain} is not an elastic job" in r.stderr, r.stderr
    finally:
        subprocess.run(["/usr/bin/scancel", str(plain)], env=c.env, capture_output=True, timeout=30, check=False)

    j1 = c.sbatch([f"--export={_export(EXAMPLE)}", "-o", str(log1), f"--comment={SPEC}", "--nodes=1",
                   "--gres=gpu:2", str(TEMPLATE), *args], cwd=job_dir)
    try:
        deadline = time.monotonic() + 120
        while not (rec / f"samples.{j1}.s0.r0.txt").exists() or \
                len((rec / f"samples.{j1}.s0.r0.txt").read_text().splitlines()) < 3:
            assert time.monotonic() < deadline, log1.read_text() if log1.exists() else "no log"
            time.sleep(0.3)
        r = _cli(c, "stop", str(j1))
        assert r.returncode == 0, r.stdout + r.stderr
        print(r.stdout)
        assert "checkpoint" in r.stdout and "kept; job cancelled" in r.stdout
        ended = c.wait_job(j1, lambda j: j is None or not j.is_active, timeout=60)
        assert ended is None or ended.state == "CANCELLED"
    finally:
        subprocess.run(["/usr/bin/scancel", str(j1)], env=c.env, capture_output=True, timeout=30, check=False)
    ckpt = job_dir / "elastic-ckpt" / str(j1)
    assert (ckpt / "checkpoint.pt").exists()
    # The printed resubmission: the same spec with ckpt_dir pinned to the stopped job's directory, and
    # resume=must (issue 21: a continuation whose checkpoint is missing fails instead of starting over).
    comment = [w for w in r.stdout.split() if w.startswith("--comment=")][0].split("=", 1)[1]
    assert comment.endswith(f"ckpt_dir={ckpt},resume=must"), comment
    j2 = c.sbatch([f"--export={_export(EXAMPLE)}", "-o", str(log2), f"--comment={comment}", "--nodes=1",
                   "--gres=gpu:1", str(TEMPLATE), *args], cwd=job_dir)
    try:
        done = c.wait_job(j2, lambda j: j is None or not j.is_active, timeout=300)
        assert done is not None and done.state == "COMPLETED", log2.read_text()
    finally:
        subprocess.run(["/usr/bin/scancel", str(j2)], env=c.env, capture_output=True, timeout=30, check=False)
    text = log2.read_text()
    assert "resumed from checkpoint.pt" in text, text
    # Exactly once over the stopped job and its continuation.
    n = 3 * N_PER_CLASS
    per_epoch = {e: Counter() for e in range(EPOCHS)}
    for f in sorted(rec.glob("samples.*.txt")):
        for line in f.read_text().splitlines():
            e, _s, idx = (line.split(" ", 2) + [""])[:3]
            per_epoch[int(e)].update(int(i) for i in idx.split(",") if i)
    for e, counts in per_epoch.items():
        assert sorted(counts) == list(range(n)) and max(counts.values()) == 1, f"epoch {e}"


CRASH = """\
import os, sys
print("training attempt", os.environ.get("SLURM_RESTART_COUNT", "0"), flush=True)
raise SystemExit(3)
"""


def test_crash_policy_requeues_twice_then_leaves_the_job_failed(slurm_cluster, job_dir):
    from slurm_elastic.demo import write_daemon_config
    from tests.conftest import free_ports

    c = slurm_cluster
    script = job_dir / "crash.py"
    script.write_text(CRASH)
    cfg, state = job_dir / "elastic.toml", job_dir / "daemon-state"
    write_daemon_config(cfg, state, free_ports(1, start=29400))
    dlog = open(job_dir / "daemon.log", "wb")
    daemon = subprocess.Popen([sys.executable, "-m", "slurm_elastic.cli", "daemon", "--config", str(cfg)],
                              env=c.env, stdout=dlog, stderr=subprocess.STDOUT, start_new_session=True)
    log = job_dir / "crash.out"
    jid = 0
    try:
        jid = c.sbatch([f"--export={_export(script)}", "--hold", "-o", str(log),
                        f"--comment={SPEC},max_failures=2", "--nodes=1", "--gres=gpu:1", str(TEMPLATE)],
                       cwd=job_dir)
        deadline = time.monotonic() + 300
        while "crash policy: giving up" not in (job_dir / "daemon.log").read_text(errors="replace"):
            assert time.monotonic() < deadline, (job_dir / "daemon.log").read_text(errors="replace")[-4000:]
            assert daemon.poll() is None, "the daemon exited"
            time.sleep(1)
    finally:
        if daemon.poll() is None:
            os.kill(daemon.pid, signal.SIGTERM)
            daemon.wait(timeout=30)
        dlog.close()
        if jid:
            subprocess.run(["/usr/bin/scancel", str(jid)], env=c.env, capture_output=True, timeout=30, check=False)
    dtext = (job_dir / "daemon.log").read_text(errors="replace")
    lines = [ln for ln in dtext.splitlines() if "crash policy" in ln and f"job={jid}" in ln]
    print("\n".join(lines))
    assert [("failure=1" in ln, "failure=2" in ln, "giving up" in ln) for ln in lines] == [
        (True, False, False), (False, True, False), (False, False, True)], lines
    job = c.backend.get_job(jid, include_finished=True)
    assert job is not None and job.state == "FAILED" and job.restart_count == 2, job
    text = log.read_text()
    assert [f"training attempt {k}" in text for k in range(3)] == [True] * 3, text
    assert "training attempt 3" not in text
