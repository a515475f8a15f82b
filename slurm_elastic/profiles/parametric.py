"""A parametric throughput model fitted by non-negative least squares from a few observations.

Time of one optimizer step on ``k`` GPUs over ``n`` nodes at per-GPU batch ``l`` with ``a``
accumulation micro-steps::

    t = a * (alpha + beta * l)                       # compute, once per micro-step
        + [k > 1] * (gamma + delta * (k - 2))         # intra-job all-reduce
        + [n > 1] * (eps + zeta * (n - 2))            # extra cost of crossing nodes

so ``step_time = alpha + beta*l + sync`` and ``sync_time`` is the two bracketed terms (only the last
micro-step all-reduces). All six coefficients are >= 0 (NNLS), which keeps the model physical: time
grows with batch, GPUs and nodes. The fit minimises the *relative* error of the step time (each row
is divided by its observed time), so a 5 ms and a 5 s measurement count alike.

The daemon uses :meth:`ParametricModel.fit` to learn a job's profile online from the
``(gpus, batch, samples/s)`` the job reports; :func:`fit_error` measures how well the family
fits the Pollux tables (see docs/ALGORITHM.md for the figures).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from slurm_elastic.profiles._nnls import nnls
from slurm_elastic.profiles.base import ThroughputModel

COEFFS = ("alpha", "beta", "gamma", "delta", "eps", "zeta")


@dataclass(frozen=True)
class Observation:
    """One observed operating point: ``samples_per_s`` on ``gpus`` GPUs over ``nodes`` nodes."""

    gpus: int
    nodes: int
    local_batch: float
    accum: int
    samples_per_s: float


def _design(k, n, lb, a) -> np.ndarray:
    k = np.asarray(k, dtype=np.float64)
    n = np.asarray(n, dtype=np.float64)
    lb = np.asarray(lb, dtype=np.float64)
    a = np.asarray(a, dtype=np.float64)
    multi = (k > 1).astype(np.float64)
    inter = (n > 1).astype(np.float64)
    return np.stack([a, a * lb, multi, multi * (k - 2), inter, inter * (n - 2)], axis=-1)


class ParametricModel(ThroughputModel):
    """``step_time = alpha + beta*l + [k>1](gamma + delta(k-2)) + [n>1](eps + zeta(n-2))``."""

    def __init__(self, coeffs: Sequence[float], name: str = "parametric", max_gpus: int | None = None):
        c = np.asarray(coeffs, dtype=np.float64)
        if c.shape != (6,) or not np.isfinite(c).all() or (c < 0).any():
            raise ValueError(f"expected 6 finite non-negative coefficients, got {coeffs!r}")
        if c[0] + c[1] <= 0:
            raise ValueError("the compute time (alpha + beta) must be positive")
        self.coeffs = c
        self.name = name
        self.max_gpus = max_gpus
        self.source = "NNLS fit"

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={v:.3g}" for n, v in zip(COEFFS, self.coeffs, strict=True))
        return f"ParametricModel({inner})"

    def _parts(self, gpus, nodes, lb):
        al, be, ga, de, ep, ze = self.coeffs
        compute = al + be * np.asarray(lb, dtype=np.float64)
        sync = 0.0
        if gpus > 1:
            sync += ga + de * (gpus - 2)
        if nodes > 1:
            sync += ep + ze * (nodes - 2)
        return compute, sync

    def step_time(self, gpus: int, nodes: int, local_batch: int) -> tuple[float, float]:
        compute, sync = self._parts(gpus, nodes, local_batch)
        return float(compute + sync), float(sync)

    def step_times(self, gpus, nodes, local_batch):
        compute, sync = self._parts(gpus, nodes, local_batch)
        return compute + sync, np.full_like(compute, sync)

    @classmethod
    def fit(
        cls, observations: Iterable[Observation], name: str = "parametric", max_gpus: int | None = None
    ) -> ParametricModel:
        """Fit the six coefficients to observations by NNLS on relative step-time error.

        With observations on a single GPU only, the sync terms are unidentifiable and stay 0 (the
        model then predicts ideal scaling): the daemon refits as the job reports more placements.
        """
        obs = list(observations)
        if not obs:
            raise ValueError("at least one observation is needed")
        k = np.array([o.gpus for o in obs], dtype=np.float64)
        n = np.array([o.nodes for o in obs], dtype=np.float64)
        lb = np.array([o.local_batch for o in obs], dtype=np.float64)
        a = np.array([o.accum for o in obs], dtype=np.float64)
        sps = np.array([o.samples_per_s for o in obs], dtype=np.float64)
        if (k < 1).any() or (n < 1).any() or (lb <= 0).any() or (a < 1).any() or (sps <= 0).any():
            raise ValueError("observations need gpus, nodes, accum >= 1 and positive batch and throughput")
        t = k * lb * a / sps  # seconds per optimizer step
        X = _design(k, n, lb, a) / t[:, None]
        coeffs, _ = nnls(X, np.ones_like(t))
        if coeffs[0] + coeffs[1] <= 0:  # degenerate data (e.g. a single multi-GPU point)
            coeffs = np.zeros(6)
            coeffs[1] = float(np.median(t / (a * lb)))
        return cls(coeffs, name=name, max_gpus=max_gpus)


def fit_error(model: ThroughputModel, rows: Sequence[Observation]) -> dict[str, float]:
    """Relative error of ``model``'s samples/s on ``rows``: median, 90th percentile, max, mean."""
    err = np.array(
        [abs(model.samples_per_s(r.gpus, r.nodes, r.local_batch, r.accum) / r.samples_per_s - 1.0) for r in rows]
    )
    return {
        "median": float(np.median(err)),
        "p90": float(np.quantile(err, 0.9)),
        "max": float(err.max()),
        "mean": float(err.mean()),
        "rows": len(rows),
    }
