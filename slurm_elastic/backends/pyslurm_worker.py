"""The pyslurm backend in a child process, spoken to over a pipe (one JSON object per line).

Why: pyslurm is built against one libslurm and initialises it from ``SLURM_CONF`` once per process.
A process that must talk to another cluster, or to another Slurm version (the 24.11 cluster in the
trixie chroot, whose pyslurm is built for the chroot's Python 3.13 and libslurm), runs the real
:class:`PyslurmBackend` in a worker: ``python -m slurm_elastic.backends.pyslurm_worker`` on the host,
or the same inside the chroot with a copy of this package (:func:`chroot_worker_argv`). Every call,
the requeue-hold wait included, runs in the worker against its slurmctld; typed errors come back
typed. The tests and the benchmark use it; the daemon uses :class:`PyslurmBackend` in process.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from slurm_elastic.backends.base import (
    JobNotRequeueable,
    JobRecord,
    NodeRecord,
    PartitionRecord,
    SlurmBackend,
    SlurmError,
    SlurmParseError,
    SlurmTimeout,
)

ERRORS = {c.__name__: c for c in (SlurmError, SlurmTimeout, SlurmParseError, JobNotRequeueable)}
CALLS = ("list_jobs", "list_nodes", "get_job", "hold", "release", "requeue_hold", "update_job", "signal",
         "version", "pyslurm_version", "submit_lease", "cancel_lease",
         "requeue_failed", "list_partitions", "slurm_config")


def _encode(value):
    if isinstance(value, (JobRecord, NodeRecord, PartitionRecord)):
        return {"__record__": type(value).__name__, **dataclasses.asdict(value)}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    return value


def _decode(value):
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict) and "__record__" in value:
        cls = {"JobRecord": JobRecord, "NodeRecord": NodeRecord, "PartitionRecord": PartitionRecord}[value.pop("__record__")]
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in value.items()})
    return value


def serve(backend, stdin=sys.stdin, stdout=sys.stdout) -> None:
    """Answer calls until stdin closes: {"call", "args", "kwargs"} -> {"ok"} | {"error"}."""
    for line in stdin:
        try:
            req = json.loads(line)
            if req.get("call") not in CALLS:
                raise ValueError(f"unknown call {req.get('call')!r}")
            result = {"ok": _encode(getattr(backend, req["call"])(*req.get("args", []), **req.get("kwargs", {})))}
        except SlurmError as e:
            result = {"error": {"type": type(e).__name__, "message": str(e), "argv": e.argv,
                                "returncode": e.returncode, "stderr": e.stderr}}
        except (ValueError, TypeError) as e:
            result = {"error": {"type": "ValueError", "message": str(e)}}
        stdout.write(json.dumps(result) + "\n")
        stdout.flush()


def chroot_worker_argv(root: str | os.PathLike, python: str = "/usr/bin/python3") -> tuple[list[str], dict]:
    """argv and extra env for a worker inside the chroot at ``root``: this package is copied (once
    per content) to ``<root>/srv/slurm-elastic/pkg-<hash>``, which the chroot's Python imports."""
    src = Path(__file__).resolve().parent.parent  # the slurm_elastic package
    files = sorted(p for p in src.rglob("*.py") if "__pycache__" not in p.parts)
    digest = hashlib.sha256()
    for p in files:
        digest.update(str(p.relative_to(src)).encode() + b"\0" + p.read_bytes())
    inner = f"/srv/slurm-elastic/pkg-{digest.hexdigest()[:12]}"
    dest = Path(root) / inner.lstrip("/")
    if not (dest / "slurm_elastic" / "__init__.py").exists():
        tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        for p in files:
            target = tmp / "slurm_elastic" / p.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, target)
        try:
            os.replace(tmp, dest)
        except OSError:  # another process made it first
            shutil.rmtree(tmp, ignore_errors=True)
    return ["chroot", str(root), python, "-m", "slurm_elastic.backends.pyslurm_worker"], {"PYTHONPATH": inner}


