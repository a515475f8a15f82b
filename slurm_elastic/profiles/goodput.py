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

import re
from functools import cache
from importlib import resources

import numpy as np

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
    """``(efficiency function, cache key)`` for a job's model, or ``(None, None)`` (throughput only)."""
    app = getattr(req.model, "app", None)
    if app in POLLUX_APPS:
        return _cached(app), ("pollux-efficiency", app)
    return None, None


@cache
def _cached(app: str):
    return pollux_efficiency(app)
