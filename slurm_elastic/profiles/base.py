"""The throughput-model interface shared by the optimizer, the daemon and the simulator."""

from __future__ import annotations

import abc

import numpy as np


class ThroughputModel(abc.ABC):
    """Seconds per optimizer micro-step as a function of placement and per-GPU batch.

    Implementations: measured tables (Pollux, Gavel), a parametric model fitted online from what
    jobs report, and declared points from a job's spec.

    Optional attributes an implementation may set: ``name`` (the profile name), ``max_gpus`` (the
    largest GPU count the model is valid for; the allocators never go past it) and ``source`` (where
    the numbers come from, for humans).
    """

    name: str = ""
    max_gpus: int | None = None
    source: str = ""

    @abc.abstractmethod
    def step_time(self, gpus: int, nodes: int, local_batch: int) -> tuple[float, float]:
        """``(step_time, sync_time)`` in seconds for one step at ``local_batch`` samples per GPU."""

    def samples_per_s(self, gpus: int, nodes: int, local_batch: int, accum: int = 1) -> float:
        """Throughput with ``accum`` accumulation micro-steps per optimizer step.

        Accumulating ``a - 1`` extra micro-steps costs ``step + (a - 1) * (step - sync)`` per step:
        only the last micro-step all-reduces gradients.
        """
        step, sync = self.step_time(gpus, nodes, local_batch)
        t = step + (accum - 1) * (step - sync)
        return gpus * local_batch * accum / t

    def step_times(self, gpus: int, nodes: int, local_batch) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised :meth:`step_time` over an array of per-GPU batches (subclasses may override)."""
        lb = np.asarray(local_batch, dtype=np.float64)
        out = np.empty((2, lb.size))
        for i, b in enumerate(lb.ravel()):
            out[0, i], out[1, i] = self.step_time(gpus, nodes, b)
        return out[0].reshape(lb.shape), out[1].reshape(lb.shape)

    def samples_per_s_array(self, gpus: int, nodes: int, local_batch, accum=1) -> np.ndarray:
        """Vectorised :meth:`samples_per_s` (same accumulation rule)."""
        lb = np.asarray(local_batch, dtype=np.float64)
        a = np.asarray(accum, dtype=np.float64)
        step, sync = self.step_times(gpus, nodes, lb)
        t = step + (a - 1.0) * (step - sync)
        return gpus * lb * a / t
