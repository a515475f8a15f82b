"""The files a training job leaves in its checkpoint directory for the daemon. Torch-free.

Everything the daemon needs from a running job goes through the job's checkpoint directory (shared by
all nodes of the job, since rank 0 of the next start may run elsewhere). Names carry the job id and
``SLURM_RESTART_COUNT`` so a file from an earlier start is never mistaken for the current one:

``checkpoint.pt`` / ``checkpoint.prev.pt``
    the latest and the previous checkpoint (torch.save, loadable with ``weights_only=True``).
``stop-ack.<job>.<restart>.json``
    written by rank 0 after the checkpoint of a stop request is on disk (fsynced and renamed): from
    then on the job may be requeued without losing work. All ranks then exit with
    :data:`EXIT_CHECKPOINTED`.
``stop-request.<job>.<restart>``
    optional; the batch shell's USR2 trap (templates) creates it, so a stop asked for before the
    Python tasks installed their handlers is not lost. The tasks treat it like the signal.
``throughput.json``
    the job's report: samples/s per (world size, global batch), warm-up steps dropped, merged over all
    starts; ``noise_scale`` (the smoothed gradient noise scale, samples; null until measured) and
    ``base_batch`` (the batch the lr is meant for, where efficiency is 1); ``starts``: per restart,
    the wall time of its first training step (and of the stop before it), for the restart cost.
``done.<job>.json``
    training finished (all epochs); the job exits 0.
``oom.<job>.<restart>.json``
    a training step of this start ran out of GPU memory at its local batch (see :mod:`.oom`); written with
    the stop ack (the last checkpoint is what the next start resumes from), the tasks then exit with
    :data:`EXIT_CHECKPOINTED`. The daemon checks it against the decision of that start (:func:`parse_oom`).
``rendezvous/<job>.<restart>.<step>.json``
    rank 0's address and TCP port for this start (see :mod:`slurm_elastic.train.dist`).

This module only reads and writes those files, so the daemon can import it without torch:
``from slurm_elastic.train.protocol import read_ack, read_throughput``.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

FORMAT = 1
# Exit code of every task (and, through srun, of the step) after a stop request was checkpointed.
# 75 is EX_TEMPFAIL in sysexits.h: "temporary failure, the user is invited to retry".
EXIT_CHECKPOINTED = 75
CHECKPOINT_NAME = "checkpoint.pt"
PREVIOUS_NAME = "checkpoint.prev.pt"
THROUGHPUT_NAME = "throughput.json"


def ack_path(ckpt_dir: str | os.PathLike, job_id: str | int, restart_count: int) -> Path:
    return Path(ckpt_dir) / f"stop-ack.{job_id}.{restart_count}.json"


def stop_request_path(ckpt_dir: str | os.PathLike, job_id: str | int, restart_count: int) -> Path:
    return Path(ckpt_dir) / f"stop-request.{job_id}.{restart_count}"


def oom_path(ckpt_dir: str | os.PathLike, job_id: str | int, restart_count: int) -> Path:
    return Path(ckpt_dir) / f"oom.{job_id}.{restart_count}.json"


def done_path(ckpt_dir: str | os.PathLike, job_id: str | int) -> Path:
    return Path(ckpt_dir) / f"done.{job_id}.json"


def throughput_path(ckpt_dir: str | os.PathLike) -> Path:
    return Path(ckpt_dir) / THROUGHPUT_NAME


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory so a rename in it survives a power loss (no-op where unsupported)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` via a temporary file in the same directory, fsync, os.replace."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp makes the file 0600; give it the mode a plain open() would (the daemon may run as
        # another user than the job and must read the ack and throughput files).
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def _read_json(path: Path) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_ack(ckpt_dir: str | os.PathLike, job_id: str | int, restart_count: int) -> dict | None:
    """The stop acknowledgement of this (job, restart), or None if the checkpoint is not safe yet."""
    data = _read_json(ack_path(ckpt_dir, job_id, restart_count))
    if data is None or str(data.get("job_id")) != str(job_id) or data.get("restart_count") != restart_count:
        return None
    return data


def read_done(ckpt_dir: str | os.PathLike, job_id: str | int) -> dict | None:
    return _read_json(done_path(ckpt_dir, job_id))


def read_throughput(ckpt_dir: str | os.PathLike) -> list[dict]:
    """Measured points ``[{"gpus", "batch", "samples_per_s", "steps", "seconds", ...}]`` (may be empty)."""
    data = _read_json(throughput_path(ckpt_dir))
    if not data or not isinstance(data.get("points"), list):
        return []
    return [p for p in data["points"] if isinstance(p, dict) and {"gpus", "batch", "samples_per_s"} <= set(p)]


MAX_STARTS = 32  # start records kept in the report


def merge_throughput(
    ckpt_dir: str | os.PathLike, job_id: str | int | None, gpus: int, batch: int, samples: int, seconds: float,
    steps: int, *, noise_scale: float | None = None, base_batch: int | None = None, start: dict | None = None,
    samples_seen: int | None = None, total_samples: int | None = None,
) -> dict | None:
    """Fold a new measurement into ``throughput.json`` (time-weighted per (gpus, batch)); rank 0 only.

    Also sets ``noise_scale``/``base_batch`` (when given), the job's progress (``samples_seen`` so far,
    ``total_samples`` it will train on when it knows: dataset size x epochs) and adds or replaces the
    ``start`` record of its ``restart_count``. Returns the updated point, or None when there was no new
    measurement."""
    old = _read_json(throughput_path(ckpt_dir)) or {}
    points = {(p["gpus"], p["batch"]): dict(p) for p in read_throughput(ckpt_dir)}
    p = None
    if seconds > 0 and samples > 0 and steps > 0:
        key = (int(gpus), int(batch))
        p = points.get(key, {"gpus": key[0], "batch": key[1], "samples": 0, "seconds": 0.0, "steps": 0})
        p["samples"] = int(p.get("samples", 0)) + int(samples)
        p["seconds"] = float(p.get("seconds", 0.0)) + float(seconds)
        p["steps"] = int(p.get("steps", 0)) + int(steps)
        p["samples_per_s"] = p["samples"] / p["seconds"]
        p["updated"] = time.time()
        points[key] = p
    elif noise_scale is None and start is None:
        return None
    starts = [s for s in old.get("starts", []) if isinstance(s, dict)] if isinstance(old.get("starts"), list) else []
    if start is not None:
        starts = [s for s in starts if s.get("restart_count") != start.get("restart_count")] + [dict(start)]
        starts = starts[-MAX_STARTS:]
    ns = noise_scale if noise_scale is not None else old.get("noise_scale")
    out = {"format": FORMAT, "job_id": None if job_id is None else str(job_id),
           "points": [points[k] for k in sorted(points)], "starts": starts,
           "noise_scale": ns if isinstance(ns, (int, float)) and math.isfinite(ns) else None,
           "base_batch": base_batch if base_batch is not None else old.get("base_batch"),
           "samples_seen": samples_seen if samples_seen is not None else old.get("samples_seen"),
           "total_samples": total_samples if total_samples is not None else old.get("total_samples")}
    atomic_write_json(throughput_path(ckpt_dir), out)
    return p


def _finite(v, lo: float, hi: float) -> float | None:
    """``v`` as a float when it is a finite number in [lo, hi] (not a bool), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) and lo <= v <= hi else None