class PyslurmWorker(SlurmBackend):
    """A :class:`SlurmBackend` whose every call runs in a pyslurm worker process (started here)."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], *, timeout: float = 300.0):
        self.argv = list(argv)
        self.timeout = timeout
        self._err = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: a chatty worker never blocks
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, env={**os.environ, **env}, text=True)
        self._buf = ""

    @classmethod
    def for_host(cls, slurm_conf: str, bin_dir: str = "/usr/bin") -> PyslurmWorker:
        return cls([sys.executable, "-m", "slurm_elastic.backends.pyslurm_worker", "--bin", bin_dir],
                   {"SLURM_CONF": slurm_conf})

    @classmethod
    def for_chroot(cls, root: str | os.PathLike, slurm_conf: str, bin_dir: str = "/usr/bin") -> PyslurmWorker:
        argv, env = chroot_worker_argv(root)
        return cls([*argv, "--bin", bin_dir], {**env, "SLURM_CONF": slurm_conf})

    def _readline(self) -> str:
        deadline = time.monotonic() + self.timeout
        fd = self.proc.stdout.fileno()
        while "\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise SlurmTimeout(f"the pyslurm worker did not answer within {self.timeout:.0f} s", argv=self.argv)
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 1 << 20).decode(errors="replace")
                if not chunk:
                    self.proc.wait(timeout=10)
                    raise SlurmError("the pyslurm worker exited", argv=self.argv, returncode=self.proc.returncode,
                                     stderr=self.stderr())
                self._buf += chunk
        line, self._buf = self._buf.split("\n", 1)
        return line

    def _call(self, name: str, *args, **kwargs):
        if self.proc.poll() is not None:
            raise SlurmError("the pyslurm worker is not running", argv=self.argv, returncode=self.proc.returncode,
                             stderr=self.stderr())
        self.proc.stdin.write(json.dumps({"call": name, "args": list(args), "kwargs": kwargs}) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(self._readline())
        if "error" in answer:
            e = answer["error"]
            if e["type"] == "ValueError":
                raise ValueError(e["message"])
            err = ERRORS.get(e["type"], SlurmError).__new__(ERRORS.get(e["type"], SlurmError))
            RuntimeError.__init__(err, e["message"])
            err.argv, err.returncode, err.stderr = e.get("argv") or [], e.get("returncode"), e.get("stderr") or ""
            raise err
        return _decode(answer["ok"])

    def stderr(self) -> str:
        """The last 2,000 characters the worker wrote to stderr."""
        self._err.seek(0)
        return self._err.read()[-2000:]

    def list_jobs(self, include_finished: bool = False) -> list[JobRecord]:
        return self._call("list_jobs", include_finished=include_finished)

    def get_job(self, job_id: int, include_finished: bool = False) -> JobRecord | None:
        return self._call("get_job", job_id, include_finished=include_finished)

    def list_nodes(self) -> list[NodeRecord]:
        return self._call("list_nodes")

    def list_partitions(self) -> list[PartitionRecord]:
        return self._call("list_partitions")

    def slurm_config(self) -> dict[str, str]:
        return self._call("slurm_config")

    def hold(self, job_id: int) -> None:
        self._call("hold", job_id)

    def release(self, job_id: int) -> None:
        self._call("release", job_id)

    def requeue_hold(self, job_id: int, *, wait: bool = True) -> None:
        self._call("requeue_hold", job_id, wait=wait)

    def update_job(self, job_id: int, **changes) -> None:
        self._call("update_job", job_id, **changes)

    def signal(self, job_id: int, signal: str = "USR2", *, batch_only: bool = False) -> None:
        self._call("signal", job_id, signal, batch_only=batch_only)

    def requeue_failed(self, job_id: int) -> None:
        self._call("requeue_failed", job_id)

    def submit_lease(self, name: str, partition: str | None, admin_comment: str) -> int:
        return self._call("submit_lease", name, partition, admin_comment)

    def cancel_lease(self, job_id: int) -> None:
        self._call("cancel_lease", job_id)

    def version(self) -> str:
        return self._call("version")

    def pyslurm_version(self) -> str:
        return self._call("pyslurm_version")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from slurm_elastic.backends.cli import CliBackend
    from slurm_elastic.backends.pyslurm_backend import PyslurmBackend

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bin", default="/usr/bin", help="where the Slurm tools for the CLI fallback live")
    a = p.parse_args(argv)
    serve(PyslurmBackend(cli=CliBackend(bin_dir=a.bin)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
