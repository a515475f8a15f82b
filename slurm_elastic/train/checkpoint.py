"""Atomic checkpoints that survive SIGKILL at any instant, keeping the previous one.

Saving: ``torch.save`` into a temporary file in the checkpoint directory, flush, ``os.fsync``; then the
current checkpoint is hard-linked to ``checkpoint.prev.pt`` (so ``checkpoint.pt`` never disappears),
the temporary file is renamed over ``checkpoint.pt`` with ``os.replace`` and the directory is fsynced.
A kill before the rename leaves the old pair untouched (plus a stale ``.tmp`` file, removed by the next
save); a kill after it leaves the new checkpoint in place.

Loading tries ``checkpoint.pt`` and falls back to ``checkpoint.prev.pt`` if it is missing or unreadable,
always with ``weights_only=True`` (torch 2.13's default), so a checkpoint must hold only tensors and
plain Python containers/numbers/strings; :func:`check_weights_only_safe` catches anything else at save
time instead of at the next start.
"""

from __future__ import annotations

import io
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .protocol import CHECKPOINT_NAME, PREVIOUS_NAME, fsync_dir

_PLAIN = (bool, int, float, str, bytes, type(None), torch.dtype, torch.device, torch.Size)


class CheckpointError(RuntimeError):
    pass


def check_weights_only_safe(obj: Any, path: str = "state") -> None:
    """Raise CheckpointError if ``obj`` holds anything ``torch.load(weights_only=True)`` would refuse."""
    if isinstance(obj, torch.Tensor) or isinstance(obj, _PLAIN):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, _PLAIN):
                raise CheckpointError(f"{path}: key {k!r} of type {type(k).__name__} is not weights_only-safe")
            check_weights_only_safe(v, f"{path}[{k!r}]")
        return
    if isinstance(obj, (list, tuple, set)) and type(obj) in (list, tuple, set):
        for i, v in enumerate(obj):
            check_weights_only_safe(v, f"{path}[{i}]")
        return
    raise CheckpointError(
        f"{path}: {type(obj).__module__}.{type(obj).__qualname__} cannot be loaded with weights_only=True "
        "(store tensors, numbers, strings and plain containers only; no numpy objects)"
    )


class _ProgressWriter(io.RawIOBase):
    """A write-only file wrapper that reports bytes written (for progress logs and fault injection)."""

    def __init__(self, f, on_progress: Callable[[int], None] | None):
        self._f = f
        self._n = 0
        self._cb = on_progress

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        n = self._f.write(b)
        self._n += len(b) if n is None else n
        if self._cb is not None:
            self._cb(self._n)
        return len(b) if n is None else n

    def flush(self) -> None:
        self._f.flush()


def clean_stale_tmp(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Remove temporary files left by a save that was killed. Rank 0 only; returns what it removed."""
    removed = []
    for p in Path(ckpt_dir).glob(f".{CHECKPOINT_NAME}.*.tmp"):
        try:
            p.unlink()
            removed.append(p)
        except OSError:
            pass
    return removed


def save_checkpoint(
    ckpt_dir: str | os.PathLike, state: dict, *, on_progress: Callable[[int], None] | None = None
) -> Path:
    """Write ``state`` atomically as ``<ckpt_dir>/checkpoint.pt``, keeping the previous one."""
    check_weights_only_safe(state)
    d = Path(ckpt_dir)
    d.mkdir(parents=True, exist_ok=True)
    clean_stale_tmp(d)
    final, prev = d / CHECKPOINT_NAME, d / PREVIOUS_NAME
    tmp = d / f".{CHECKPOINT_NAME}.{os.getpid()}.{time.monotonic_ns()}.tmp"
    try:
        with open(tmp, "wb") as f:
            torch.save(state, _ProgressWriter(f, on_progress))
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            link = d / f".{PREVIOUS_NAME}.{os.getpid()}.link"
            try:
                if link.exists():
                    link.unlink()
                os.link(final, link)
                os.replace(link, prev)
            except OSError:
                # No hard links here: fall back to a rename (for an instant only prev exists; the loader
                # falls back to it).
                os.replace(final, prev)
        os.replace(tmp, final)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
    fsync_dir(d)
    return final


def load_checkpoint(ckpt_dir: str | os.PathLike, *, path: str | os.PathLike | None = None) -> tuple[dict, Path] | None:
    """``(state, path)`` of the newest readable checkpoint, or None if there is none at all.

    Raises CheckpointError when checkpoint files exist but none can be read: starting from scratch
    would silently throw the job's progress away.
    """
    d = Path(ckpt_dir)
    candidates = [Path(path)] if path is not None else [d / CHECKPOINT_NAME, d / PREVIOUS_NAME]
    errors = []
    for p in candidates:
        if not p.exists():
            continue
        try:
            state = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unreadable file falls through to the previous one
            errors.append(f"{p}: {type(e).__name__}: {str(e)[:200]}")
            print(f"slurm-elastic: checkpoint {p} is unreadable ({type(e).__name__}); trying the previous one",
                  file=sys.stderr, flush=True)
            continue
        if not isinstance(state, dict) or "format" not in state:
            errors.append(f"{p}: not a slurm-elastic checkpoint")
            continue
        return state, p
    if errors:
        raise CheckpointError("no readable checkpoint: " + "; ".join(errors))
    return None
