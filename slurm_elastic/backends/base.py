"""The Slurm backend interface: typed job/node records and the actions the daemon takes.

Everything above ``backends/`` sees only these records, never a Slurm JSON dialect. Three
implementations share the interface: the CLI backend (``squeue --json`` + ``scontrol``), the
simulator's in-memory cluster, and later pyslurm.
"""

from __future__ import annotations

import abc
import time
from collections.abc import Sequence
from dataclasses import dataclass

# Base job states (Slurm's JOB_STATE_BASE names). Flags (REQUEUED, COMPLETING, ...) go to `state_flags`.
PENDING = "PENDING"
RUNNING = "RUNNING"
SUSPENDED = "SUSPENDED"
COMPLETING = "COMPLETING"  # 22.05 prints only this flag while a job's processes end (it still holds its GPUs)
ACTIVE_STATES = frozenset({PENDING, RUNNING, SUSPENDED, COMPLETING})


class SlurmError(RuntimeError):
    """A Slurm call failed. Carries the argv, exit status and stderr so a log line can say what happened."""

    def __init__(self, message: str, *, argv: Sequence[str] = (), returncode: int | None = None, stderr: str = ""):
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        detail = f" (command: {' '.join(self.argv)}" if self.argv else ""
        if detail:
            detail += f"; exit {returncode}" if returncode is not None else ""
            detail += f"; stderr: {stderr.strip()[:500]!r})" if stderr.strip() else ")"
        super().__init__(message + detail)


class SlurmTimeout(SlurmError):
    """A Slurm call did not answer in time (subprocess timeout or 'Socket timed out')."""


class SlurmParseError(SlurmError):
    """Slurm answered with output we cannot read (truncated JSON, an unknown shape)."""


class JobNotRequeueable(SlurmError):
    """The job was submitted with --no-requeue: Slurm refuses to requeue it, even for root."""


@dataclass(frozen=True)
class JobRecord:
    """One Slurm job as the daemon needs it, the same for every Slurm version."""

    job_id: int
    name: str
    user: str
    partition: str
    state: str  # base state: PENDING, RUNNING, SUSPENDED, COMPLETED, CANCELLED, FAILED, ...
    state_flags: tuple[str, ...] = ()  # e.g. ("REQUEUED",), ("COMPLETING",)
    state_reason: str = ""
    gpus_per_node: int = 0
    gpus_total: int = 0  # gpus_per_node x node_count (what it runs on or will run on)
    node_count: int = 0
    nodes: tuple[str, ...] = ()  # expanded node names, empty while pending
    comment: str = ""
    admin_comment: str = ""
    restart_count: int = 0
    priority: int | None = None
    held: bool = False  # priority 0 (user or admin hold)
    requeueable: bool = True
    submit_time: int | None = None
    start_time: int | None = None
    user_id: int | None = None
    account: str = ""  # the Slurm account it runs under (``--account``); "" = none shown
    work_dir: str = ""  # the job's working directory (where its batch script starts)
    # Where the job may run (issue 13; filled by the backends from Slurm's own fields):
    gpu_type: str = ""  # requested gres type (``--gres=gpu:a100:N`` -> "a100"); "" = any type
    constraint: str = ""  # ``--constraint`` as Slurm shows it; "" = none
    exclusive: bool = False  # ``--exclusive``: whole nodes only
    time_limit_s: int | None = None  # ``--time`` in seconds; None = unlimited / partition default
    reservation: str = ""  # ``--reservation``; "" = none

    @property
    def partitions(self) -> tuple[str, ...]:
        """The partitions the job may run in (Slurm keeps ``-p a,b`` as one comma list)."""
        return tuple(p for p in self.partition.split(",") if p)

    @property
    def is_pending(self) -> bool:
        return self.state == PENDING

    @property
    def is_running(self) -> bool:
        return self.state == RUNNING

    @property
    def is_completing(self) -> bool:
        """Processes still ending (after a requeue, cancel or exit): no update may rely on it yet."""
        return self.state == COMPLETING or COMPLETING in self.state_flags

    @property
    def is_requeued_settled(self) -> bool:
        """Back in the queue with the requeue finished: safe to update and release."""
        return self.state == PENDING and not self.is_completing

    @property
    def is_active(self) -> bool:
        return self.state in ACTIVE_STATES


