"""The stop request: a signal handler that only sets a flag. Torch-free.

Checkpointing inside a signal handler can hang or snapshot a half-done backward pass, so the handler
records the request and returns; :class:`~slurm_elastic.train.job.ElasticJob` looks at the flag at the
next step boundary, where all ranks agree on it with an all-reduce. USR2 is the default (NCCL has used
USR1 for its own purposes). Call :func:`install_stop_handler` as early as possible in the training
script (before importing torch, which takes seconds): a USR2 that arrives earlier kills the process.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterable


class StopFlag:
    """Set by a signal (or by a stop-request file); read by the training loop."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signum: int | None = None
        self.when: float | None = None
        self._installed: dict[int, object] = {}
        self._files: list[str] = []

    def _handler(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        if signum == signal.SIGINT and self._event.is_set():
            raise KeyboardInterrupt  # a second Ctrl-C: abort without waiting for the checkpoint
        if signum in (signal.SIGINT, signal.SIGTERM):
            # Interactive runs (not under Slurm): say what happens (os.write: no buffered I/O in a handler).
            os.write(2, f"slurm-elastic: {signal.Signals(signum).name}: checkpointing after the current step "
                        "and exiting (Ctrl-C again to abort)\n".encode())
        self.signum = signum
        self.when = time.time()
        self._event.set()

    def install(self, signals: Iterable[str | int | signal.Signals] = ("USR2",)) -> None:
        for s in signals:
            num = _signum(s)
            if num in self._installed:
                continue
            self._installed[num] = signal.signal(num, self._handler)

    def quiesce(self) -> None:
        """Ignore further stop signals from now on (the request was taken, or training is over).

        Needed before the process exits: at interpreter shutdown CPython resets signals that have a
        Python handler to SIG_DFL, so a repeated USR2 arriving while a task exits would kill it (exit
        140 instead of 75 or 0). Ignored signals stay ignored through shutdown.
        """
        for num in self._installed:
            signal.signal(num, signal.SIG_IGN)

    def uninstall(self) -> None:
        for num, old in self._installed.items():
            signal.signal(num, old)  # type: ignore[arg-type]
        self._installed.clear()

    def watch_file(self, path: str | os.PathLike) -> None:
        """Also treat the existence of ``path`` as a stop request."""
        self._files.append(os.fspath(path))

    def request(self, reason: str = "api") -> None:
        self.signum = None
        self.when = time.time()
        self._event.set()

    def is_set(self) -> bool:
        if self._event.is_set():
            return True
        for f in self._files:
            if os.path.exists(f):
                self.when = time.time()
                self._event.set()
                return True
        return False

    def clear(self) -> None:
        self._event.clear()
        self.signum = None


def _signum(s: str | int | signal.Signals) -> int:
    if isinstance(s, int):
        return int(s)
    name = str(s).upper()
    if not name.startswith("SIG"):
        name = "SIG" + name
    try:
        return int(getattr(signal, name))
    except AttributeError:
        raise ValueError(f"unknown signal {s!r}") from None


_GLOBAL = StopFlag()


def install_stop_handler(signals: Iterable[str | int] = ("USR2",)) -> StopFlag:
    """Install the process-wide flag handler (idempotent) and return the flag."""
    _GLOBAL.install(signals)
    return _GLOBAL


def global_stop_flag() -> StopFlag:
    return _GLOBAL
