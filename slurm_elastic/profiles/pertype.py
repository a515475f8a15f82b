"""Per-GPU-type measured tables (Sia, SOSP'23 artifact): one app's speed on each GPU type.

Sia measured the Pollux applications on several GPU types (``data/sia/<app>/placements-<type>.csv``
and ``scalability-<type>.csv``; see its PROVENANCE.md). :class:`SiaModel` reads one (app, type) with
the rules of the Pollux tables (:mod:`.measured`): the uniform placement for a ``(nodes, gpus)`` pair
when measured, else the placements with that node and GPU count averaged; step and sync time linear
in the per-GPU batch between measured points, extended past the ends; an unmeasured pair falls back to
the parametric model fitted to that type's rows. Unlike :mod:`.measured`, nothing here is calibrated
(the artifact's simulator scales step times by per-model slowdowns; we run the tables as measured).

Why here: the simulator runs each job at its true per-type speed from these tables, and a
"profiled" run (Sia's bootstrap, which measures every job on every type) hands them to the policy.
"""

from __future__ import annotations

import csv
import io
from functools import cache
from importlib import resources

import numpy as np

from slurm_elastic.profiles.base import ThroughputModel
from slurm_elastic.profiles.measured import POLLUX_APPS, POLLUX_RANGES, PolluxModel, curves_from_rows
from slurm_elastic.profiles.parametric import Observation, ParametricModel

# GPU types packaged (the artifact's heterogeneous cluster) and what they are.
SIA_TYPES = {"aws": "NVIDIA T4 (g4dn.12xlarge), 4 per node", "rtx": "RTX 2080Ti, 8 per node",
             "dgx-ext": "A100 40 GB (DGX-A100, NVLink), 8 per node"}
# The artifact's simulator: seconds of GPU time a restart costs, per model.
SIA_RESTART_S = {"cifar10": 50.0, "deepspeech2": 25.0, "bert": 120.0, "yolov3": 80.0, "imagenet": 250.0,
                 "ncf": 15.0}
# Sia's heterogeneous 64-GPU cluster: (nodes, GPUs per node, GPU type).
SIA_CLUSTER = ((6, 4, "aws"), (3, 8, "rtx"), (2, 8, "dgx-ext"))


def _rows(app: str, gpu_type: str) -> list[tuple[str, int, int, float, float, float]]:
    """``(placement, nodes, gpus, local_bsz, step_time, sync_time)`` of ``app`` on ``gpu_type``."""
    if app not in POLLUX_APPS:
        raise KeyError(f"unknown app {app!r} (known: {', '.join(POLLUX_APPS)})")
    if gpu_type not in SIA_TYPES:
        raise KeyError(f"no per-type table for GPU type {gpu_type!r} (known: {', '.join(SIA_TYPES)})")
    root = resources.files("slurm_elastic").joinpath("data", "sia", app)
    out = []
    for r in csv.DictReader(io.StringIO(root.joinpath(f"placements-{gpu_type}.csv").read_text())):
        p = r["placement"].strip()
        out.append((p, len(p), sum(int(c) for c in p), float(r["local_bsz"]), float(r["step_time"]),
                    float(r["sync_time"])))
    for r in csv.DictReader(io.StringIO(root.joinpath(f"scalability-{gpu_type}.csv").read_text())):
        n, k = int(r["num_nodes"]), int(r["num_replicas"])
        uniform = str(k // n) * n if k % n == 0 and k // n < 10 else ""
        out.append((uniform or f"{n}x{k}", n, k, float(r["local_bsz"]), float(r["step_time"]),
                    float(r["sync_time"])))
    return [row for row in out if row[4] > 0 and np.isfinite(row[4]) and np.isfinite(row[5])]


class SiaModel(PolluxModel):
    """One app on one GPU type, interpolated as the Pollux tables are (module docstring): a PolluxModel
    built from Sia's rows, so its curves, fallback and step times are read the same way."""

    def __init__(self, app: str, gpu_type: str):
        rows = _rows(app, gpu_type)
        self.app, self.gpu_type = app, gpu_type
        self.name = f"sia.{gpu_type}.{app}"
        self.max_gpus = POLLUX_RANGES[app]["max_gpus"]
        self.source = "Sia SOSP'23 artifact (siasosp23/artifacts@aaf7a0d), measured per GPU type"
        self.curves = curves_from_rows(rows)
        self.fallback = ParametricModel.fit([Observation(k, n, lb, 1, k * lb / st) for _, n, k, lb, st, _ in rows],
                                            name=f"{self.name}-fit")

    def __repr__(self) -> str:
        return f"SiaModel({self.app!r}, {self.gpu_type!r})"


@cache
def sia_model(app: str, gpu_type: str) -> SiaModel:
    return SiaModel(app, gpu_type)


def app_of(model: ThroughputModel) -> str | None:
    """The Pollux/Sia app a model (or a model wrapping one, ``.inner``) measures; None if none."""
    m = model
    for _ in range(3):
        app = getattr(m, "app", None)
        if app in POLLUX_APPS:
            return app
        m = getattr(m, "inner", None)
        if m is None:
            break
    return None


def sia_model_on_type(model: ThroughputModel, gpu_type: str) -> ThroughputModel | None:
    """The measured table of ``model``'s app on ``gpu_type``; None when there is none."""
    app = app_of(model)
    if app is None or gpu_type not in SIA_TYPES:
        return None
    return sia_model(app, gpu_type)
