"""Measured throughput tables from the Pollux (OSDI'21) artifact, interpolated between points.

Each app has ``placements.csv`` (1-4 nodes x 1-4 GPUs, every placement multiset) and
``scalability.csv`` (6-16 nodes, up to 64 GPUs): seconds per step and the all-reduce part of it,
by placement and per-GPU batch. The model keys the tables by ``(nodes, gpus)``:

* when the uniform placement (``"22"`` for 2 nodes x 2) was measured it is used; otherwise the
  placements with that node and GPU count are averaged (``"12"`` and ``"21"``);
* between measured per-GPU batches, step and sync time are interpolated linearly (step time is
  close to affine in the batch); outside the measured range the end segments are extended;
* a ``(nodes, gpus)`` pair that was never measured (e.g. 8 GPUs on one node: the artifact ran on
  4-GPU T4 nodes) falls back to the parametric model (:mod:`.parametric`) fitted to the whole table.

Only the packaged copy under ``slurm_elastic/data/pollux/`` is read (see its PROVENANCE.md).
"""

from __future__ import annotations

import csv
import io
from collections import defaultdict
from functools import cache
from importlib import resources

import numpy as np

from slurm_elastic.profiles.base import ThroughputModel
from slurm_elastic.profiles.parametric import Observation, ParametricModel

POLLUX_APPS = ("bert", "cifar10", "deepspeech2", "imagenet", "ncf", "yolov3")

# The per-app ranges of the artifact (global batch, per-GPU batch, max GPUs): see data/README.
POLLUX_RANGES = {
    "bert": dict(min_batch=12, max_batch=384, min_local_batch=4, max_local_batch=12, max_gpus=64),
    "cifar10": dict(min_batch=128, max_batch=4096, min_local_batch=32, max_local_batch=1024, max_gpus=64),
    "deepspeech2": dict(min_batch=20, max_batch=640, min_local_batch=10, max_local_batch=80, max_gpus=64),
    "imagenet": dict(min_batch=200, max_batch=12800, min_local_batch=20, max_local_batch=200, max_gpus=64),
    "ncf": dict(min_batch=256, max_batch=32768, min_local_batch=32, max_local_batch=32768, max_gpus=1),
    "yolov3": dict(min_batch=8, max_batch=512, min_local_batch=4, max_local_batch=8, max_gpus=64),
}


def _read_csv(*parts: str) -> list[dict[str, str]]:
    ref = resources.files("slurm_elastic").joinpath("data", *parts)
    return list(csv.DictReader(io.StringIO(ref.read_text())))


def pollux_rows(app: str) -> list[tuple[str, int, int, float, float, float]]:
    """``(placement, nodes, gpus, local_bsz, step_time, sync_time)`` for every measured row of ``app``."""
    if app not in POLLUX_APPS:
        raise KeyError(f"unknown Pollux app {app!r} (known: {', '.join(POLLUX_APPS)})")
    out = []
    for r in _read_csv("pollux", app, "placements.csv"):
        p = r["placement"]
        out.append((p, len(p), sum(int(c) for c in p), float(r["local_bsz"]), float(r["step_time"]),
                    float(r["sync_time"])))
    for r in _read_csv("pollux", app, "scalability.csv"):
        n, k = int(r["num_nodes"]), int(r["num_replicas"])
        uniform = str(k // n) * n if k % n == 0 else ""
        out.append((uniform or f"{n}x{k}", n, k, float(r["local_bsz"]), float(r["step_time"]),
                    float(r["sync_time"])))
    return out


def pollux_observations(app: str) -> list[Observation]:
    """The measured rows of ``app`` as parametric-model observations (no accumulation)."""
    return [Observation(k, n, lb, 1, k * lb / st) for _, n, k, lb, st, _ in pollux_rows(app)]


class _Curve:
    """Step and sync time against per-GPU batch, piecewise linear, extended past the ends."""

    __slots__ = ("lb", "step", "sync")

    def __init__(self, lb, step, sync):
        order = np.argsort(lb)
        self.lb = np.asarray(lb, dtype=np.float64)[order]
        self.step = np.asarray(step, dtype=np.float64)[order]
        self.sync = np.asarray(sync, dtype=np.float64)[order]

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return _interp(x, self.lb, self.step), _interp(x, self.lb, self.sync)


def _interp(x, xp, fp):
    x = np.asarray(x, dtype=np.float64)
    if xp.size == 1:
        return np.full_like(x, fp[0])
    y = np.interp(x, xp, fp)
    lo = x < xp[0]
    hi = x > xp[-1]
    # Extrapolation must not reach non-physical times: keep at least 10% of the nearest measurement.
    if lo.any():
        y[lo] = np.maximum(fp[0] + (x[lo] - xp[0]) * (fp[1] - fp[0]) / (xp[1] - xp[0]), 0.1 * fp[0])
    if hi.any():
        y[hi] = np.maximum(fp[-1] + (x[hi] - xp[-1]) * (fp[-1] - fp[-2]) / (xp[-1] - xp[-2]), 0.1 * fp[-1])
    return y


def curves_from_rows(rows) -> dict[tuple[int, int], _Curve]:
    """(nodes, gpus) -> the interpolated step-time curve over local batch: the uniform placement where it was
    measured, else the mean over the placements with that node and GPU count (the module docstring's rules;
    Pollux's tables and Sia's per-type tables are read the same way)."""
    groups: dict[tuple[int, int], dict[str, list]] = defaultdict(lambda: defaultdict(list))
    for p, n, k, lb, st, sy in rows:
        groups[(n, k)][p].append((lb, st, sy))
    curves: dict[tuple[int, int], _Curve] = {}
    for (n, k), by_placement in groups.items():
        uniform = str(k // n) * n if k % n == 0 else None
        chosen = [by_placement[uniform]] if uniform in by_placement else list(by_placement.values())
        acc: dict[float, list[tuple[float, float]]] = defaultdict(list)
        for pts in chosen:
            for lb, st, sy in pts:
                acc[lb].append((st, sy))
        lbs = sorted(acc)
        curves[(n, k)] = _Curve(lbs, [np.mean([v[0] for v in acc[x]]) for x in lbs],
                                [np.mean([v[1] for v in acc[x]]) for x in lbs])
    return curves


class PolluxModel(ThroughputModel):
    """Interpolated Pollux table for one app (see the module docstring for the rules)."""

    def __init__(self, app: str):
        rows = pollux_rows(app)
        self.app = app
        self.name = app
        self.max_gpus = POLLUX_RANGES[app]["max_gpus"]
        self.source = "Pollux OSDI'21 artifact (petuum/adaptdl@c793c70), Apache-2.0"
        self.curves = curves_from_rows(rows)
        self.fallback = ParametricModel.fit(pollux_observations(app), name=f"{app}-fit")

    def __repr__(self) -> str:
        return f"PolluxModel({self.app!r})"

    def measured(self, gpus: int, nodes: int) -> bool:
        return (nodes, gpus) in self.curves

    def step_times(self, gpus, nodes, local_batch):
        curve = self.curves.get((nodes, gpus))
        if curve is None:
            return self.fallback.step_times(gpus, nodes, local_batch)
        return curve(np.asarray(local_batch, dtype=np.float64))

    def step_time(self, gpus: int, nodes: int, local_batch: int) -> tuple[float, float]:
        st, sy = self.step_times(gpus, nodes, np.array([local_batch], dtype=np.float64))
        return float(st[0]), float(sy[0])


@cache
def pollux_model(app: str) -> PolluxModel:
    return PolluxModel(app)
