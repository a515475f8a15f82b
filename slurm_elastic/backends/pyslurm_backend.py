"""The pyslurm backend: the same reads and actions as the CLI backend, over libslurm through pyslurm.

Why: reading the queue dominates the daemon's cycle, and ``squeue --json`` prints about 3 KB of JSON
per job; pyslurm's ``Jobs.load()`` reads the same records straight from slurmctld's RPC (8x faster at
300 jobs, see docs/MEASUREMENTS.md). pyslurm must be built for the running Slurm's major version
(pyslurm 22.5.x for 22.05, 24.11.x for 24.11; docs/SYSADMIN.md); its typed API (``Jobs``, ``Job``,
``Nodes``, ``JobSubmitDescription``) is the same in both, so one code path serves both.

Importing pyslurm initialises libslurm from ``SLURM_CONF`` once per process (a bad path makes libslurm
exit the process), so :mod:`slurm_elastic.backends.select` probes the import in a subprocess first,
and a process talks to one cluster only (tests use :mod:`slurm_elastic.backends.pyslurm_worker`).

What goes to the CLI instead (documented in docs/SLURM-VERSIONS.md): the resize part of
``update_job`` (GPUs per node, node count, task count, partition and GPU type), and the reads of
reservations, partitions and the config (``scontrol -o show ...``, about 5 ms each). pyslurm's update path never sends a node count
(``JobSubmitDescription.nodes`` is applied only at submission, in 22.5.3 and 24.11.0 alike) and always
spells GPUs ``gres:gpu:K``; the resize must be one atomic update, so it is one ``scontrol update``.
AdminComment, StartTime, hold, release, requeue-hold, signal and all reads use pyslurm.
"""

from __future__ import annotations

import dataclasses
import re
import signal as signal_mod
import time
from collections.abc import Callable
from typing import Any

from slurm_elastic.backends import dialects
from slurm_elastic.backends.base import (
    ACTIVE_STATES,
    JobNotRequeueable,
    JobRecord,
    NodeRecord,
    PartitionRecord,
    SlurmBackend,
    SlurmError,
    SlurmParseError,
    SlurmTimeout,
)
from slurm_elastic.backends.cli import TRANSIENT_ERRORS, CliBackend, attach_reservations

_SIGNAL_RE = re.compile(r"^(SIG)?[A-Z0-9]{1,8}$")
KILL_JOB_BATCH = 1  # slurm.h: signal only the batch step


def gpus_in_gres_dict(value: Any, *, what: str) -> int:
    """GPUs in pyslurm's GRES dict: {'gpu': 2}, {'gpu:a100': 2}, {'gres/gpu': 2} (24.11 spells
    tres_per_node 'gres/gpu:2') or {'gpu': {'count': 2, 'indexes': '0-1'}} (22.05's gres_used)."""
    if value in (None, {}):
        return 0
    if not isinstance(value, dict):
        raise SlurmParseError(f"{what}: expected a GRES dict, got {value!r}")
    total = 0
    for key, count in value.items():
        name = str(key).removeprefix("gres/").removeprefix("gres:")
        if name != "gpu" and not name.startswith("gpu:"):
            continue
        if isinstance(count, dict):
            count = count.get("count", 0)
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise SlurmParseError(f"{what}: GPU count should be a non-negative integer, got {count!r}")
        total += count
    return total


def gpu_type_in_gres_dict(value: Any, *, what: str) -> str:
    """The GPU type in pyslurm's GRES dict ({'gpu:a100': 2} or {'gres/gpu:a100': 2} -> 'a100'); '' when
    untyped; several types sorted and comma-joined, as :func:`dialects.gpu_type_in_tres`."""
    if value in (None, {}):
        return ""
    if not isinstance(value, dict):
        raise SlurmParseError(f"{what}: expected a GRES dict, got {value!r}")
    types = set()
    for key in value:
        name = str(key).removeprefix("gres/").removeprefix("gres:")
        if name.startswith("gpu:") and name[4:]:
            types.add(name[4:])
    return ",".join(sorted(types))


