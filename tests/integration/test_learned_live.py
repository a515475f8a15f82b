"""Learned job models live: a real torch DDP job (template + spiral example) under the daemon on the
local Slurm cluster. Checks, from what the job wrote and the daemon did (no mocks):

- the job measures its gradient noise scale (2 gloo ranks) and reports it in its report file;
- the daemon's model for it says ``fitted from N reports`` after its first throughput report, and
  the status view carries that provenance and the noise scale;
- a job is never resized before it has reported a step at its admitted size: B arrives right after A's
  admission and the policy would shrink A to make room, but the planner leaves A alone (stability
  guard) until A has reported its first step;
- then the shrink happens, and A's restart cost is measured (daemon: signal -> first step after the
  restart; job: stop -> first step), written to the decision log and used as A's restart_s.

Lean: plain filler jobs leave 2 free GPUs, so A runs 2 ranks and B one; both are cancelled at the end.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from slurm_elastic.daemon.config import load_config  # noqa: E402
from slurm_elastic.daemon.loop import Daemon  # noqa: E402
from slurm_elastic.demo import TEMPLATE, write_daemon_config  # noqa: E402
from slurm_elastic.train.protocol import read_report, read_throughput  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.torch, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "train_elastic_spiral.py"
BASE = "min_batch=32,max_batch=256,max_local_batch=32,batch=64"


def _submit(cluster, work: Path, name: str, spec: str, python: str) -> int:
    import sys

    jdir = work / name
    jdir.mkdir(parents=True, exist_ok=True)
    export = ",".join(["ALL", f"ELASTIC_PYTHON={python or sys.executable}", f"ELASTIC_TRAIN_SCRIPT={EXAMPLE}",
                       "OMP_NUM_THREADS=1", "ELASTIC_REQUEUE_WAIT=60"])
    return cluster.sbatch([f"--export={export}", "--hold", f"--job-name=learn-{name}", "-o", str(jdir / "job.out"),
                           f"--comment={spec}", "--nodes=1", "--gres=gpu:1", str(TEMPLATE), "--epochs", "40",
                           "--n-per-class", "400", "--lr-scaling", "adascale", "--step-delay", "0.05",
                           "--checkpoint-every-s", "600"], cwd=jdir)


def test_noise_scale_is_reported_the_model_is_fitted_and_no_resize_before_a_first_step(slurm_cluster, tmp_path):
    import sys

    c = slurm_cluster
    work = tmp_path / "learn"
    work.mkdir()
    work.chmod(0o755)
    ids: list[int] = []
    cfg_path = work / "elastic.toml"
    write_daemon_config(cfg_path, work / "state", 9788)
    cfg_path.write_text(cfg_path.read_text().replace("cooldown_s = 8", "cooldown_s = 2")
                        + 'metrics_address = ""\nweight_grants = {"*" = 4}\n')  # B's weight=4 counts
    d = Daemon(load_config(cfg_path), backend=c.backend)
    d.open()
    d.models.claims.PROBATION_S = 0.0  # the claim counts as soon as its throughput is verified (no 60 s wait)
    try:
        # Leave exactly 2 free GPUs: 3 whole nodes + 2 GPUs of the fourth.
        ids.append(c.sbatch(["--job-name=learn-fill4", "-N", "3", "--gres=gpu:4", "-o", "/dev/null", "--wrap",
                             "sleep 600"], cwd=work))
        ids.append(c.sbatch(["--job-name=learn-fill2", "-N", "1", "--gres=gpu:2", "-o", "/dev/null", "--wrap",
                             "sleep 600"], cwd=work))
        for j in ids:
            c.wait_job(j, lambda r: r is not None and r.is_running, timeout=90)
        a = _submit(c, work, "A", f"elastic:min_gpus=1,max_gpus=2,{BASE}", sys.executable)
        ids.append(a)
        admitted = None
        for _ in range(30):
            res = d.cycle()
            starts = [x for x in (res.plan.actions if res else ()) if x.kind == "start" and x.job_id == a]
            if starts:
                admitted = starts[0]
                break
            time.sleep(1)
        assert admitted is not None and admitted.gpus == 2, d.db.decisions(a)
        # B weighs more than A: the policy wants one of A's GPUs for it at once.
        b = _submit(c, work, "B", f"elastic:min_gpus=1,max_gpus=1,weight=4,{BASE}", sys.executable)
        ids.append(b)
        ckpt = work / "A" / "elastic-ckpt" / str(a)
        guarded = 0
        fitted = None
        deadline = time.monotonic() + 420
        while time.monotonic() < deadline:
            res = d.cycle()
            assert res is not None
            # Read after the cycle: a job that had not stepped by then had not stepped during it (read
            # before, a first step between the read and the daemon's own read looked like a breach).
            stepped_before = any(s["restart_count"] == 0 for s in read_report(ckpt)["starts"])
            act = {x.job_id: x for x in res.plan.actions}.get(a)
            if not stepped_before:
                # Not yet a step at its admitted size: A must not be resized in this cycle.
                assert act is None or act.kind == "leave", (act, d.db.decisions(a))
                guarded += act is not None and "no step reported" in act.reason
            src = d.models.sources.get(a, "")
            # The progress claim counts only once its throughput is verified, which can be a cycle or two
            # after the fit: wait for both (breaking at the fit alone raced the claim's verification).
            info = d.models.progress.get(a)
            if (src.startswith("fitted") and read_report(ckpt)["noise_scale"] is not None
                    and info is not None and info.remaining_samples is not None):
                fitted = src
                break
            time.sleep(2)
        report = read_report(ckpt)
        assert fitted, (d.models.sources.get(a), report, (work / "A" / "job.out").read_text()[-3000:])
        print(f"job {a}: {fitted}; noise scale {report['noise_scale']:.1f} samples, base batch "
              f"{report['base_batch']}; points {read_throughput(ckpt)}; cycles held by the stability guard: "
              f"{guarded}")
        assert report["noise_scale"] > 0 and report["base_batch"] == 64
        assert guarded >= 1  # the policy did ask to shrink A before its first step, and was refused
        assert read_throughput(ckpt) and report["starts"][0]["restart_count"] == 0
        # The job reports its progress and the daemon ranks it by the work it has left: 40 epochs of the
        # spiral's 1200 samples (3 arms x 400) planned; attained service from what Slurm showed, not the job
        assert report["total_samples"] == 40 * 1200 and 0 < report["samples_seen"] < 40 * 1200, report
        info = d.models.progress[a]
        claim = d.models.claims.jobs[a]  # done counts from the job's first report (slurm_elastic.claims)
        assert claim.total == 40 * 1200 and claim.seen is not None and not claim.false, claim
        assert info.remaining_samples == claim.total - (claim.seen - claim.seen0), (info, claim, d.models.sources[a])
        assert info.attained_gpu_s > 0, info
        view = d.db.job_views()[a]
        assert view["model"].startswith("fitted from") and view["noise_scale"] > 0  # the report moves on
        # The policy wanted A's GPUs for B while A had not stepped: the guard is what kept A.
        log = d.db.decisions(a)
        assert not [x for x in log if x["action"] == "resize" and x["ts"] < report["starts"][0]["first_step"]], log

        # Once A has stepped, the shrink for B goes ahead; A's restart cost is then measured (the daemon's
        # signal -> A's first step after the restart, and the job's own stop -> first step) and logged.
        measured = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not measured:
            d.cycle()
            measured = [x for x in d.db.decisions(a) if x["action"] == "measure"]
            time.sleep(2)
        log = d.db.decisions(a)
        assert measured, (log, (work / "A" / "job.out").read_text()[-3000:])
        print("decision log:", [(x["action"], x["status"], x["gpus_from"], x["gpus_to"], x["message"]) for x in log])
        resize = [x for x in log if x["action"] == "resize" and x["status"] == "done"]
        assert resize and resize[0]["gpus_to"] == 1
        starts = read_report(ckpt)["starts"]
        assert [s["restart_count"] for s in starts] == [0, 1] and starts[1]["stop"] is not None
        cost = d.models.restart_cost(a)
        assert cost is not None and 0 < cost < 600 and "signal->first step (daemon)" in measured[0]["message"]
        d.cycle()  # the measured figure, not the configured restart_cost_s, is what the policy plans with
        assert d.db.job_views()[a]["restart_s"] == pytest.approx(cost)
        print(f"job {a}: restart cost {cost:.1f} s measured (configured default 5 s)")
    finally:
        d.close()
        for j in ids:
            subprocess.run(["/usr/bin/scancel", str(j)], env=c.env, capture_output=True, timeout=30, check=False)
        for j in ids:
            c.wait_job(j, lambda r: r is None or not r.is_active, timeout=60)