# Plausibility bounds for what a job reports (it is user-controlled).
MAX_NOISE_SCALE = 1e12
MAX_BATCH = 1 << 31
MAX_SAMPLES = 1e15


def read_report(ckpt_dir: str | os.PathLike) -> dict:
    """The job's report in one read: ``{"points", "noise_scale", "base_batch", "starts", "samples_seen",
    "total_samples"}`` (points as
    :func:`read_throughput` gives them; the daemon checks their numbers), the others checked
    (finite, in range; a start needs an int ``restart_count`` >= 0 and a finite ``first_step``);
    what fails a check is dropped (None / left out), never guessed."""
    return parse_report(_read_json(throughput_path(ckpt_dir)) or {})


def parse_report(data: dict) -> dict:
    """:func:`read_report` on an already-read report (the daemon reads it through its safe reader)."""
    points = data.get("points") if isinstance(data.get("points"), list) else []
    points = [p for p in points if isinstance(p, dict) and {"gpus", "batch", "samples_per_s"} <= set(p)]
    ns = _finite(data.get("noise_scale"), 0.0, MAX_NOISE_SCALE)
    bb = data.get("base_batch")
    bb = int(bb) if isinstance(bb, int) and not isinstance(bb, bool) and 1 <= bb <= MAX_BATCH else None
    starts = []
    raw = data.get("starts")
    for s in raw[:MAX_STARTS * 2] if isinstance(raw, list) else []:
        if not isinstance(s, dict):
            continue
        r = s.get("restart_count")
        first = _finite(s.get("first_step"), 0.0, 1e11)
        if not isinstance(r, int) or isinstance(r, bool) or r < 0 or first is None:
            continue
        starts.append({"restart_count": r, "first_step": first, "stop": _finite(s.get("stop"), 0.0, 1e11)})
    seen = _finite(data.get("samples_seen"), 0.0, MAX_SAMPLES)
    total = _finite(data.get("total_samples"), 1.0, MAX_SAMPLES)
    return {"points": points, "noise_scale": ns, "base_batch": bb, "starts": starts, "samples_seen": seen,
            "total_samples": total}


MAX_WORLD = 1 << 20


def _count(v, hi: int) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= hi else None


def parse_oom(data, job_id: str | int, restart_count: int) -> dict | None:
    """An out-of-memory report (``oom.<job>.<restart>.json``) as ``{"local_batch", "accum",
    "world_size", "global_batch"}``, or None unless it is for this job and start and every count is an
    int in range (a bool, float or string is refused, never rounded). It is the job's claim: the daemon
    also checks it against the decision it gave that start."""
    if not isinstance(data, dict) or str(data.get("job_id")) != str(job_id):
        return None
    rc = data.get("restart_count")
    if not isinstance(rc, int) or isinstance(rc, bool) or rc != restart_count:  # 2.0 is not a count either
        return None
    out = {"local_batch": _count(data.get("local_batch"), MAX_BATCH), "accum": _count(data.get("accum"), MAX_BATCH),
           "world_size": _count(data.get("world_size"), MAX_WORLD),
           "global_batch": _count(data.get("global_batch"), MAX_BATCH)}
    return out if None not in out.values() else None