def _names(value: Any, what: str) -> tuple[str, ...]:
    if value in (None, "", []):
        return ()
    if isinstance(value, str):
        value = value.split(",")
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise SlurmParseError(f"{what}: expected a list of names, got {value!r}")
    return tuple(v for v in value if v)


def _text(value: Any, what: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise SlurmParseError(f"{what} should be text, got {type(value).__name__}")
    return value


def _int(value: Any, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SlurmParseError(f"{what} should be an integer, got {value!r}")
    return value


def job_record(job: Any) -> JobRecord:
    """One ``pyslurm.Job`` -> JobRecord, with the same meanings as :func:`dialects.parse_job`."""
    jid = job.id
    if isinstance(jid, bool) or not isinstance(jid, int) or jid <= 0:
        raise SlurmParseError(f"job without a valid id: {jid!r}")
    w = f"job {jid}"
    try:
        base, flags = dialects.split_job_state(dialects.state_list(job.state, what=f"{w}: state"))
        nodes = dialects.expand_hostlist(_text(job.allocated_nodes, f"{w}: nodes"))
        node_count = _int(job.num_nodes, f"{w}: num_nodes") or len(nodes) or 0
        per_node = gpus_in_gres_dict(job.gres_per_node, what=f"{w}: tres_per_node")
        priority = _int(job.priority, f"{w}: priority")
        reason = _text(job.state_reason, f"{w}: state_reason")
        held = (priority == 0 and base == "PENDING") or reason in ("JobHeldUser", "JobHeldAdmin")
        requeue = job.is_requeueable
        if not isinstance(requeue, bool):
            raise SlurmParseError(f"{w}: requeue should be a boolean, got {requeue!r}")
        uid = _int(job.user_id, f"{w}: user_id")
        sharing = _text(job.resource_sharing, f"{w}: shared").upper()  # NO = --exclusive; OK = unset
        return JobRecord(
            job_id=jid,
            name=_text(job.name, f"{w}: name"),
            user=_user_name(uid),
            user_id=uid,
            account=_text(job.account, f"{w}: account"),
            partition=_text(job.partition, f"{w}: partition"),
            state=base,
            state_flags=flags,
            state_reason=reason,
            gpus_per_node=per_node,
            gpus_total=per_node * node_count,
            node_count=node_count,
            nodes=tuple(nodes),
            comment=_text(job.comment, f"{w}: comment"),
            admin_comment=_text(job.admin_comment, f"{w}: admin_comment"),
            restart_count=_int(job.requeue_count, f"{w}: restart_cnt") or 0,
            priority=priority,
            held=held,
            requeueable=requeue,
            submit_time=_int(job.submit_time, f"{w}: submit_time") or None,
            start_time=_int(job.start_time, f"{w}: start_time") or None,
            work_dir=_text(job.working_directory, f"{w}: work_dir"),
            gpu_type=gpu_type_in_gres_dict(job.gres_per_node, what=f"{w}: tres_per_node"),
            constraint=",".join(_names(job.constraints, f"{w}: features")),
            exclusive=sharing in ("NO", "USER", "MCS"),
            time_limit_s=dialects.time_limit_seconds(job.time_limit, what=f"{w}: time_limit"),
            reservation=_text(job.reservation, f"{w}: reservation"),
        )
    except SlurmParseError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, UnicodeDecodeError) as e:
        raise SlurmParseError(f"{w}: unexpected value from pyslurm: {e}") from e


_USERS: dict[int, str] = {}


def _user_name(uid: int | None) -> str:
    """uid -> name, cached (pyslurm's own lookup reads passwd once per job and call)."""
    if uid is None:
        return ""
    name = _USERS.get(uid)
    if name is None:
        import pwd

        try:
            name = pwd.getpwuid(uid).pw_name
        except KeyError:
            name = str(uid)
        if len(_USERS) < 100_000:
            _USERS[uid] = name
    return name


def node_record(node: Any) -> NodeRecord:
    """One ``pyslurm.Node`` -> NodeRecord (state words as in :func:`dialects.parse_node`)."""
    name = node.name
    if not isinstance(name, str) or not name:
        raise SlurmParseError("node without a name")
    try:
        words = dialects.state_list(node.state, what=f"node {name}: state")
        base = [x for x in words if x in dialects.NODE_BASE_STATES]
        return NodeRecord(
            name=name,
            state=base[0] if base else (words[0] if words else "UNKNOWN"),
            state_flags=tuple(x for x in words if x not in dialects.NODE_BASE_STATES),
            gpus_total=gpus_in_gres_dict(node.configured_gres, what=f"node {name}: gres"),
            gpus_used=gpus_in_gres_dict(node.allocated_gres, what=f"node {name}: gres_used"),
            cpus_total=_int(node.total_cpus, f"node {name}: cpus") or 0,
            partitions=tuple(str(p) for p in (node.partitions or [])),
            gpu_type=gpu_type_in_gres_dict(node.configured_gres, what=f"node {name}: gres"),
            features=_names(node.active_features, f"node {name}: active_features"),
        )
    except SlurmParseError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError, UnicodeDecodeError) as e:
        raise SlurmParseError(f"node {name}: unexpected value from pyslurm: {e}") from e


