"""Pacing: emulated GPUs that take the time a measured profile says, while the real model trains.

Why: on fake GPUs (the local cluster's, a CI box) a small real model runs at the speed of the CPU it
shares, so the daemon would learn and plan for that CPU, not for a GPU. A job whose spec says
``pace=<profile>`` (a name :func:`slurm_elastic.profiles.load_profile` knows, e.g. ``cifar10``: the
Pollux table measured on T4s) sleeps at the end of every optimizer step until the step has taken what
the profile gives for its GPU count, node count, per-GPU batch and accumulation steps:
``step + (accum - 1) * (step - sync)`` (the rule of :meth:`ThroughputModel.samples_per_s`). The
model still trains with real DDP, checkpoints and exact resume; only the wall clock is the profile's,
so its throughput reports, and the daemon's decisions from them, are those of that hardware.

Off for real GPUs: on a CUDA device ``pace`` is ignored (and the job says so). A step whose real work
already takes longer than the profile is not paced (counted as ``late``; the job's log says how many).
To the daemon ``pace`` buys nothing: it never becomes a model (the daemon learns from what the job
reports, as for any job); ``status`` marks the job paced so nobody reads its speed as measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from slurm_elastic.profiles.base import ThroughputModel


def paced_step_s(model: ThroughputModel, gpus: int, nodes: int, local_batch: int, accum: int = 1) -> float:
    """Seconds one optimizer step takes under ``model``: only the last micro-step all-reduces."""
    step, sync = model.step_time(gpus, nodes, local_batch)
    return float(step + (accum - 1) * (step - sync))


@dataclass
class Pacer:
    """Stretches each step to ``target_s``; ``sleep`` is injectable for tests."""

    profile: str
    target_s: float
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)
    steps: int = 0
    late: int = 0  # steps whose real work took longer than the target (not stretched)
    slept_s: float = 0.0

    def wait(self, elapsed_s: float) -> float:
        """Sleep the rest of the step; returns the step's paced duration."""
        self.steps += 1
        rest = self.target_s - elapsed_s
        if rest <= 0:
            self.late += 1
            return elapsed_s
        self.sleep(rest)
        self.slept_s += rest
        return self.target_s

    def summary(self) -> str:
        return (f"paced to profile {self.profile!r}: {self.target_s * 1000:.1f} ms per step; {self.steps} steps, "
                f"{self.late} late (real work slower than the profile)")


def make_pacer(profile: str | None, *, gpus: int, nodes: int, local_batch: int, accum: int,
               device_type: str = "cpu", sleep: Callable[[float], None] = time.sleep) -> tuple[Pacer | None, str]:
    """The pacer for this start (None when not paced) and a line for the job's log saying why.

    Raises KeyError naming the known profiles when ``profile`` is unknown."""
    if not profile:
        return None, ""
    from slurm_elastic.profiles import load_profile

    model = load_profile(profile)
    if device_type == "cuda":
        return None, f"pace={profile} ignored: this job runs on real GPUs"
    target = paced_step_s(model, gpus, nodes, local_batch, accum)
    return Pacer(profile, target, sleep), (
        f"emulated GPUs paced to profile {profile!r}: {target * 1000:.1f} ms per step on {gpus} GPU(s) over "
        f"{nodes} node(s) at {local_batch} x {accum} per GPU")
