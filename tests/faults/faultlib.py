"""Helpers for the fault suite: daemon processes, template jobs, exactly-once checks, cleanup."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "sbatch_templates" / "elastic_ddp.sbatch"
EXAMPLE = REPO / "examples" / "train_elastic_spiral.py"
DRIVER = Path(__file__).resolve().parent / "fault_daemon.py"
SPEC = "elastic:min_gpus=1,max_gpus=4,min_batch=32,max_batch=512,max_local_batch=32,batch=64"


def write_config(path: Path, state_dir: Path, **over) -> Path:
    values = {"state_dir": str(state_dir), "poll_interval_s": 2, "cooldown_s": 0, "ack_timeout_s": 90,
              "restart_cost_s": 5, "horizon_s": 600, "max_in_flight": 4, "metrics_address": "",
              "log_level": "info"}
    values.update(over)
    lines = []
    for k, v in values.items():
        if isinstance(v, bool):
            lines.append(f"{k} = {'true' if v else 'false'}")
        elif isinstance(v, (int, float)):
            lines.append(f"{k} = {v}")
        elif isinstance(v, (list, tuple)):
            lines.append(f"{k} = [{', '.join(repr(str(x)).replace(chr(39), chr(34)) for x in v)}]")
        else:
            lines.append(f'{k} = "{v}"')
    path.write_text("\n".join(lines) + "\n")
    return path


class DaemonProc:
    """One daemon process (the product CLI, or the fault driver), its log in a file; stopped by its pid."""

    def __init__(self, cluster, argv: list[str], log: Path):
        self.log_path = log
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(argv, env=cluster.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=str(REPO))

    @classmethod
    def cli(cls, cluster, config: Path, log: Path, *extra: str) -> DaemonProc:
        return cls(cluster, [sys.executable, "-m", "slurm_elastic.cli", "daemon", "--config", str(config), *extra], log)

    @classmethod
    def faulty(cls, cluster, config: Path, log: Path, step: str, job: int, marker: Path) -> DaemonProc:
        return cls(cluster, [sys.executable, str(DRIVER), "--config", str(config), "--fault", step, "--job", str(job),
                             "--marker", str(marker)], log)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self._log.close() if self.proc.returncode is not None else None

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()
        return self.proc.returncode

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")


def submit_template_job(cluster, work: Path, name: str, *, spec: str = SPEC, epochs: int = 8, step_delay: float = 0.1,
                        n_per_class: int = 400, hold: bool = True, extra_sbatch=(), requeue_wait: int = 120) -> int:
    """The real template (torch DDP spiral) submitted held, as the submit plugin would hold it."""
    jdir = work / name
    jdir.mkdir(parents=True, exist_ok=True)
    os.chmod(jdir, 0o755)
    export = ",".join(["ALL", f"ELASTIC_PYTHON={sys.executable}", f"ELASTIC_TRAIN_SCRIPT={EXAMPLE}",
                       "OMP_NUM_THREADS=1", f"ELASTIC_REQUEUE_WAIT={requeue_wait}"])
    argv = [f"--export={export}", f"--job-name=fault-{name}", "-o", str(jdir / "job.out"), f"--comment={spec}",
            "--nodes=1", "--gres=gpu:1", *extra_sbatch]
    if hold:
        argv.append("--hold")
    argv += [str(TEMPLATE), "--epochs", str(epochs), "--n-per-class", str(n_per_class), "--step-delay",
             str(step_delay), "--checkpoint-every-s", "10", "--record-samples", str(jdir / "samples")]
    return cluster.sbatch(argv, cwd=jdir)


def samples_seen(job_dir: Path, job_id: int) -> dict[int, Counter]:
    """epoch -> Counter of sample indices over every start and rank of the job."""
    per_epoch: dict[int, Counter] = {}
    for f in sorted((job_dir / "samples").glob(f"samples.{job_id}.s*.r*.txt")):
        for line in f.read_text().splitlines():
            e, _step, idx = (line.split(" ", 2) + [""])[:3]
            per_epoch.setdefault(int(e), Counter()).update(int(i) for i in idx.split(",") if i)
    return per_epoch


def assert_exactly_once(job_dir: Path, job_id: int, epochs: int, n: int) -> None:
    seen = samples_seen(job_dir, job_id)
    assert sorted(seen) == list(range(epochs)), f"job {job_id}: epochs seen {sorted(seen)}"
    for e, counts in seen.items():
        missing = set(range(n)) - set(counts)
        twice = [i for i, c in counts.items() if c > 1]
        assert not missing and not twice and sorted(counts) == list(range(n)), \
            f"job {job_id} epoch {e}: {len(missing)} samples missing, {len(twice)} seen twice"


def wait_for(pred, timeout: float, what: str, poll: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def scancel(cluster, ids) -> None:
    ids = [str(i) for i in ids if i]
    for k in range(0, len(ids), 500):
        cluster.run_tool("scancel", *ids[k:k + 500], timeout=120)


def jobs_by_id(cluster, ids, include_finished=True) -> dict:
    want = {int(i) for i in ids}
    return {j.job_id: j for j in cluster.backend.list_jobs(include_finished=include_finished) if j.job_id in want}


@contextlib.contextmanager
def unix_users(names):
    """Unprivileged test users (useradd --system), created if missing and removed afterwards (only those
    created here). userdel is retried for a while: the users' cancelled jobs may still be ending."""
    import pwd

    created = []
    for u in names:
        try:
            pwd.getpwnam(u)
        except KeyError:
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", u],
                           check=True, capture_output=True, timeout=30)
            created.append(u)
    try:
        yield {u: pwd.getpwnam(u) for u in names}
    finally:
        for u in created:
            for _ in range(30):
                if subprocess.run(["userdel", u], capture_output=True, timeout=30, check=False).returncode in (0, 6):
                    break
                time.sleep(1)
