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
    timeline_png: Path | None = None

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
        c = self.counts()
        lines.append(f"decisions: {c['start']} admissions ({c['batch_at_start']} at another batch than asked), "
                     f"{c['shrink']} shrinks, {c['grow']} grows, {c['batch']} batch changes on resize")
        lines.append(f"GPU utilization over the run: {100 * self.utilization:.0f}% "
                     f"({len(self.samples)} samples of sinfo-level GPU use)")
        if self.timeline_png:
            lines.append(f"timeline picture: {self.timeline_png}")
        return "\n".join(lines)

    def counts(self) -> dict[str, int]:
        """Done admissions, shrinks, grows, batch changes (a resize whose batch differs from the job's
        previous one) and admissions at another batch than the job asked for."""
        out = {"start": 0, "shrink": 0, "grow": 0, "batch": 0, "batch_at_start": 0}
        prev: dict[int, int | None] = {}
        for d in self.decisions:
            if d["status"] != "done" or d["action"] not in ("start", "resize"):
                continue
            jid = d["job_id"]
            if d["action"] == "start":
                out["start"] += 1
                job = next((j for j in self.jobs if j.job_id == jid), None)
                requested = _requested_batch(job.spec) if job else None
                if requested is not None and d["batch"] not in (None, requested):
                    out["batch_at_start"] += 1
            else:
                if d["gpus_to"] < d["gpus_from"]:
                    out["shrink"] += 1
                elif d["gpus_to"] > d["gpus_from"]:
                    out["grow"] += 1
                if prev.get(jid) is not None and d["batch"] not in (None, prev[jid]):
                    out["batch"] += 1
            prev[jid] = d["batch"]
        return out


def _requested_batch(comment: str) -> int | None:
    from slurm_elastic.spec import SpecError, parse_spec

    try:
        return parse_spec(comment).requested_batch
    except SpecError:
        return None


def _elastic_jobs(work: Path, python: str, step_delay: float) -> list[DemoJob]:
    """The unpaced scenario (the end-to-end test): the jobs run at the speed of this machine's CPUs."""
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


# The paced scenario (the demo): every job stands in for cifar10 on T4 nodes of 4 GPUs. Its steps take
# the time Pollux measured there (pace=cifar10, train/pacing.py), it names that profile (profile=cifar10)
# and reports no gradient noise scale of its own, so the daemon also takes the batch's statistical
# efficiency from cifar10's measured table: it plans as it would for cifar10 on T4s.
PACED_N_PER_CLASS = 4000  # the spiral set: 12,000 samples per epoch
PACED_ARRIVAL_S = 1  # B arrives this long after A and D have both trained a step
PACED_SPEC = "min_batch=128,max_batch=1024,max_local_batch=256,pace=cifar10,profile=cifar10"


def _paced_jobs() -> list[DemoJob]:
    """A and D fill the two nodes the non-elastic job leaves; B (2 GPUs, short) and C (1-4, longer)
    arrive once both train, so the daemon must shrink to admit them; when B is done its GPUs go to a job
    that can use them. Why C and not D grows back: the daemon grows a job only when the gain repays 8
    times its restart over the time the job has held its size (policies/_candidates.py); D's held time
    restarts at its shrink, and on 2 shared cores a restart takes 10-20 s, so D would need minutes at its
    new size; C, admitted small and never resized, needs only enough work left. Sizes in epochs of the
    spiral set (12,000 samples), for about 2.5 minutes of emulated cifar10 work once A and D train (C's grow needs about 80 s of work
    left at 1 GPU when B ends)."""
    common = ["--n-per-class", str(PACED_N_PER_CLASS), "--lr-scaling", "sqrt", "--checkpoint-every-s", "30",
              "--no-noise-scale"]
    return [
        DemoJob("A", f"elastic:min_gpus=2,max_gpus=4,{PACED_SPEC},batch=512", ["--epochs", "44", *common]),
        DemoJob("D", f"elastic:min_gpus=1,max_gpus=4,{PACED_SPEC},batch=512", ["--epochs", "13", *common]),
        DemoJob("B", f"elastic:min_gpus=2,max_gpus=2,{PACED_SPEC},batch=256", ["--epochs", "6", *common]),
        DemoJob("C", f"elastic:min_gpus=1,max_gpus=4,{PACED_SPEC},batch=256", ["--epochs", "16", *common]),
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


def write_daemon_config(path: Path, state_dir: Path, metrics_port: int, backend: str = "auto") -> None:
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
        timeout_s: float = 600, backend: str = "auto", paced: bool = False) -> DemoResult:
    """Run the scenario on ``cluster`` (a LocalCluster that is up) with the daemon on ``backend``.

    ``paced``: the demo's scenario on emulated T4 GPUs (see :data:`PACED_SPEC`); else the unpaced one,
    at the speed of this machine's CPUs (the end-to-end test)."""
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
    if paced:
        jobs = _paced_jobs()
    else:
        jobs = _elastic_jobs(work, python, step_delay)
    # Paced: A and D start together, B and C arrive once both train; unpaced: A starts, B and C arrive.
    first, later = (jobs[:2], jobs[2:]) if paced else (jobs[:1], jobs[1:])
    samples: list[tuple[float, int, int]] = []
    snapshots: list[str] = []
    plain = 0
    plain_span: tuple[float, float] | None = None
    last_show = 0.0

    def observe() -> dict:
        """One sample of GPU use (sinfo level) and of which jobs are gone; status every 10 s."""
        nonlocal last_show
        active = {j.job_id: j for j in cluster.backend.list_jobs()}
        nodes = cluster.backend.list_nodes()
        samples.append((time.time(), sum(n.gpus_used for n in nodes), sum(n.gpus_total for n in nodes)))
        for j in jobs:
            if j.job_id and j.finished is None and j.job_id not in active:
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
        if daemon.poll() is not None:
            raise RuntimeError(f"the daemon exited with {daemon.returncode}; see {work / 'daemon.log'}")
        return active

    try:
        # The non-elastic job: 8 GPUs on 2 nodes. Unpaced it ends after 75 s; paced it stands for another
        # user's long job and is cancelled when the elastic jobs are done.
        plain = cluster.sbatch(["--job-name=demo-plain", "-N", "2", "--gres=gpu:4", "-o", "/dev/null",
                                "--wrap", f"sleep {3600 if paced else 75}"], cwd=work)
        cluster.wait_job(plain, lambda j: j is not None and j.is_running, timeout=60)
        plain_start = time.time()
        for j in first:
            _sbatch(cluster, j, work, python)
        # Let the first jobs start and train a little at their first size before the others arrive.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(
                any((work / j.name / "samples").glob(f"samples.{j.job_id}.s0.r0.txt")) for j in first):
            observe()
            time.sleep(0.5)
        until = time.monotonic() + (PACED_ARRIVAL_S if paced else 5)
        while time.monotonic() < until:
            observe()
            time.sleep(1.0)
        for j in later:
            _sbatch(cluster, j, work, python)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            observe()
            if all(j.finished for j in jobs):
                break
            time.sleep(1.0)
        if paced and plain:
            subprocess.run(["/usr/bin/scancel", str(plain)], env=env, capture_output=True, timeout=30, check=False)
            plain_span = (plain_start, time.time())
        if daemon.poll() is None:
            time.sleep(3)  # one more daemon cycle: it logs the last jobs' end (the timeline reads it)
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
    result = DemoResult(jobs=jobs, plain_job=plain, decisions=decisions, utilization=used / total, samples=samples,
                        work_dir=work, daemon_log=(work / "daemon.log").read_text(errors="replace"),
                        status_snapshots=snapshots)
    try:
        result.timeline_png = write_timeline(result, work / "timeline.png", plain_span)
    except Exception as e:  # the picture must not hide the run's result; say why it is missing
        print(f"demo: no timeline picture: {e}", file=sys.stderr)
    return result


