#!/usr/bin/env python3
"""Test driver: the real daemon (``Daemon.open/run_forever``, as ``slurm-elastic daemon`` runs it) that
SIGKILLs itself right after one named step of one job's resize. Used by tests/faults only.

    python tests/faults/fault_daemon.py --config F --fault STEP --job JOBID --marker FILE

STEP is one of ``signal`` (the USR2 went out), ``ack`` (the job's checkpoint ack was seen),
``requeue_hold``, ``update``, ``release`` (each after Slurm answered). Before the kill the driver writes
``FILE`` (JSON: fault, job, pid) so that the test knows the fault fired and was not skipped. Nothing
here is used by the product; the product's ``daemon`` command has no fault hook.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from slurm_elastic.backends.cli import CliBackend  # noqa: E402
from slurm_elastic.daemon.acks import CheckpointDirAck  # noqa: E402
from slurm_elastic.daemon.config import load_config  # noqa: E402
from slurm_elastic.daemon.loop import Daemon, setup_logging  # noqa: E402

STEPS = ("signal", "ack", "requeue_hold", "update", "release")


class Fault:
    def __init__(self, step: str, job: int, marker: Path):
        self.step, self.job, self.marker = step, job, marker

    def after(self, step: str, job_id) -> None:
        if step != self.step or int(job_id) != self.job:
            return
        tmp = self.marker.with_suffix(".tmp")
        tmp.write_text(json.dumps({"fault": f"after:{step}", "job": self.job, "pid": os.getpid(), "ts": time.time()}))
        os.replace(tmp, self.marker)
        print(f"FAULT: SIGKILL after {step} of job {job_id}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


class FaultBackend(CliBackend):
    fault: Fault

    def signal(self, job_id, signal="USR2", *, batch_only=False):
        super().signal(job_id, signal, batch_only=batch_only)
        self.fault.after("signal", job_id)

    def requeue_hold(self, job_id, **kw):
        super().requeue_hold(job_id, **kw)
        self.fault.after("requeue_hold", job_id)

    def update_job(self, job_id, **kw):
        super().update_job(job_id, **kw)
        self.fault.after("update", job_id)

    def release(self, job_id):
        super().release(job_id)
        self.fault.after("release", job_id)


class FaultAck(CheckpointDirAck):
    fault: Fault

    def checkpoint_acked(self, job_id):
        acked = super().checkpoint_acked(job_id)
        if acked:
            self.fault.after("ack", job_id)
        return acked


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--fault", required=True, choices=STEPS)
    ap.add_argument("--job", required=True, type=int)
    ap.add_argument("--marker", required=True)
    args = ap.parse_args()
    cfg = load_config(args.config)
    setup_logging(cfg.log_level)
    fault = Fault(args.fault, args.job, Path(args.marker))
    backend = FaultBackend(bin_dir=cfg.slurm_bin, timeout=cfg.slurm_timeout_s)
    backend.fault = fault
    d = Daemon(cfg, backend=backend, config_path=args.config)
    ack = FaultAck(lambda: d.records)
    ack.fault = fault
    d.ack = ack
    d.open()
    try:
        d.install_signals()
        d.run_forever()
    finally:
        d.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
