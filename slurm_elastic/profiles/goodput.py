"""Statistical efficiency from Pollux's ``validation-<B>.csv``: goodput = throughput x efficiency(B).

The paper's model (the default) says a job needs the same number of samples at any batch in its
range. Pollux measured otherwise: training at global batch B, the ``progress`` column counts the
iterations *at the app's initial batch B0* that the run is worth, and ``iteration`` counts the
optimizer steps actually taken at B. Over the whole run, a sample at batch B is worth

    efficiency(B) = (progress x B0) / (iteration x B)          (1 at B = B0, typically < 1 above)

of a sample at B0 (we use each file's last row: the whole training run). Between measured batches
efficiency is interpolated linearly in log B; outside it is held at the nearest measured value.
With ``objective="goodput"`` the ``dp`` policy maximises samples/s x efficiency(b) when choosing
``b*(k)``, so it stops growing the batch where the extra samples are wasted.
"""

from __future__ import annotations

import math
import re
from functools import cache
from importlib import resources

import numpy as np

from slurm_elastic.profiles.efficiency import efficiency_fn, noise_scale_from_stats
from slurm_elastic.profiles.measured import POLLUX_APPS, _read_csv


@cache
def pollux_efficiency_table(app: str) -> tuple[np.ndarray, np.ndarray]:
    """``(batches, efficiency)`` measured for ``app``, ascending in batch."""
    if app not in POLLUX_APPS:
        raise KeyError(f"no statistical-efficiency data for {app!r}")
    folder = resources.files("slurm_elastic").joinpath("data", "pollux", app)
    batches = sorted(int(m.group(1)) for f in folder.iterdir() if (m := re.fullmatch(r"validation-(\d+)\.csv", f.name)))
    b0 = batches[0]
    eff = []
    for b in batches:
        last = _read_csv("pollux", app, f"validation-{b}.csv")[-1]
        eff.append(float(last["progress"]) * b0 / (float(last["iteration"]) * b))
    return np.array(batches, dtype=np.float64), np.array(eff, dtype=np.float64)


def pollux_efficiency(app: str):
    """``efficiency(batch_array) -> array`` for a Pollux app (see the module docstring)."""
    b, e = pollux_efficiency_table(app)
    lb = np.log(b)

    def efficiency(batch) -> np.ndarray:
        x = np.log(np.maximum(np.asarray(batch, dtype=np.float64), 1.0))
        return np.interp(x, lb, e)

    return efficiency


def efficiency_for_request(req):
    """``(efficiency function, cache key)`` for one job, from the best source it has:

    1. its reported gradient noise scale (:mod:`slurm_elastic.profiles.efficiency`), quantised to 2%
       steps so that the batch tables stay cached while the estimate wanders;
    2. the Pollux measured table of its app (whole-run average);
    3. nothing measured: conservative -- efficiency 1 up to the job's requested batch and
       ``requested / b`` above it (a larger batch is assumed to buy no progress, so the batch is only
       raised where more GPUs need it, never for a throughput gain of a few percent).
    """
    ns = req.noise_scale
    if ns is not None and math.isfinite(ns) and ns >= 0:
        b0 = float(req.base_batch or req.spec.min_batch)
        q = math.exp(round(math.log(max(ns, 1e-3)) * 50.0) / 50.0)
        return _noise_cached(q, b0), ("noise-scale", q, b0)
    app = getattr(req.model, "app", None)
    if app in POLLUX_APPS:
        return _cached(app), ("pollux-efficiency", app)
    b_req = float(req.spec.requested_batch)
    return _conservative(b_req), ("conservative", b_req)


@cache
def _noise_cached(ns: float, b0: float):
    return efficiency_fn(ns, b0)


@cache
def _conservative(b_req: float):
    def fn(batch) -> np.ndarray:
        b = np.asarray(batch, dtype=np.float64)
        return np.where(b <= b_req, 1.0, b_req / np.maximum(b, 1e-9))

    return fn


@cache
def _cached(app: str):
    return pollux_efficiency(app)


class PolluxGradTrace:
    """A Pollux app's measured gradient statistics over training, as Pollux's own simulator uses them.

    ``validation-<B>.csv`` gives, per epoch of a run at batch B, ``grad_sqr`` (|G|^2) and ``grad_var``
    (the gradient variance at the app's initial batch B0). At a job's current progress (in samples at
    B0) the epoch is the furthest any measured run has reached at that progress; the statistics at a
    batch between measured ones are interpolated linearly in the batch (outside: the nearest). Then
    (Pollux, OSDI'21, eq. 6; its simulator's ``gain``), per sample at batch b:

        efficiency(b) = gain / scale,  gain = (var + sqr) / (var / scale + sqr),  scale = b / B0
                      = (B_noise + B0) / (B_noise + b),  B_noise = B0 x var / sqr

    so early in training (small noise scale) large batches waste samples, late they do not.
    """

    def __init__(self, app: str):
        if app not in POLLUX_APPS:
            raise KeyError(f"no gradient statistics for {app!r}")
        folder = resources.files("slurm_elastic").joinpath("data", "pollux", app)
        batches = sorted(int(m.group(1)) for f in folder.iterdir()
                         if (m := re.fullmatch(r"validation-(\d+)\.csv", f.name)))
        self.app = app
        self.b0 = float(batches[0])
        self.batches = np.array(batches, dtype=np.float64)
        rows = [_read_csv("pollux", app, f"validation-{b}.csv") for b in batches]
        self.epochs = min(len(r) for r in rows)
        self.prog = [np.array([float(x["progress"]) for x in r]) for r in rows]
        self.sqr = np.array([[float(x["grad_sqr"]) for x in r[:self.epochs]] for r in rows])
        self.var = np.array([[float(x["grad_var"]) for x in r[:self.epochs]] for r in rows])
        bounds = np.unique(np.concatenate([p[:self.epochs] for p in self.prog])) * self.b0
        self.bounds = bounds

    def epoch(self, samples: float) -> int:
        it = samples / self.b0
        e = max(int(np.searchsorted(p, it, side="right")) for p in self.prog)
        return min(e, self.epochs - 1)

    def stats(self, batch: float, samples: float) -> tuple[float, float]:
        e = self.epoch(samples)
        b = min(max(float(batch), self.batches[0]), self.batches[-1])
        return float(np.interp(b, self.batches, self.sqr[:, e])), float(np.interp(b, self.batches, self.var[:, e]))

    def noise_scale(self, batch: float, samples: float) -> float | None:
        sqr, var = self.stats(batch, samples)
        return noise_scale_from_stats(max(sqr, 1e-12), max(var, 0.0), self.b0)

    def efficiency(self, batch: float, samples: float) -> float:
        sqr, var = self.stats(batch, samples)
        sqr, var = max(sqr, 1e-12), max(var, 0.0)
        scale = max(float(batch), 1e-9) / self.b0
        gain = (var + sqr) / (var / scale + sqr)
        return gain / scale

    def next_change(self, samples: float) -> float:
        """The next progress (samples at B0) at which the statistics change (inf: none)."""
        i = int(np.searchsorted(self.bounds, samples, side="right"))
        return float(self.bounds[i]) if i < self.bounds.size else math.inf


@cache
def pollux_grad_trace(app: str) -> PolluxGradTrace:
    return PolluxGradTrace(app)
