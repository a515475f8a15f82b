"""Learning-rate scaling when the global batch changes between starts. Torch-free.

The user's optimizer is configured with the learning rate for ``base_batch`` (by default the spec's
requested batch). At global batch ``B`` the factor applied to every param group's lr is

* ``none``:   1
* ``linear``: ``B / base_batch`` (Goyal et al.), reached through a linear warm-up ramp of
  ``warmup_samples`` samples whenever the factor goes *up* (after a resize to a larger batch, and at the
  first start when ``B > base_batch``); decreases apply at once;
* ``sqrt``:   ``sqrt(B / base_batch)`` (Krizhevsky; Hoffer et al.), same ramp rule when warm-up is set;
* ``adascale``: the AdaScale gain ``(B / base_batch) x (noise + base_batch) / (noise + B)`` with the
  job's measured gradient noise scale (:mod:`.noise`), updated every step; 1 until the first estimate.
  No ramp: the gain is at most ``B / base_batch`` and grows only as the measured noise allows.

``adascale`` is the rule the daemon's goodput model assumes: a step at batch ``B`` is worth
``gain`` steps at the base batch, i.e. a sample at ``B`` is worth ``efficiency(B) = gain / (B /
base_batch) = (noise + base_batch) / (noise + B)`` samples at the base batch (Pollux, AdaptDL).
With ``linear`` or ``sqrt`` the daemon's model is an approximation of the progress actually made.

Progress is counted in samples seen, never in optimizer steps, so a schedule means the same thing at
any batch size. The ramp state is part of the checkpoint: a stop in the middle of a ramp resumes it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

MODES = ("none", "linear", "sqrt", "adascale")


def adascale_gain(batch: int, base_batch: int, noise_scale: float | None) -> float:
    """AdaScale's gain ``S (noise + base) / (noise + B)``, ``S = B / base``; 1 without an estimate."""
    if noise_scale is None or not math.isfinite(noise_scale) or noise_scale < 0:
        return 1.0
    return (batch / base_batch) * (noise_scale + base_batch) / (noise_scale + batch)


@dataclass
class LRScaler:
    mode: str = "none"
    base_batch: int = 1
    warmup_samples: int = 0
    batch: int | None = None  # the global batch in effect
    ramp_start: int = 0  # samples_seen when the current ramp began
    ramp_from: float = 1.0
    ramp_to: float = 1.0
    noise_scale: float | None = None  # the job's current measured noise scale (``adascale`` only)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"lr scaling must be one of {', '.join(MODES)}, not {self.mode!r}")
        if self.base_batch < 1:
            raise ValueError("base_batch must be positive")
        if self.warmup_samples < 0:
            raise ValueError("warmup_samples must be >= 0")

    def target(self, batch: int) -> float:
        r = batch / self.base_batch
        if self.mode == "linear":
            return r
        if self.mode == "sqrt":
            return math.sqrt(r)
        if self.mode == "adascale":
            return adascale_gain(batch, self.base_batch, self.noise_scale)
        return 1.0

    def factor(self, samples_seen: int) -> float:
        if self.batch is None:
            return 1.0
        if self.mode == "adascale":
            return self.target(self.batch)
        if self.warmup_samples <= 0 or self.ramp_to <= self.ramp_from:
            return self.ramp_to
        done = (samples_seen - self.ramp_start) / self.warmup_samples
        if done >= 1.0:
            return self.ramp_to
        done = max(0.0, done)
        return self.ramp_from + (self.ramp_to - self.ramp_from) * done

    def set_batch(self, batch: int, samples_seen: int) -> None:
        """Switch to ``batch`` at ``samples_seen`` (call once per start, after restoring the state)."""
        if batch == self.batch:
            return
        current = 1.0 if self.batch is None else self.factor(samples_seen)
        new = self.target(batch)
        self.batch = batch
        self.ramp_start = samples_seen
        self.ramp_from = current if new > current else new
        self.ramp_to = new

    def state_dict(self) -> dict:
        d = asdict(self)
        d.pop("noise_scale")  # the estimator's own state is checkpointed with it
        return d

    def load_state_dict(self, state: dict) -> None:
        # Mode, base batch and warm-up length come from the current run's configuration; the ramp
        # position comes from the checkpoint.
        self.batch = state.get("batch")
        self.ramp_start = int(state.get("ramp_start", 0))
        self.ramp_from = float(state.get("ramp_from", 1.0))
        self.ramp_to = float(state.get("ramp_to", 1.0))