@dataclass(frozen=True)
class NodeRecord:
    """One node: its state and GPUs (total and in use), and the partitions it belongs to."""

    name: str
    state: str  # base state, upper case: IDLE, MIXED, ALLOCATED, DOWN, ...
    state_flags: tuple[str, ...] = ()  # e.g. ("DRAIN",), ("NOT_RESPONDING",)
    gpus_total: int = 0
    gpus_used: int = 0
    cpus_total: int = 0
    partitions: tuple[str, ...] = ()
    gpu_type: str = ""  # the type of its GPUs from the node's gres (``gpu:a100:4`` -> "a100"); "" = untyped
    features: tuple[str, ...] = ()  # active features (what ``--constraint`` matches)
    reservations: tuple[str, ...] = ()  # active reservations covering the node (jobs without one may not use it)

    @property
    def usable(self) -> bool:
        """Up and schedulable: not down, drained, failing or not responding."""
        bad = {"DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING", "NOT_RESPONDING", "FUTURE", "UNKNOWN"}
        return self.state not in bad and not (set(self.state_flags) & bad)


@dataclass(frozen=True)
class PartitionRecord:
    """One partition's limits as Slurm enforces them (issue 13): a plan past them would never start."""

    name: str
    nodes: tuple[str, ...] = ()
    max_nodes: int | None = None  # MaxNodes per job; None = unlimited
    max_time_s: int | None = None  # MaxTime; None = unlimited
    default_time_s: int | None = None  # DefaultTime (a job without --time gets it); None = MaxTime applies
    state: str = "UP"  # UP, DOWN, DRAIN, INACTIVE
    is_default: bool = False


NO_PREEMPTION = frozenset({"", "(null)", "preempt/none", "none"})


def preemption_refusal(config: dict[str, str]) -> str | None:
    """Why the daemon must not run on this Slurm, when Slurm preempts jobs itself (``PreemptType`` set),
    else None. Slurm 22.05 prints ``preempt/none`` when it is off, 24.11 ``(null)``. Slurm's preemption
    would requeue or cancel jobs behind the allocator's plan (and kill elastic jobs without a checkpoint)."""
    kind = (config.get("PreemptType") or "").strip()
    if kind.lower() in NO_PREEMPTION:
        return None
    return (f"Slurm preempts jobs (PreemptType={kind}, PreemptMode={config.get('PreemptMode', '?')} in "
            "slurm.conf): slurm-elastic does not run next to Slurm's own preemption, which would stop jobs "
            "behind its plan. Set PreemptType=preempt/none (or remove it) and reconfigure; see docs/SYSADMIN.md")


