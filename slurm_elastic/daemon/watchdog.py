"""No single stall stops the daemon: systemd's watchdog (sd_notify) and an internal one.

- :func:`sd_notify` sends ``READY=1`` / ``WATCHDOG=1`` / ``STOPPING=1`` to systemd's ``NOTIFY_SOCKET``
  (a datagram socket; no dependency). The unit is ``Type=notify`` with ``WatchdogSec``: if the main
  thread stops making progress, systemd kills and restarts the daemon. Pings come only from the main
  thread's progress, never from a timer, so a hung cycle is not masked.
- :class:`Watchdog` does the same without systemd: a thread that ends the process when no progress was
  made for ``limit_s`` (exit 70, so ``Restart=on-failure`` restarts it), or when a requested stop has
  not finished within ``stop_grace_s`` (exit 0). Ending the process mid-step is safe: every step is
  journalled before it is taken and ``reconcile`` finishes or rolls it back at the next start (the fault
  suite kills the daemon after every step of a resize).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time

log = logging.getLogger("slurm_elastic.daemon")
EXIT_STUCK = 70  # EX_SOFTWARE


def sd_notify(message: str) -> bool:
    """Send one notification to systemd; False (and nothing else) when not run by systemd."""
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.settimeout(1.0)
            s.sendto(message.encode(), addr)
        return True
    except OSError:
        return False


class Watchdog:
    def __init__(self, limit_s: float, stop_grace_s: float = 30.0, *, exit=os._exit, clock=time.monotonic):
        self.limit_s = limit_s
        self.stop_grace_s = stop_grace_s
        self._exit = exit
        self._clock = clock
        self.last = clock()
        self.phase = "start"
        self.stop_at: float | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def progress(self, phase: str) -> None:
        """The main thread is alive and about to do ``phase``."""
        self.last = self._clock()
        self.phase = phase
        sd_notify("WATCHDOG=1")

    def stop_requested(self) -> None:
        if self.stop_at is None:
            self.stop_at = self._clock()

    def check(self) -> int | None:
        """The exit code to end with now, or None."""
        now = self._clock()
        if self.stop_at is not None and now - self.stop_at > self.stop_grace_s:
            self._say(f"stop asked {now - self.stop_at:.0f} s ago but '{self.phase}' has not finished; exiting "
                      "now (open intents are finished at the next start)")
            return 0
        if self.limit_s > 0 and now - self.last > self.limit_s:
            self._say(f"no progress for {now - self.last:.0f} s in '{self.phase}' (watchdog_s {self.limit_s:g}); "
                      "exiting so that the daemon is restarted")
            return EXIT_STUCK
        return None

    def _say(self, text: str) -> None:
        log.error("watchdog", extra={"kv": {"error": text}})
        for h in logging.getLogger("slurm_elastic").handlers:
            try:
                h.flush()
            except Exception:
                pass
        sys.stderr.flush()

    def start(self) -> None:
        def run():
            while not self._done.wait(1.0):
                code = self.check()
                if code is not None:
                    self._exit(code)
                    return

        self._thread = threading.Thread(target=run, name="slurm-elastic-watchdog", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._done.set()