def write_timeline(result: DemoResult, path: Path, plain_span: tuple[float, float] | None) -> Path:
    """The run's timeline PNG from the daemon's decision log (as ``slurm-elastic report`` draws it), with
    the non-elastic job and the names of the demo's jobs."""
    from slurm_elastic.timeline import Span, build_timeline, draw_timeline

    end = max((j.finished for j in result.jobs if j.finished), default=None)
    tl = build_timeline(result.decisions, now=end)
    # the non-elastic job is cancelled once the elastic jobs are gone; the daemon logs their end a cycle later
    extra = [Span("plain", plain_span[0], max(plain_span[1], tl.t1), 8)] if plain_span else []
    names = {str(j.job_id): f"{j.name} (job {j.job_id})" for j in result.jobs}
    names["plain"] = "non-elastic job"
    total = result.samples[-1][2] if result.samples else None
    draw_timeline(tl, path, capacity=total, extra=extra, names=names,
                  title="slurm-elastic demo: GPUs per job", note=f"GPU utilization {100 * result.utilization:.0f}%")
    return path


def main(argv=None) -> int:
    from slurm_elastic.cluster import DEFAULT_STATE_DIR, LocalCluster

    ap = argparse.ArgumentParser(description="Run the slurm-elastic demo on the local cluster.")
    ap.add_argument("--state-dir", default=os.environ.get("SLURM_ELASTIC_CLUSTER_DIR", str(DEFAULT_STATE_DIR)))
    ap.add_argument("--work-dir", default=None)
    ap.add_argument("--json", default=None, help="also write the summary as JSON here")
    ap.add_argument("--png", default=None, help="also copy the timeline picture here")
    ap.add_argument("--unpaced", action="store_true",
                    help="the jobs run at this machine's CPU speed instead of emulated T4 GPUs (pace=cifar10)")
    args = ap.parse_args(argv)
    cluster = LocalCluster(args.state_dir)
    if not cluster.is_up():
        print(f"no local cluster is up in {args.state_dir}: run 'slurm-elastic cluster up' first", file=sys.stderr)
        return 1
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="slurm-elastic-demo-"))
    print(f"demo: jobs and logs in {work}; the daemon logs to {work / 'daemon.log'}", flush=True)
    result = run(cluster, work, live=True, paced=not args.unpaced)
    print("\n== decision log")
    for d in result.decisions:
        if d["action"] == "end":
            continue
        print(f"  job {d['job_id']:>4} {d['action']:<7} {d['status']:<6} {d['gpus_from'] or '-'} -> "
              f"{d['gpus_to'] if d['gpus_to'] is not None else '-'} GPUs batch {d['batch'] or '-'}: {d['reason']}")
    print("\n== summary")
    if args.png and result.timeline_png:
        import shutil

        shutil.copyfile(result.timeline_png, args.png)
        result.timeline_png = Path(args.png)
    print(result.summary())
    if args.json:
        Path(args.json).write_text(json.dumps({
            "jobs": [{"name": j.name, "job_id": j.job_id, "state": j.state,
                      "jct_s": (j.finished - j.submitted) if j.finished else None,
                      "rescales": result.rescales(j.job_id)} for j in result.jobs],
            "decisions": result.counts(), "gpu_utilization": result.utilization,
            "timeline_png": str(result.timeline_png) if result.timeline_png else None}, indent=2))
    return 0 if all(j.state == "COMPLETED" for j in result.jobs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
