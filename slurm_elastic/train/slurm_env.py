"""What a task learns about itself from Slurm: its place in the step (env) and its job record.

Torch-free. ``SlurmEnv.from_environ()`` reads what ``srun`` exports to each task; outside Slurm it
describes a single local process (rank 0 of 1). ``read_job_record(job_id)`` asks Slurm for the job's
``Comment`` (the user's elastic spec) and ``AdminComment`` (the daemon's decision): first
``scontrol show job <id>`` (text; every version has it, 22.05 has no ``--json`` for scontrol), then
``squeue --json`` (filtered here, as 22.05 ignores filters with ``--json``). Slurm is called with argv
lists and a timeout only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from .hostlist import HostlistError, expand_hostlist

SLURM_CALL_TIMEOUT_S = 30.0


class JobRecordError(RuntimeError):
    """The job's own Slurm record could not be read."""


def _int_env(env: Mapping[str, str], name: str, default: int | None) -> int | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        return int(raw.strip())
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


@dataclass(frozen=True)
class SlurmEnv:
    """One task's view of its job step (SLURM_* variables set by srun)."""

    job_id: str | None  # None outside Slurm
    rank: int
    local_rank: int
    world_size: int
    nodes: tuple[str, ...]
    num_nodes: int
    restart_count: int
    step_id: str
    node_name: str
    launcher: str = "srun"  # "srun", "torchrun" (RANK/WORLD_SIZE given) or "local" (neither)

    @property
    def in_slurm(self) -> bool:
        return self.job_id is not None

    @property
    def first_node(self) -> str:
        return self.nodes[0] if self.nodes else "127.0.0.1"

    @classmethod
    def from_environ(cls, env: Mapping[str, str] | None = None) -> SlurmEnv:
        env = os.environ if env is None else env
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        rank = _int_env(env, "SLURM_PROCID", 0)
        world = _int_env(env, "SLURM_NTASKS", None)
        if world is None:
            world = _int_env(env, "SLURM_NPROCS", 1)
        local = _int_env(env, "SLURM_LOCALID", 0)
        restart = _int_env(env, "SLURM_RESTART_COUNT", 0)
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"SLURM_PROCID={rank} is not a rank of SLURM_NTASKS={world}")
        launcher = "srun" if env.get("SLURM_STEP_ID") is not None and env.get("SLURM_PROCID") is not None else "local"
        if env.get("RANK") is not None and env.get("WORLD_SIZE") is not None:
            rank, world, local, launcher = _torchrun_place(env, world if launcher == "srun" else None)
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        nodes: tuple[str, ...] = ()
        if nodelist:
            try:
                nodes = tuple(expand_hostlist(nodelist))
            except HostlistError as e:
                raise ValueError(f"cannot expand the job's node list {nodelist!r}: {e}") from None
        num_nodes = _int_env(env, "SLURM_STEP_NUM_NODES", None) or _int_env(env, "SLURM_JOB_NUM_NODES", None)
        if num_nodes is None:
            num_nodes = _int_env(env, "SLURM_NNODES", len(nodes) or 1)
        return cls(
            job_id=job_id,
            rank=rank,
            local_rank=local,
            world_size=world,
            nodes=nodes,
            num_nodes=num_nodes,
            restart_count=restart,
            step_id=env.get("SLURM_STEP_ID", "0") or "0",
            node_name=env.get("SLURMD_NODENAME", "") or "",
            launcher=launcher,
        )


class LaunchError(ValueError):
    """The processes of this training were launched inconsistently (they would not form one world)."""


def _torchrun_place(env: Mapping[str, str], srun_tasks: int | None) -> tuple[int, int, int, str]:
    """``(rank, world, local_rank, "torchrun")`` from torchrun's variables, checked against srun's.

    Under ``srun ... torchrun --nproc_per_node=K`` each srun task is one torchrun agent: the world is
    ``SLURM_NTASKS x K``. A torchrun world that does not span all srun tasks (each agent started
    standalone) would make several independent jobs write one checkpoint: refuse it.
    """
    rank = _int_env(env, "RANK", 0)
    world = _int_env(env, "WORLD_SIZE", 1)
    local = _int_env(env, "LOCAL_RANK", 0)
    if world < 1 or not 0 <= rank < world:
        raise LaunchError(f"RANK={rank} is not a rank of WORLD_SIZE={world}")
    lws = _int_env(env, "LOCAL_WORLD_SIZE", None)
    if lws is not None and not 0 <= local < lws:
        raise LaunchError(f"LOCAL_RANK={local} is not a rank of LOCAL_WORLD_SIZE={lws}")
    if srun_tasks is not None and lws is not None and srun_tasks * lws != world:
        raise LaunchError(
            f"inconsistent launch: srun started {srun_tasks} task(s) (SLURM_NTASKS) each running "
            f"{lws} process(es) (LOCAL_WORLD_SIZE), but WORLD_SIZE={world}; give torchrun "
            f"--nnodes={srun_tasks} and a shared --rdzv-endpoint, or launch with srun alone")
    return rank, world, local, "torchrun"


