"""One rank 0 per checkpoint directory: an ``flock`` held by rank 0 for the life of the process.

Several processes that each believe they are "rank 0 of 1" (a multi-process launch whose rank
variables were lost, the same script started twice) would write the same checkpoint and ack files
and corrupt each other's progress. The lock makes the second one fail loudly, naming the holder. It
is released when the process exits (also on SIGKILL), so a requeued job's next start takes it over;
a short wait covers a previous start that is still exiting. Torch-free.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

LOCK_NAME = ".rank0.lock"


class CheckpointDirBusy(RuntimeError):
    """Another live process is rank 0 for this checkpoint directory."""


def acquire_rank0_lock(ckpt_dir: str | os.PathLike, *, wait_s: float = 10.0, what: str = "") -> int:
    """Take the directory's rank-0 lock (non-blocking, retried for ``wait_s``); returns the open fd."""
    path = Path(ckpt_dir) / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() >= deadline:
                try:
                    holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
                except ValueError:
                    holder = {}
                os.close(fd)
                raise CheckpointDirBusy(
                    f"{path}: another process is already rank 0 for this checkpoint directory "
                    f"(pid {holder.get('pid', '?')} on {holder.get('host', '?')}, job {holder.get('job', '?')}). "
                    "Several processes each think they are rank 0 of their own world: launch with srun "
                    "(one task per GPU) or torchrun so they form one world, or give each run its own "
                    f"checkpoint directory.{(' ' + what) if what else ''}") from None
            time.sleep(0.2)
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "job": what,
                              "time": time.time()}).encode(), 0)
    return fd


def release_rank0_lock(fd: int | None) -> None:
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
