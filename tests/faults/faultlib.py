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
# A job step that reports its first step and acknowledges the daemon's stop as the in-job library does
# (throughput.json ``starts`` for this restart: the planner's stability guard resizes no job before its
# first step at its size, for 4 x its restart cost, 60..900 s, planner.settle_s; then
# stop-ack.<job>.<restart>.json in its ckpt dir on USR2, and exit), so the daemon can resize it; $1 is the
# ckpt dir as the job sees it.
ACKING = """#!/bin/bash
srun --ntasks=1 bash -c '
r=${SLURM_RESTART_COUNT:-0}; t="$0/throughput.json.tmp"
printf "{\\"format\\": 1, \\"starts\\": [{\\"restart_count\\": %s, \\"first_step\\": %s}]}" "$r" "$(date +%s)" > "$t" && mv "$t" "$0/throughput.json"
ack() { r=${SLURM_RESTART_COUNT:-0}; f="$0/stop-ack.$SLURM_JOB_ID.$r.json";
        printf "{\\"job_id\\": \\"%s\\", \\"restart_count\\": %s}" "$SLURM_JOB_ID" "$r" > "$f.tmp" && mv "$f.tmp" "$f"; exit 0; }
trap ack USR2; while :; do sleep 1; done' "$1"
sleep 30
"""


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


# useradd/userdel exit codes that mean another process held /etc/passwd or /etc/group (1: cannot lock or
# update the password file, 10: the group file); another xdist worker (or another checkout's run) may be
# adding or removing its own test users at the same moment.
_LOCKED = (1, 10)


def _shadow_tool(argv, retry_rc=_LOCKED, tries=30) -> subprocess.CompletedProcess:
    """useradd/groupadd/userdel/groupdel, retried while it fails for a reason that passes (lock contention)."""
    for _ in range(tries):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        if r.returncode not in retry_rc:
            return r
        time.sleep(1)
    return r


def _stale_group(name: str):
    """The group ``name`` if it exists with no members and is no user's primary group (a test user's group
    that userdel left behind), else None."""
    import grp
    import pwd

    try:
        g = grp.getgrnam(name)
    except KeyError:
        return None
    if g.gr_mem or any(p.pw_gid == g.gr_gid for p in pwd.getpwall()):
        return None
    return g


@contextlib.contextmanager
def _name_lock(names):
    """One holder at a time per test user name on this machine: a second run of the same test (another
    checkout's, another xdist worker's) waits instead of having the users deleted under its jobs."""
    import fcntl

    fds = []
    try:
        for u in sorted(set(names)):
            fd = os.open(f"/run/lock/slurm-elastic-test-user.{u}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            fds.append(fd)
            deadline = time.monotonic() + 1800
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"test user {u} is still in use by another test run after 30 min") from None
                    time.sleep(1)
        yield
    finally:
        for fd in fds:
            os.close(fd)


def _useradd(u: str) -> bool:
    """Make the system user ``u``; False when it exists already (made by someone else meanwhile). A
    leftover group of the same name (no members, no user's primary group) becomes its primary group."""
    import pwd

    argv = ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin"]
    if _stale_group(u) is not None:
        argv += ["--gid", u]
    r = _shadow_tool([*argv, u])
    if r.returncode == 9:  # name in use: made meanwhile, or its group appeared meanwhile
        try:
            pwd.getpwnam(u)
            return False
        except KeyError:
            if _stale_group(u) is not None and "--gid" not in argv:
                r = _shadow_tool([*argv, "--gid", u, u])
    if r.returncode != 0:
        raise RuntimeError(f"useradd {u} failed (exit {r.returncode}): {r.stderr.strip() or r.stdout.strip()}")
    return True


def _userdel(u: str) -> None:
    """Remove the test user ``u`` (retried for a while: its cancelled jobs may still be ending) and its
    group if userdel left it behind unused."""
    _shadow_tool(["userdel", u], retry_rc=(1, 8, 10))  # 8: the user still has processes
    if _stale_group(u) is not None:
        _shadow_tool(["groupdel", u])


@contextlib.contextmanager
def unix_users(names):
    """Unprivileged test users (useradd --system), created if missing and removed afterwards (only those
    created here, also when a later one cannot be made). Held under a per-name lock for the duration."""
    import pwd

    with _name_lock(names):
        created = []
        try:
            for u in names:
                try:
                    pwd.getpwnam(u)
                except KeyError:
                    if _useradd(u):
                        created.append(u)
            yield {u: pwd.getpwnam(u) for u in names}
        finally:
            for u in created:
                _userdel(u)
