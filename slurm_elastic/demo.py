"""The end-to-end demo: elastic DDP jobs and a non-elastic job share a local Slurm, under the daemon.

Scenario (16 GPUs: 4 nodes x 4):

1. a non-elastic job takes 2 nodes x 4 GPUs for a while;
2. elastic job A (1-8 GPUs) arrives alone: the daemon admits it on the 8 free GPUs;
3. elastic jobs B and C (2-4 GPUs each) arrive: the daemon shrinks A to admit them;
4. the non-elastic job, then B and C finish: the daemon grows A again; everything completes.

Every elastic job is the real template (``sbatch_templates/elastic_ddp.sbatch``) running the spiral
example with torch DDP (gloo) on CPU, held at submit (``--hold``, as the submit plugin would) until the
daemon places it. ``python -m slurm_elastic.demo`` runs it on the local cluster and prints a summary;
the end-to-end test runs the same scenario and checks it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TEMPLATE = REPO / "sbatch_templates" / "elastic_ddp.sbatch"
EXAMPLE = REPO / "examples" / "train_elastic_spiral.py"


@dataclass
class DemoJob:
    name: str
    spec: str
    args: list[str]
    job_id: int = 0
    submitted: float = 0.0
    finished: float | None = None
    state: str = ""


@dataclass
class DemoResult:
    jobs: list[DemoJob]
    plain_job: int
    decisions: list[dict]
    utilization: float
    samples: list[tuple[float, int, int]] = field(default_factory=list)  # (t, gpus used, gpus total)
    work_dir: Path | None = None
    daemon_log: str = ""
    status_snapshots: list[str] = field(default_factory=list)

    def rescales(self, job_id: int) -> int:
        return sum(1 for d in self.decisions if d["job_id"] == job_id and d["action"] == "resize" and d["status"] == "done")

    def summary(self) -> str:
        lines = [f"{'JOB':<4} {'JOBID':>6} {'STATE':<10} {'JCT(s)':>7} {'RESCALES':>8}  GPUS OVER TIME"]
        for j in self.jobs:
            jct = f"{j.finished - j.submitted:.0f}" if j.finished else "-"
            sizes = [str(d["gpus_to"]) for d in self.decisions if d["job_id"] == j.job_id and d["status"] == "done"
                     and d["action"] in ("start", "resize")]
            lines.append(f"{j.name:<4} {j.job_id:>6} {j.state:<10} {jct:>7} {self.rescales(j.job_id):>8}  "
                         f"{' -> '.join(sizes)}")
        lines.append(f"GPU utilization over the run: {100 * self.utilization:.0f}% "
                     f"({len(self.samples)} samples of sinfo-level GPU use)")
        return "\n".join(lines)


def _elastic_jobs(work: Path, python: str, step_delay: float) -> list[DemoJob]:
    base = "min_batch=32,max_batch=512,max_local_batch=32"
    common = ["--n-per-class", "400", "--lr-scaling", "sqrt", "--step-delay", str(step_delay),
              "--checkpoint-every-s", "20"]
    return [
        # A trains through a torch DataLoader (2 workers, mean loss: job.batches), B and C with job.steps().
        # A declares it trains well at batch 256: until a job reports its noise scale, the goodput
        # objective never raises a batch above the requested one (profiles/goodput.py, conservative),
        # and at batch 64 eight GPUs over two nodes would be slower than four.
        DemoJob("A", f"elastic:min_gpus=1,max_gpus=8,{base},batch=256", ["--epochs", "30", "--loader-workers", "2", *common]),
        DemoJob("B", f"elastic:min_gpus=2,max_gpus=4,{base},batch=64", ["--epochs", "6", *common]),
        DemoJob("C", f"elastic:min_gpus=2,max_gpus=4,{base},batch=64", ["--epochs", "6", *common]),
    ]


def _sbatch(cluster, job: DemoJob, work: Path, python: str) -> int:
    export = ",".join(["ALL", f"ELASTIC_PYTHON={python}", f"ELASTIC_TRAIN_SCRIPT={EXAMPLE}", "OMP_NUM_THREADS=1",
                       "ELASTIC_REQUEUE_WAIT=120"])
    jdir = work / job.name
    jdir.mkdir(parents=True, exist_ok=True)
    job.job_id = cluster.sbatch(
        [f"--export={export}", "--hold", f"--job-name=demo-{job.name}", "-o", str(jdir / "job.out"),
         f"--comment={job.spec}", "--nodes=1", "--gres=gpu:1", str(TEMPLATE), *job.args,
         "--record-samples", str(jdir / "samples")], cwd=jdir)
    job.submitted = time.time()
    return job.job_id


def write_daemon_config(path: Path, state_dir: Path, metrics_port: int, backend: str = "cli") -> None:
    path.write_text("\n".join([
        f'backend = "{backend}"',
        f'state_dir = "{state_dir}"',
        "poll_interval_s = 2",
        "cooldown_s = 8",
        "ack_timeout_s = 90",
        "restart_cost_s = 5",
        "horizon_s = 600",
        "max_in_flight = 4",
        f"metrics_port = {metrics_port}",
        'log_level = "info"',
    ]) + "\n")


def run(cluster, work: Path, *, python: str = sys.executable, step_delay: float = 0.15, live: bool = False,
        timeout_s: float = 600, backend: str = "cli") -> DemoResult:
    """Run the scenario on ``cluster`` (a LocalCluster that is up) with the daemon on ``backend``."""
    from slurm_elastic.cluster import find_free_port_block
    from slurm_elastic.daemon.state import StateDB

    work.mkdir(parents=True, exist_ok=True)
    os.chmod(work, 0o755)
    state_dir = work / "daemon-state"
    cfg = work / "elastic.toml"
    write_daemon_config(cfg, state_dir, find_free_port_block(1, start=29000), backend)
    daemon_log = open(work / "daemon.log", "wb")
    env = dict(cluster.env)
    daemon = subprocess.Popen([python, "-m", "slurm_elastic.cli", "daemon", "--config", str(cfg)], env=env,
                              stdout=daemon_log, stderr=subprocess.STDOUT, start_new_session=True)
    jobs = _elastic_jobs(work, python, step_delay)
    samples: list[tuple[float, int, int]] = []
    snapshots: list[str] = []
    plain = 0
    try:
        plain = cluster.sbatch(["--job-name=demo-plain", "-N", "2", "--gres=gpu:4", "-o", "/dev/null",
                                "--wrap", "sleep 75"], cwd=work)
        cluster.wait_job(plain, lambda j: j is not None and j.is_running, timeout=60)
        a, b, c = jobs
        _sbatch(cluster, a, work, python)
        # Let A start and train a little at its first size before the others arrive.
        cluster.wait_job(a.job_id, lambda j: j is not None and j.is_running, timeout=60)
        first = work / "A" / "samples"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any(first.glob(f"samples.{a.job_id}.s0.r0.txt")):
            time.sleep(0.5)
        time.sleep(5)
        _sbatch(cluster, b, work, python)
        _sbatch(cluster, c, work, python)
        deadline = time.monotonic() + timeout_s
        last_show = 0.0
        while time.monotonic() < deadline:
            active = {j.job_id: j for j in cluster.backend.list_jobs()}
            nodes = cluster.backend.list_nodes()
            samples.append((time.time(), sum(n.gpus_used for n in nodes), sum(n.gpus_total for n in nodes)))
            for j in jobs:
                if j.finished is None and j.job_id not in active:
                    j.finished = time.time()
            if time.monotonic() - last_show > 10:
                out = subprocess.run([python, "-m", "slurm_elastic.cli", "status", "--state-dir", str(state_dir)],
                                     env=env, capture_output=True, text=True, timeout=60, check=False).stdout
                snapshots.append(out)
                with open(work / "status.log", "a") as f:  # what status said, kept for a post-mortem
                    f.write(f"== {time.strftime('%H:%M:%S')}\n{out}\n")
                if live:
                    print(time.strftime("%H:%M:%S"), "slurm-elastic status", flush=True)
                    print(out, flush=True)
                last_show = time.monotonic()
            if all(j.finished for j in jobs):
                break
            if daemon.poll() is not None:
                raise RuntimeError(f"the daemon exited with {daemon.returncode}; see {work / 'daemon.log'}")
            time.sleep(1.0)
    finally:
        if daemon.poll() is None:
            os.kill(daemon.pid, signal.SIGTERM)
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(daemon.pid, signal.SIGKILL)
                daemon.wait()
        daemon_log.close()
        leftovers = [str(j.job_id) for j in jobs if j.job_id and not j.finished] + ([str(plain)] if plain else [])
        if leftovers:
            subprocess.run(["/usr/bin/scancel", *leftovers], env=env, capture_output=True, timeout=30, check=False)
    for j in jobs:
        rec = cluster.backend.get_job(j.job_id, include_finished=True)
        j.state = rec.state if rec else "gone"
    db = StateDB(state_dir, readonly=True)
    decisions = db.decisions()
    db.close()
    used = sum(s[1] for s in samples)
    total = sum(s[2] for s in samples) or 1
    return DemoResult(jobs=jobs, plain_job=plain, decisions=decisions, utilization=used / total, samples=samples,
                      work_dir=work, daemon_log=(work / "daemon.log").read_text(errors="replace"),
                      status_snapshots=snapshots)


def main(argv=None) -> int:
    from slurm_elastic.cluster import DEFAULT_STATE_DIR, LocalCluster

    ap = argparse.ArgumentParser(description="Run the slurm-elastic demo on the local cluster.")
    ap.add_argument("--state-dir", default=os.environ.get("SLURM_ELASTIC_CLUSTER_DIR", str(DEFAULT_STATE_DIR)))
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--json", default=None, help="also write the summary as JSON here")
    args = ap.parse_args(argv)
    cluster = LocalCluster(args.state_dir)
    if not cluster.is_up():
        print(f"no local cluster is up in {args.state_dir}: run 'slurm-elastic cluster up' first", file=sys.stderr)
        return 1
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="slurm-elastic-demo-"))
    print(f"demo: jobs and logs in {work}; the daemon logs to {work / 'daemon.log'}", flush=True)
    result = run(cluster, work, live=True)
    print("\n== decision log")
    for d in result.decisions:
        print(f"  job {d['job_id']:>4} {d['action']:<7} {d['status']:<6} {d['gpus_from'] or '-'} -> "
              f"{d['gpus_to'] if d['gpus_to'] is not None else '-'} GPUs batch {d['batch'] or '-'}: {d['reason']}")
    print("\n== summary")
    print(result.summary())
    if args.json:
        Path(args.json).write_text(json.dumps({
            "jobs": [{"name": j.name, "job_id": j.job_id, "state": j.state,
                      "jct_s": (j.finished - j.submitted) if j.finished else None,
                      "rescales": result.rescales(j.job_id)} for j in result.jobs],
            "gpu_utilization": result.utilization}, indent=2))
    return 0 if all(j.state == "COMPLETED" for j in result.jobs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