class PyslurmBackend(SlurmBackend):
    """Talks to the slurmctld of this process's ``SLURM_CONF`` through pyslurm (imported on first use).

    Retry rules are the CLI backend's: an RPC error that Slurm reports as transient (socket timeout,
    zero bytes, connection refused) is retried ``retries`` times with a growing delay and then raised
    as :class:`SlurmTimeout`; any other error is raised at once as :class:`SlurmError`; requeue-hold
    is never retried. One difference: no call can be cut by ``slurm_timeout_s`` (libslurm holds the
    GIL), and "Unable to contact slurm controller" comes only after libslurm retried the connection
    for MessageTimeout seconds, so it is raised as :class:`SlurmTimeout` at once (the cycle is skipped). ``cli`` serves the calls pyslurm cannot make (see the module docstring).
    """

    def __init__(self, *, cli: CliBackend | None = None, retries: int = 3, retry_delay: float = 1.0,
                 module: Any = None):
        if module is None:
            import pyslurm as module  # noqa: PLC0415 - libslurm is initialised on import
        self.pyslurm = module
        self.cli = cli or CliBackend()
        self.retries = retries
        self.retry_delay = retry_delay
        self._per_job: dict[int, str] = {}  # job -> its tres_per_job (``--gpus=N``), read once per job

    # ----- plumbing ---------------------------------------------------------------------------
    def _rpc(self, what: str, fn: Callable[[], Any], *, retry: bool = True) -> Any:
        attempts = 1 + (self.retries if retry else 0)
        last: SlurmError | None = None
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.retry_delay * attempt)
            try:
                return fn()
            except self.pyslurm.PyslurmError as e:
                errno = getattr(e, "errno", None)
                msg = str(getattr(e, "msg", None) or e)
                argv = ["pyslurm", what]
                if "unable to contact slurm controller" in msg.lower():
                    # libslurm has already retried the connection for MessageTimeout seconds inside
                    # this call (the GIL held; no timeout of ours can cut it): retrying again would
                    # hold a cycle for minutes while slurmctld is down.
                    raise SlurmTimeout(f"pyslurm {what}: slurmctld unreachable", argv=argv, returncode=errno,
                                       stderr=msg) from e
                if TRANSIENT_ERRORS.search(msg) or "timed out" in msg.lower():
                    last = SlurmTimeout(f"pyslurm {what} failed transiently", argv=argv, returncode=errno,
                                        stderr=msg)
                    continue
                raise SlurmError(f"pyslurm {what} failed", argv=argv, returncode=errno, stderr=msg) from e
        assert last is not None
        raise last

    def version(self) -> str:
        return self.cli.version()

    def pyslurm_version(self) -> str:
        return str(self.pyslurm.__version__)

    # ----- reads --------------------------------------------------------------------------------
    def list_jobs(self, include_finished: bool = False) -> list[JobRecord]:
        jobs = self._rpc("load jobs", lambda: self.pyslurm.Jobs.load())
        out = [self._with_gpus_per_job(job_record(j)) for j in jobs.values()]
        self._per_job = {k: v for k, v in self._per_job.items() if k in jobs}
        self.cli.remember_gpu_types(out)
        if not include_finished:
            out = [j for j in out if j.state in ACTIVE_STATES]
        return sorted(out, key=lambda j: j.job_id)

    def _with_gpus_per_job(self, rec: JobRecord) -> JobRecord:
        """An active job with no GPUs per node may ask ``--gpus=N`` per job, which the typed API does not
        show (no ``tres_per_job`` in pyslurm 22.5.3 or 24.11.0): read it once per job through the old
        API's single-job load, as the CLI dialects read it (per node = N // nodes)."""
        if rec.gpus_per_node or not rec.is_active:
            return rec
        text = self._per_job.get(rec.job_id)
        if text is None and not str(self.pyslurm.__version__).startswith("22."):
            # pyslurm 24.11.0's old API fails on this load ("an integer is required", seen live): 24.11's
            # ``scontrol show job J --json`` gives the field instead (about 10 ms, once per job).
            text = self.cli.tres_per_job(rec.job_id)
            self._per_job[rec.job_id] = text
        if text is None:
            def load():
                try:
                    return self.pyslurm.job().find_id(str(rec.job_id))
                except ValueError as e:  # the old API raises ValueError(message, errno) for every error
                    msg, errno = (e.args + (None,))[:2] if e.args else ("", None)
                    if "Invalid job id" in str(msg):
                        return []  # it ended meanwhile
                    raise self.pyslurm.RPCError(errno=errno if isinstance(errno, int) else -1, msg=str(msg)) from e

            found = self._rpc(f"load job {rec.job_id} (tres_per_job)", load)
            text = ""
            if found and isinstance(found[0], dict):
                text = _text(found[0].get("tres_per_job"), f"job {rec.job_id}: tres_per_job")
            self._per_job[rec.job_id] = text
        total = dialects.gpus_in_tres(text)
        if not total:
            return rec
        nodes = rec.node_count or 1
        return dataclasses.replace(rec, gpus_per_node=total // nodes if rec.node_count else total, gpus_total=total,
                                   gpu_type=rec.gpu_type or dialects.gpu_type_in_tres(text))

    def get_job(self, job_id: int, include_finished: bool = False) -> JobRecord | None:
        jid = self._jid(job_id)

        def load():
            try:
                return self.pyslurm.Job.load(jid)
            except self.pyslurm.RPCError as e:
                if "Invalid job id" in str(getattr(e, "msg", None) or e):
                    return None
                raise

        job = self._rpc(f"load job {jid}", load)
        if job is None:
            return None
        rec = self._with_gpus_per_job(job_record(job))
        return rec if include_finished or rec.state in ACTIVE_STATES else None

    def list_nodes(self) -> list[NodeRecord]:
        nodes = self._rpc("load nodes", lambda: self.pyslurm.Nodes.load())
        out = sorted((node_record(n) for n in nodes.values()), key=lambda n: n.name)
        return attach_reservations(out, self.cli.reservations())

    def list_partitions(self) -> list[PartitionRecord]:
        return self.cli.list_partitions()

    def slurm_config(self) -> dict[str, str]:
        return self.cli.slurm_config()

    # ----- actions ------------------------------------------------------------------------------
    @staticmethod
    def _jid(job_id: int) -> int:
        if isinstance(job_id, bool) or not isinstance(job_id, int) or job_id <= 0:
            raise ValueError(f"job id must be a positive integer, got {job_id!r}")
        return job_id

    def _modify(self, job_id: int, what: str, **changes) -> None:
        jid = self._jid(job_id)
        desc = self.pyslurm.JobSubmitDescription(**changes)
        self._rpc(f"{what} job {jid}", lambda: self.pyslurm.Job(jid).modify(desc))

    def hold(self, job_id: int) -> None:
        jid = self._jid(job_id)
        self._rpc(f"hold job {jid}", lambda: self.pyslurm.Job(jid).hold())

    def release(self, job_id: int) -> None:
        jid = self._jid(job_id)
        self._rpc(f"release job {jid}", lambda: self.pyslurm.Job(jid).release())

    def requeue_hold(self, job_id: int, *, wait: bool = True) -> None:
        job = self.get_job(job_id)
        if job is None:
            raise SlurmError(f"job {job_id} is not active; nothing to requeue")
        if not job.requeueable:
            raise JobNotRequeueable(f"job {job_id} was submitted with --no-requeue; Slurm refuses to requeue it")
        self._rpc(f"requeuehold job {job_id}", lambda: self.pyslurm.Job(job_id).requeue(hold=True), retry=False)
        if wait:
            self.wait_requeued(job_id)

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
        jid = self._jid(job_id)
        if admin_comment is not None and ("\n" in admin_comment or len(admin_comment) > 1024):
            raise ValueError(f"job {job_id}: admin comment must be one line of at most 1024 characters")
        if (gpus_per_node is not None or num_nodes is not None or num_tasks is not None or partition is not None
                or gpu_type is not None or exclude_nodes is not None):
            # The CLI fallback: one atomic resize and pool change (see the module docstring).
            self.cli.update_job(jid, gpus_per_node=gpus_per_node, num_nodes=num_nodes, num_tasks=num_tasks,
                                partition=partition, gpu_type=gpu_type, exclude_nodes=exclude_nodes)
        if admin_comment is not None:
            if admin_comment == "":
                # pyslurm sends an empty string as "unset" (NULL): clearing needs the CLI.
                self.cli.update_job(jid, admin_comment="")
            else:
                self._modify(jid, "update AdminComment of", admin_comment=admin_comment)
        if start_now:
            self._modify(jid, "update StartTime of", begin_time=int(time.time()))

    def requeue_failed(self, job_id: int) -> None:
        """The crash policy's requeue of a FAILED job (daemon/crash.py): through the CLI, as rare as a crash."""
        self.cli.requeue_failed(job_id)

    def submit_lease(self, name: str, partition: str | None, admin_comment: str) -> int:
        """The daemon's lease placeholder (daemon/lease.py): submitted through the CLI on every version
        (pyslurm has no held ``--wrap`` submission; one sbatch per daemon start is not on the hot path)."""
        return self.cli.submit_lease(name, partition, admin_comment)

    def cancel_lease(self, job_id: int) -> None:
        self.cli.cancel_lease(job_id)

    def signal(self, job_id: int, signal: str = "USR2", *, batch_only: bool = False) -> None:
        sig = signal.upper()
        if not _SIGNAL_RE.fullmatch(sig):
            raise ValueError(f"not a signal name: {signal!r}")
        jid = self._jid(job_id)
        try:
            signum = int(signal_mod.Signals[sig if sig.startswith("SIG") else f"SIG{sig}"])
        except KeyError:
            raise ValueError(f"not a signal name: {signal!r}") from None

        def kill():
            # Job.send_signal reads libslurm's errno even after a success (a stale error from an earlier
            # call would be raised): the old-style call checks the return code itself.
            try:
                self.pyslurm.slurm_kill_job(jid, signum, KILL_JOB_BATCH if batch_only else 0)
            except ValueError as e:
                msg, errno = (e.args + (None,))[:2] if e.args else ("", None)
                raise self.pyslurm.RPCError(errno=errno if isinstance(errno, int) else -1, msg=str(msg)) from e

        self._rpc(f"signal job {jid}", kill)
