"""The throughput-model interface shared by the optimizer, the daemon and the simulator."""

from __future__ import annotations

import abc


class ThroughputModel(abc.ABC):
    """Seconds per optimizer micro-step as a function of placement and per-GPU batch.

    Implementations: measured tables (Pollux, Gavel), a parametric model fitted online from what
    jobs report, and declared points from a job's spec.
    """

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
