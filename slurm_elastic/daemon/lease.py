"""One daemon per cluster, checked through Slurm itself: the lease.

The state directory's flock (state.py) stops a second daemon on the same state dir only; one with
another state dir, or on another host, would act on the same jobs. So every daemon keeps a *lease* in
Slurm: a held placeholder job (``slurm-elastic-lease``, ``--hold``, never runs) whose AdminComment says
``elastic-lease:key=K,host=H,pid=P,ts=T,ttl=S``. Only root, SlurmUser and operators can write an
AdminComment, so no user can forge or renew one. Each cycle the daemon renews its own lease (``ts``)
and reads the others from the cycle's one ``squeue`` read. The oldest live lease (lowest job id) holds
the cluster; every other daemon refuses to act (no start, resize, hold or release) and says so each
cycle, naming the other's lease job, host and pid, until that lease goes stale: not renewed within its
``ttl``, or its pid gone on this same host (a SIGKILLed daemon is noticed at once). ``key`` hashes the
host and the state dir, so a restarted daemon adopts its own lease. Nothing needs a Slurm restart; the
placeholder is cancelled when the daemon stops cleanly. ``lease_ttl_s = 0`` turns this off.
"""

from __future__ import annotations

import hashlib
import os
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from slurm_elastic.backends.base import JobRecord, SlurmBackend, SlurmError

LEASE_PREFIX = "elastic-lease:"
LEASE_NAME = "slurm-elastic-lease"


@dataclass(frozen=True)
class LeaseInfo:
    job_id: int
    key: str
    host: str
    pid: int
    ts: float
    ttl: float


def format_lease(key: str, host: str, pid: int, ts: float, ttl: float) -> str:
    return f"{LEASE_PREFIX}key={key},host={host},pid={pid},ts={ts:.0f},ttl={ttl:.0f}"


def parse_lease(job: JobRecord) -> LeaseInfo | None:
    """The lease in a job's AdminComment, or None (not a lease, or unreadable: then it is ignored)."""
    text = job.admin_comment or ""
    if not text.startswith(LEASE_PREFIX) or len(text) > 512:
        return None
    kv = dict(item.partition("=")[::2] for item in text[len(LEASE_PREFIX):].split(","))
    try:
        return LeaseInfo(job.job_id, kv["key"], kv["host"], int(kv["pid"]), float(kv["ts"]), float(kv["ttl"]))
    except (KeyError, ValueError):
        return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class Lease:
    """This daemon's lease; :meth:`check` each cycle says whether it may act."""

    def __init__(self, backend: SlurmBackend, state_dir: str, ttl_s: float, partition: str | None = None, *,
                 clock: Callable[[], float] = time.time, host: str | None = None, pid: int | None = None,
                 pid_alive: Callable[[int], bool] = _pid_alive):
        self.backend = backend
        self.ttl = ttl_s
        self.partition = partition
        self.clock = clock
        self.host = host or socket.gethostname()
        self.pid = pid if pid is not None else os.getpid()
        self.key = hashlib.sha1(f"{self.host}\0{os.path.realpath(state_dir)}".encode()).hexdigest()[:16]
        self.pid_alive = pid_alive
        self.job_id: int | None = None
        self.unsupported = False

    def live(self, lease: LeaseInfo, now: float) -> bool:
        if now - lease.ts > lease.ttl:
            return False
        return not (lease.host == self.host and not self.pid_alive(lease.pid))

    def others(self, records: Iterable[JobRecord]) -> list[LeaseInfo]:
        """Live leases of other daemons, oldest first."""
        now = self.clock()
        found = [lease for r in records if r.is_active and (lease := parse_lease(r)) is not None]
        return sorted((x for x in found if x.key != self.key and self.live(x, now)), key=lambda x: x.job_id)

    def check(self, records: list[JobRecord], *, write: bool = True) -> str | None:
        """Renew (or take) this daemon's lease; None when it may act, else why not (naming the other).
        Raises SlurmError when the lease cannot be written (the caller then does not act either)."""
        if self.unsupported:
            return None
        if write:
            mine = sorted(r.job_id for r in records if r.is_active and (x := parse_lease(r)) and x.key == self.key)
            text = format_lease(self.key, self.host, self.pid, self.clock(), self.ttl)
            if self.job_id is None and mine:
                self.job_id = mine[0]  # a restarted daemon adopts its own lease
            for extra in mine:
                if extra != self.job_id:
                    self.backend.cancel_lease(extra)
            try:
                if self.job_id is None or self.job_id not in mine:
                    self.job_id = self.backend.submit_lease(LEASE_NAME, self.partition, text)
                else:
                    self.backend.update_job(self.job_id, admin_comment=text)
            except NotImplementedError:
                self.unsupported = True
                return None
        others = self.others(records)
        if others and (self.job_id is None or others[0].job_id < self.job_id):
            o = others[0]
            return (f"another slurm-elastic daemon holds this cluster: lease job {o.job_id} (host {o.host}, pid "
                    f"{o.pid}, renewed {max(0.0, self.clock() - o.ts):.0f} s ago); this daemon does not act until "
                    f"that lease is released or goes stale (ttl {o.ttl:.0f} s)")
        return None

    def release(self) -> None:
        if self.job_id is not None and not self.unsupported:
            try:
                self.backend.cancel_lease(self.job_id)
            except SlurmError:
                pass
            self.job_id = None
