"""A training step that runs out of GPU memory: report the local batch, keep the checkpoint, be requeued.

Why: a per-GPU batch that fits an A100 may not fit a T4, and the spec cannot know every type. When a
step of a start the daemon placed fails with an out-of-memory error, the task that hit it writes
``oom.<job>.<restart>.json`` (its local batch, accumulation, world size, global batch) and the stop
ack of this start, and exits with :data:`~.protocol.EXIT_CHECKPOINTED`: nothing is lost that the last
checkpoint does not hold (no checkpoint is written now: a failed step may have left the optimizer's
state half-updated), ``launch`` waits to be requeued as after a stop, and the daemon learns that this
local batch does not fit on this GPU type, restarts the job below it and never tries it there again.

Not learnable, so re-raised as the failure it is (the crash policy's ``max_failures`` then decides):
an out-of-memory error before this start's batch was chosen, in a start without a daemon decision (the
daemon could not check the claim), or at the spec's ``min_local_batch`` (nothing smaller to try).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from . import protocol

# The job of this process whose start's batch is known (ElasticJob.setup sets it).
_current: Any = None


def register(job: Any) -> None:
    """Make ``job`` the one an out-of-memory error is reported for; installs :func:`excepthook` once,
    for scripts started without ``slurm_elastic.train.run`` (torchrun's workers)."""
    global _current
    _current = job
    if getattr(sys.excepthook, "__module__", "") != __name__:
        previous = sys.excepthook

        def hook(kind, value, tb):
            if handle(value):
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(protocol.EXIT_CHECKPOINTED)  # after an uncaught error: exit with the requeue code
            previous(kind, value, tb)

        hook.__module__ = __name__
        sys.excepthook = hook


def unregister(job: Any) -> None:
    """After ``job`` ended (finished or stopped): an error from here on is not one of its steps."""
    global _current
    if _current is job:
        _current = None


def is_out_of_memory(e: BaseException) -> bool:
    """torch.OutOfMemoryError / torch.cuda.OutOfMemoryError (any class of that name in its MRO, so torch
    need not be imported here), or a RuntimeError whose message says CUDA ran out of memory (older torch,
    and errors that wrap it)."""
    if any(c.__name__ == "OutOfMemoryError" for c in type(e).__mro__):
        return True
    return isinstance(e, RuntimeError) and "CUDA out of memory" in str(e)


def learnable(job: Any) -> str:
    """'' when an out-of-memory error of ``job`` can be reported as a batch limit, else why not."""
    a = getattr(job, "assignment", None)
    if a is None:
        return "before this start's batch was chosen"
    if a.source != "decision" or getattr(job, "senv", None) is None or job.senv.job_id is None:
        return "in a start without a daemon decision (nothing the daemon could check it against)"
    least = getattr(job, "min_local_batch", None) or 1
    if a.local_batch <= least:
        return f"at local batch {a.local_batch}, the smallest the spec allows (min_local_batch={least})"
    return ""


def report(job: Any, e: BaseException) -> None:
    """Write the out-of-memory report and this start's stop ack (any rank may: both are atomic renames
    with the same content on every rank that hits it)."""
    a, senv = job.assignment, job.senv
    what = {"format": protocol.FORMAT, "job_id": str(senv.job_id), "restart_count": senv.restart_count,
            "local_batch": a.local_batch, "accum": a.accum, "world_size": a.world_size,
            "global_batch": a.global_batch, "rank": job.rank, "time": time.time(),
            "error": f"{type(e).__name__}: {e}"[:300]}
    protocol.atomic_write_json(protocol.oom_path(job.ckpt_dir, senv.job_id, senv.restart_count), what)
    ckpt = job.ckpt_dir / protocol.CHECKPOINT_NAME
    protocol.atomic_write_json(protocol.ack_path(job.ckpt_dir, senv.job_id, senv.restart_count), {
        "format": protocol.FORMAT, "job_id": str(senv.job_id), "restart_count": senv.restart_count,
        "checkpoint": str(ckpt) if ckpt.exists() else None, "reason": "out of memory",
        "local_batch": a.local_batch, "time": time.time(), "exit_code": protocol.EXIT_CHECKPOINTED})


def handle(e: BaseException) -> bool:
    """True when ``e`` was a learnable out-of-memory error of the registered job, now reported (the
    caller exits with EXIT_CHECKPOINTED); False leaves ``e`` to fail the task as before."""
    job = _current
    if job is None or not is_out_of_memory(e):
        return False
    why = learnable(job)
    if why:
        _say(job, f"out of memory {why}: not reported as a batch limit; the task fails")
        return False
    try:
        report(job, e)
    except OSError as err:
        _say(job, f"out of memory at local batch {job.assignment.local_batch}, but the report cannot be "
                  f"written ({err}); the task fails")
        return False
    _say(job, f"out of memory at local batch {job.assignment.local_batch} x {job.assignment.accum} accum on "
              f"{job.world_size} GPU(s): reported to the daemon, which restarts the job below that local batch "
              f"from the last checkpoint; exiting with {protocol.EXIT_CHECKPOINTED}")
    return True


def _say(job: Any, msg: str) -> None:
    try:
        job.log(msg, all_ranks=True)
    except Exception:  # the job's logger must not hide the error being handled
        print(f"[slurm-elastic] {msg}", file=sys.stderr, flush=True)