# --------------------------------------------------------------------------------------------------
# The job's own record


@dataclass(frozen=True)
class JobRecordText:
    """The fields of a job's record the training library needs."""

    job_id: str
    comment: str
    admin_comment: str
    source: str  # "scontrol" or "squeue-json"


_KEY_RE = re.compile(r"(?:(?<=\s)|^)([A-Za-z][A-Za-z0-9_:/]*)=")


def parse_scontrol_show_job(text: str) -> dict[str, str]:
    """Parse ``scontrol show job`` text (multi-line or ``-o`` one-liner) into ``{Key: value}``.

    ``Comment`` and ``AdminComment`` sit on lines of their own in the multi-line form, so their value is
    the rest of the line (it may contain '=' and even spaces). Other keys are split at the next
    ``<space>Key=``. Only the first job of the text is read.
    """
    out: dict[str, str] = {}
    whole_line = ("Comment", "AdminComment", "Command", "WorkDir", "StdOut", "StdErr", "StdIn")
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            if out:
                break  # a blank line ends the first job
            continue
        key0, sep, rest = line.partition("=")
        if sep and key0 in whole_line and "JobId" in out:
            out.setdefault(key0, rest.rstrip())
            continue
        matches = list(_KEY_RE.finditer(line))
        for i, m in enumerate(matches):
            end = matches[i + 1].start() if i + 1 < len(matches) else len(line)
            key = m.group(1)
            if key == "JobId" and "JobId" in out:
                return out  # a second job in the text
            out.setdefault(key, line[m.end():end].strip())
    return out


def _run(argv: list[str], timeout: float, env: Mapping[str, str] | None) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, check=False, env=dict(env) if env is not None else None
    )


def read_job_record(
    job_id: str | int, *, timeout: float = SLURM_CALL_TIMEOUT_S, env: Mapping[str, str] | None = None
) -> JobRecordText:
    """The job's Comment and AdminComment from Slurm. Raises :class:`JobRecordError` naming the job."""
    job = str(job_id)
    if not re.fullmatch(r"[0-9]+(_[0-9]+)?", job):
        raise JobRecordError(f"job {job!r}: not a Slurm job id")
    errors: list[str] = []
    path_env = (env or os.environ).get("PATH")
    if shutil.which("scontrol", path=path_env):
        argv = ["scontrol", "show", "job", job]
        try:
            cp = _run(argv, timeout, env)
            if cp.returncode == 0:
                rec = parse_scontrol_show_job(cp.stdout)
                if rec.get("JobId", "").split("_")[0] == job.split("_")[0] or rec.get("JobId") == job:
                    return JobRecordText(job, rec.get("Comment", ""), rec.get("AdminComment", ""), "scontrol")
                errors.append(f"{' '.join(argv)}: record for another job or none: {cp.stdout[:200]!r}")
            else:
                errors.append(f"{' '.join(argv)}: exit {cp.returncode}: {cp.stderr.strip()[:300]}")
        except subprocess.TimeoutExpired:
            errors.append(f"{' '.join(argv)}: no answer in {timeout:g} s")
        except OSError as e:
            errors.append(f"{' '.join(argv)}: {e}")
    if shutil.which("squeue", path=path_env):
        argv = ["squeue", "--json", "--jobs", job.split("_")[0]]
        try:
            cp = _run(argv, timeout, env)
            if cp.returncode == 0:
                data = json.loads(cp.stdout)
                for j in data.get("jobs", []):
                    jid = j.get("job_id")
                    if isinstance(jid, dict):
                        jid = jid.get("number")
                    if str(jid) == job.split("_")[0]:
                        return JobRecordText(
                            job, j.get("comment") or "", j.get("admin_comment") or "", "squeue-json"
                        )
                errors.append(f"{' '.join(argv)}: job not listed")
            else:
                errors.append(f"{' '.join(argv)}: exit {cp.returncode}: {cp.stderr.strip()[:300]}")
        except subprocess.TimeoutExpired:
            errors.append(f"{' '.join(argv)}: no answer in {timeout:g} s")
        except (OSError, ValueError) as e:
            errors.append(f"{' '.join(argv)}: {e}")
    if not errors:
        errors.append("neither scontrol nor squeue is on PATH")
    raise JobRecordError(f"job {job}: cannot read its Slurm record: " + "; ".join(errors))
