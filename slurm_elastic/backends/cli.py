"""The default backend: Slurm's command-line tools with ``--json`` for reads and ``scontrol`` for actions.

Every call is an argv list (never a shell), has a timeout, and fails with a :class:`SlurmError`
that carries the command and its stderr. Calls that time out, or that Slurm answers with a
transient "Socket timed out"-style error, are retried a bounded number of times.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Mapping, Sequence

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

TRANSIENT_ERRORS = re.compile(
    r"Socket timed out|Unable to contact slurm controller|Zero Bytes were transmitted|"
    r"Connection refused|Resource temporarily unavailable|Interrupted system call|slurm_receive_msg",
    re.IGNORECASE,
)
_SIGNAL_RE = re.compile(r"^(SIG)?[A-Z0-9]{1,8}$")
_GPU_TYPE_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_PARTITION_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}(,[A-Za-z0-9_.\-]{1,64}){0,31}$")
_NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


def check_pool_args(job_id: int, partition: str | None, gpu_type: str | None) -> None:
    """Refuse a partition or GPU type that is not a plain Slurm name (they go into an scontrol argument)."""
    if partition is not None and (not isinstance(partition, str) or not _PARTITION_RE.fullmatch(partition)):
        raise ValueError(f"job {job_id}: partition must be a Slurm partition name (or a comma list), got {partition!r}")
    if gpu_type is not None and gpu_type != "" and (not isinstance(gpu_type, str) or not _GPU_TYPE_RE.fullmatch(gpu_type)):
        raise ValueError(f"job {job_id}: gpu_type must be a GRES type name such as 'a100', got {gpu_type!r}")


class CliBackend(SlurmBackend):
    """Talks to the slurmctld that ``SLURM_CONF`` (in ``env``) points at, through the Slurm CLI."""

    def __init__(
        self,
        env: Mapping[str, str] | None = None,
        *,
        bin_dir: str = "/usr/bin",
        timeout: float = 30.0,
        retries: int = 3,
        retry_delay: float = 1.0,
        runner=subprocess.run,
        prefix: Sequence[str] = (),
    ):
        """``prefix`` is put before every command, e.g. ``["chroot", ROOT]`` for a Slurm in a chroot
        (then ``bin_dir`` and the paths in ``env`` are as seen inside it)."""
        self.env = {**os.environ, **(env or {})}
        self.bin_dir = bin_dir
        self.prefix = [str(p) for p in prefix]
        self.timeout = timeout
        self.retries = retries
        self.retry_delay = retry_delay
        self._run = runner
        self._version: tuple[int, int, int] | None = None
        # The GPU type each job asked for, from the last read: a resize that does not change the type
        # must write it back (TresPerNode is replaced as a whole; an untyped value would free the job
        # to run on any type).
        self._gpu_types: dict[int, str] = {}

    # ----- plumbing ---------------------------------------------------------------------------
    def _call(self, tool: str, args: Sequence[str], *, retry: bool = True) -> str:
        argv = [*self.prefix, os.path.join(self.bin_dir, tool), *args]
        attempts = 1 + (self.retries if retry else 0)
        last: SlurmError | None = None
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.retry_delay * attempt)
            try:
                r = self._run(argv, env=self.env, capture_output=True, text=True, timeout=self.timeout, check=False)
            except subprocess.TimeoutExpired as e:
                last = SlurmTimeout(f"{tool} did not answer within {self.timeout:.0f} s", argv=argv,
                                    stderr=(e.stderr or b"").decode(errors="replace") if isinstance(e.stderr, bytes)
                                    else (e.stderr or ""))
                continue
            except FileNotFoundError as e:
                raise SlurmError(f"{tool} is not installed at {argv[len(self.prefix)]}", argv=argv) from e
            if r.returncode == 0:
                return r.stdout
            err = SlurmError(f"{tool} failed", argv=argv, returncode=r.returncode, stderr=r.stderr)
            if TRANSIENT_ERRORS.search(r.stderr or ""):
                last = SlurmTimeout(f"{tool} failed transiently", argv=argv, returncode=r.returncode, stderr=r.stderr)
                continue
            raise err
        assert last is not None
        raise last

    def _json(self, tool: str, args: Sequence[str]) -> dict:
        out = self._call(tool, args)
        try:
            doc = json.loads(out)
        except ValueError as e:
            raise SlurmParseError(
                f"{tool} printed invalid JSON ({e}; {len(out)} bytes, starts {out[:80]!r})",
                argv=[tool, *args],
            ) from e
        if not isinstance(doc, dict):
            raise SlurmParseError(f"{tool} printed JSON that is not an object", argv=[tool, *args])
        return doc

    def version_tuple(self) -> tuple[int, int, int]:
        if self._version is None:
            out = self._call("squeue", ["--version"])
            m = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
            if not m:
                raise SlurmParseError(f"cannot read a version from {out!r}", argv=["squeue", "--version"])
            self._version = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
        return self._version

    def version(self) -> str:
        return ".".join(f"{x:02d}" if i == 1 else str(x) for i, x in enumerate(self.version_tuple()))

    # ----- reads --------------------------------------------------------------------------------
    def raw_jobs(self, include_finished: bool = False) -> dict:
        """The ``squeue --json`` document (22.05 ignores filters and lists finished jobs anyway)."""
        args = ["--json"]
        if include_finished and self.version_tuple() >= (23, 2, 0):
            args = ["--json", "--states=all"]
        return self._json("squeue", args)

    def raw_nodes(self) -> dict:
        """Per-node JSON: ``sinfo --json`` on 22.05, ``scontrol show nodes --json`` from 23.02."""
        if self.version_tuple() >= (23, 2, 0):
            return self._json("scontrol", ["show", "nodes", "--json"])
        return self._json("sinfo", ["--json"])

    def list_jobs(self, include_finished: bool = False) -> list[JobRecord]:
        jobs = dialects.parse_jobs(self.raw_jobs(include_finished))
        self.remember_gpu_types(jobs)
        if not include_finished:
            jobs = [j for j in jobs if j.state in ACTIVE_STATES]
        return jobs

    def get_job(self, job_id: int, include_finished: bool = False) -> JobRecord | None:
        for job in self.list_jobs(include_finished=include_finished):
            if job.job_id == job_id:
                return job
        return None

    def list_nodes(self) -> list[NodeRecord]:
        """Nodes, each with the active reservations covering it (one more, cheap read: ``scontrol -o show
        reservation``, about 5 ms; 22.05's node JSON has no reservation field and 24.11's is empty
        while a reservation is active)."""
        nodes = dialects.parse_nodes(self.raw_nodes())
        return attach_reservations(nodes, self.reservations())

    def reservations(self) -> dict[str, tuple[str, ...]]:
        """{node: active reservations covering it}."""
        return dialects.parse_reservations(self._call("scontrol", ["-o", "show", "reservation"]))

    def tres_per_job(self, job_id: int) -> str:
        """One job's ``tres_per_job`` (``--gpus=N``) from ``scontrol show job J --json`` (23.02+; for the
        pyslurm backend, whose typed API lacks it); "" when the job has ended."""
        jid = self._jid(job_id)
        if self.version_tuple() < (23, 2, 0):
            raise SlurmError(f"job {job_id}: scontrol of Slurm {self.version()} has no --json")
        try:
            doc = self._json("scontrol", ["show", "job", jid, "--json"])
        except SlurmError as e:
            if "Invalid job id" in (e.stderr or ""):
                return ""
            raise
        jobs = doc.get("jobs")
        if not isinstance(jobs, list) or len(jobs) != 1 or not isinstance(jobs[0], dict):
            raise SlurmParseError(f"job {job_id}: scontrol show job --json gave no single job", argv=["scontrol"])
        value = jobs[0].get("tres_per_job") or ""
        if not isinstance(value, str):
            raise SlurmParseError(f"job {job_id}: field 'tres_per_job' should be text", argv=["scontrol"])
        return value

    def list_partitions(self) -> list[PartitionRecord]:
        """Partitions with MaxNodes/MaxTime/DefaultTime (``scontrol -o show partition``: the same text on
        every version; 22.05's scontrol has no --json)."""
        return dialects.parse_partitions(self._call("scontrol", ["-o", "show", "partition"]))

    def slurm_config(self) -> dict[str, str]:
        return dialects.parse_config(self._call("scontrol", ["show", "config"]))

    # ----- actions ------------------------------------------------------------------------------
    @staticmethod
    def _jid(job_id: int) -> str:
        if isinstance(job_id, bool) or not isinstance(job_id, int) or job_id <= 0:
            raise ValueError(f"job id must be a positive integer, got {job_id!r}")
        return str(job_id)

    def hold(self, job_id: int) -> None:
        self._call("scontrol", ["hold", self._jid(job_id)])

    def release(self, job_id: int) -> None:
        self._call("scontrol", ["release", self._jid(job_id)])

    def requeue_hold(self, job_id: int, *, wait: bool = True) -> None:
        job = self.get_job(job_id)
        if job is None:
            raise SlurmError(f"job {job_id} is not active; nothing to requeue")
        if not job.requeueable:
            raise JobNotRequeueable(f"job {job_id} was submitted with --no-requeue; Slurm refuses to requeue it")
        self._call("scontrol", ["requeuehold", self._jid(job_id)], retry=False)
        if wait:
            self.wait_requeued(job_id)

    def requeue_failed(self, job_id: int) -> None:
        # scontrol requeuehold also takes a finished batch job (until MinJobAge drops its record).
        self._call("scontrol", ["requeuehold", self._jid(job_id)], retry=False)

    def gres_request(self, gpus_per_node: int, gpu_type: str = "") -> str:
        """The TresPerNode value in this Slurm's spelling: gres:gpu:K (22.05) or gres/gpu:K (23.11+), with
        the type between when one is asked for (gres:gpu:a100:K, gres/gpu:a100:K). Not 22.05's
        ``gpu:a100:K``: it is accepted but only the text changes, the job still gets its old count."""
        sep = "/" if self.version_tuple() >= (23, 11, 0) else ":"
        return f"gres{sep}gpu:{gpu_type}:{gpus_per_node}" if gpu_type else f"gres{sep}gpu:{gpus_per_node}"

    def remember_gpu_types(self, jobs: list[JobRecord]) -> None:
        """The GPU types of a read made elsewhere (the pyslurm backend, whose resizes come here)."""
        self._gpu_types = {j.job_id: j.gpu_type for j in jobs}

    def current_gpu_type(self, job_id: int) -> str:
        """The GPU type the job asks for now (from the last read, else one read)."""
        if job_id not in self._gpu_types:
            job = self.get_job(job_id)
            # Not active: no update can change it, and scontrol's own refusal ("Invalid job id") says why.
            return job.gpu_type if job is not None else ""
        return self._gpu_types[job_id]

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
        """One ``scontrol update`` for the resize and the pool (partition, GPU type) and the nodes it may
        not use: Slurm applies it as a whole or not at all. ``gpu_type`` None keeps the job's type; ""
        makes it untyped. ``exclude_nodes`` () clears the job's ``ExcNodeList`` (seen live on 22.05.8)."""
        jid = self._jid(job_id)
        check_pool_args(job_id, partition, gpu_type)
        if exclude_nodes is not None and not all(isinstance(n, str) and _NODE_RE.fullmatch(n) for n in exclude_nodes):
            raise ValueError(f"job {job_id}: exclude_nodes must be Slurm node names, got {exclude_nodes!r}")
        resize: list[str] = []
        clear_first = False
        if gpu_type is not None and gpus_per_node is None:
            gpus_per_node = self._current_gpus_per_node(job_id)
        if gpus_per_node is not None:
            if gpus_per_node < 1:
                raise ValueError(f"job {job_id}: gpus_per_node must be >= 1, got {gpus_per_node}")
            old = self.current_gpu_type(job_id)
            kind = old if gpu_type is None else gpu_type
            if "," in kind:
                raise ValueError(f"job {job_id}: it asks for several GPU types ({kind}); resizing it would drop some")
            if self.version_tuple() < (23, 11, 0) and old != kind:
                # 22.05 (seen live on 22.05.8): untyped -> typed is refused in one update ("Invalid GRES
                # specification (with and without type identification)") and works after clearing
                # TresPerNode. A job that has had a type cannot leave it: typed -> untyped leaves it
                # with no GPU at all, and typed -> another type is accepted but the job stays pending
                # forever (BadConstraints). Both are refused here, before any change.
                if old:
                    raise SlurmError(f"job {job_id} asks for {old} GPUs; Slurm {self.version()} cannot move a "
                                     f"typed job to {kind or 'untyped'} GPUs (it would never start): it stays on {old}")
                clear_first = True
            resize.append(f"TresPerNode={self.gres_request(gpus_per_node, kind)}")
        if num_nodes is not None:
            if num_nodes < 1:
                raise ValueError(f"job {job_id}: num_nodes must be >= 1, got {num_nodes}")
            resize.append(f"NumNodes={num_nodes}-{num_nodes}")
        if num_tasks is not None:
            if num_tasks < 1:
                raise ValueError(f"job {job_id}: num_tasks must be >= 1, got {num_tasks}")
            # NumTasks alone leaves the job one CPU, and srun then refuses to start the tasks
            # ("More processors requested than permitted"): ask for one CPU per task as well.
            per_node = -(-num_tasks // (num_nodes or 1))
            resize += [f"NumTasks={num_tasks}", f"MinCPUsNode={per_node}", f"NumCPUs={num_tasks}"]
        if partition is not None:
            # Last, after TresPerNode. 24.11 sometimes answers a partition change with "Resource
            # temporarily unavailable" (seen live, intermittent, in either order): retried as transient.
            resize.append(f"Partition={partition}")
        if exclude_nodes is not None:
            resize.append(f"ExcNodeList={','.join(exclude_nodes)}")
        if clear_first:
            self._call("scontrol", ["update", f"JobId={jid}", "TresPerNode="])
        if resize:
            try:
                self._call("scontrol", ["update", f"JobId={jid}", *resize])
            except SlurmError:
                if clear_first:  # never leave the job without GPUs: back to untyped at the asked count
                    self._call("scontrol", ["update", f"JobId={jid}", f"TresPerNode={self.gres_request(gpus_per_node)}"])
                raise
            if gpus_per_node is not None:
                self._gpu_types[job_id] = kind
        if admin_comment is not None:
            if "\n" in admin_comment or len(admin_comment) > 1024:
                raise ValueError(f"job {job_id}: admin comment must be one line of at most 1024 characters")
            self._call("scontrol", ["update", f"JobId={jid}", f"AdminComment={admin_comment}"])
        if start_now:
            # A requeued job otherwise waits cred_expire (120 s by default) before it may start.
            self._call("scontrol", ["update", f"JobId={jid}", "StartTime=now"])

    def _current_gpus_per_node(self, job_id: int) -> int:
        job = self.get_job(job_id)
        if job is None or job.gpus_per_node < 1:
            raise SlurmError(f"job {job_id}: cannot set a GPU type without knowing its GPUs per node")
        return job.gpus_per_node

    def submit_lease(self, name: str, partition: str | None, admin_comment: str) -> int:
        args = ["--parsable", "--hold", f"--job-name={name}", "--output=/dev/null", "--chdir=/", "--ntasks=1",
                "--no-requeue", "--time=1", "--wrap=true"]
        if partition:
            args.append(f"--partition={partition}")
        out = self._call("sbatch", args, retry=False)
        try:
            jid = int(out.strip().split(";")[0])
        except ValueError as e:
            raise SlurmParseError(f"sbatch printed no job id: {out[:80]!r}", argv=["sbatch", *args]) from e
        self._call("scontrol", ["update", f"JobId={jid}", f"AdminComment={admin_comment}"])
        return jid

    def cancel_lease(self, job_id: int) -> None:
        self._call("scancel", [self._jid(job_id)])

    def signal(self, job_id: int, signal: str = "USR2", *, batch_only: bool = False) -> None:
        sig = signal.upper()
        if not _SIGNAL_RE.fullmatch(sig):
            raise ValueError(f"not a signal name: {signal!r}")
        args = [f"--signal={sig}"]
        if batch_only:
            args.append("--batch")
        self._call("scancel", [*args, self._jid(job_id)])


def attach_reservations(nodes: list[NodeRecord], reservations: dict[str, tuple[str, ...]]) -> list[NodeRecord]:
    """Each node with the active reservations covering it (merged with any the node record names)."""
    import dataclasses

    out = []
    for n in nodes:
        names = tuple(dict.fromkeys((*n.reservations, *reservations.get(n.name, ()))))
        out.append(dataclasses.replace(n, reservations=names) if names != n.reservations else n)
    return out