class SlurmBackend(abc.ABC):
    """What the daemon (and the simulator) need from Slurm; one implementation per transport."""

    @abc.abstractmethod
    def list_jobs(self) -> list[JobRecord]:
        """Active jobs (pending, running, suspended) of the cluster; finished ones are filtered out."""

    @abc.abstractmethod
    def list_nodes(self) -> list[NodeRecord]:
        """All nodes with their GPU totals and usage."""

    def list_partitions(self) -> list[PartitionRecord]:
        """The partitions with their limits. A backend that knows none (the simulator) lists none."""
        return []

    def slurm_config(self) -> dict[str, str]:
        """Slurm's running configuration (``scontrol show config``) as {Key: value}; {} where there is no
        slurmctld (the simulator)."""
        return {}

    def get_job(self, job_id: int, include_finished: bool = False) -> JobRecord | None:
        """One job by id, or None if Slurm no longer lists it (as active, unless ``include_finished``)."""
        for job in self.list_jobs():
            if job.job_id == job_id:
                return job
        return None

    @abc.abstractmethod
    def hold(self, job_id: int) -> None:
        """Admin-hold a pending job (priority 0) so Slurm does not start it."""

    @abc.abstractmethod
    def release(self, job_id: int) -> None:
        """Release a held job so Slurm may start it."""

    # True where requeue_hold is done when it returns (the simulator): the enactor then places the job in
    # the same poll. Slurm finishes a requeue asynchronously (COMPLETING until the job's processes end).
    requeue_settles_at_once = False

    @abc.abstractmethod
    def requeue_hold(self, job_id: int, *, wait: bool = True) -> None:
        """Stop a running batch job and put it back in the queue, held. Refuses non-requeueable jobs.
        ``wait``: return once Slurm has finished the requeue (:meth:`wait_requeued`); False returns at once
        (the enactor then finishes the resize on a later poll, so one job slow to end delays only itself)."""

    @abc.abstractmethod
    def update_job(
        self,
        job_id: int,
        *,
        gpus_per_node: int | None = None,
        num_nodes: int | None = None,
        num_tasks: int | None = None,
        start_now: bool = False,
        admin_comment: str | None = None,
        partition: str | None = None,
        gpu_type: str | None = None,
        exclude_nodes: tuple[str, ...] | None = None,
    ) -> None:
        """Change a pending job: GPUs per node, exact node count, task count, begin time now, admin comment;
        ``partition``/``gpu_type`` pin it to the pool the allocator chose (issue 13; None: unchanged);
        ``exclude_nodes`` are nodes it may not start on (GPUs kept for a rigid job; () clears; None: unchanged)."""

    @abc.abstractmethod
    def signal(self, job_id: int, signal: str = "USR2", *, batch_only: bool = False) -> None:
        """Send a signal to a running job's steps (or only its batch shell), e.g. to ask for a checkpoint."""

    def requeue_failed(self, job_id: int) -> None:
        """Put a finished (failed) batch job back in the queue, held, so the daemon places it again."""
        raise SlurmError(f"job {job_id}: this backend cannot requeue a finished job")

    def version(self) -> str:
        """The Slurm release this backend talks to, e.g. '22.05.8'."""
        return "unknown"

    def wait_requeued(self, job_id: int, timeout: float = 120.0, poll: float = 0.2) -> JobRecord:
        """Wait until a requeued job has finished completing and is pending again.

        Slurm finishes a requeue asynchronously (after the epilog) and only then sets the job's begin
        time to now + cred_expire; an update made before that is overwritten, so callers must wait.
        The same for every backend that lists jobs (CLI, pyslurm), hence here.
        """
        deadline = time.monotonic() + timeout
        job = None
        while time.monotonic() < deadline:
            job = self.get_job(job_id)
            if job is None:
                raise SlurmError(f"job {job_id} left the queue while being requeued")
            if job.is_requeued_settled:
                # Slurm revokes the job's credentials at the requeue, for that whole second: a start
                # in the same second fails ("Job credential revoked"). Return past the next second.
                time.sleep(1.05 - time.time() % 1.0)
                return job
            time.sleep(poll)
        raise SlurmTimeout(f"job {job_id} was still {job.state if job else '?'} {timeout:.0f} s after requeuehold")

    def submit_lease(self, name: str, partition: str | None, admin_comment: str) -> int:
        """Submit a held, never-running placeholder job carrying ``admin_comment`` (the daemon's lease,
        daemon/lease.py). Backends without it raise NotImplementedError (the daemon then says so)."""
        raise NotImplementedError

    def cancel_lease(self, job_id: int) -> None:
        """Cancel a placeholder job made by :meth:`submit_lease` (never a user's job)."""
        raise NotImplementedError
