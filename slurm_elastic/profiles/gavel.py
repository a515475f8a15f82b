"""Gavel's (OSDI'20) measured throughputs: 7 models on K80/P100/V100 at 1, 2, 4 and 8 workers.

``simulation_throughputs.json`` gives, for each GPU type and job type ``('<model> (batch size B)', k)``,
the rate of the job running alone (the ``"null"`` co-location entry). We read that rate as
worker-iterations per second summed over the ``k`` workers, each at per-worker batch ``B``: samples/s
= rate x B, so one step (every worker doing one iteration) takes ``k / rate`` seconds. Consolidated
placements (one server, ``nodes == 1``) use the ``<gpu>`` table, spread ones (``nodes > 1``) the
``<gpu>_unconsolidated`` table.

The multi-GPU speedups are not monotone (LM on V100: 1.7x on 2 GPUs, 1.2x on 4, 6.4x on 8): the
allocator's exactness tests use these profiles because a greedy or concave method fails on them.

Rules: between measured batches step time is interpolated linearly (and extended past the ends);
between measured worker counts (3, 5, 6, 7) linearly in ``k``; beyond the largest measured count
the model does not extend (``max_gpus``). Sync time is not in the table; we estimate it as the step
time's excess over one worker's, ``max(0, step(k) - step(1))``, which is what accumulation saves.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from functools import cache, lru_cache
from importlib import resources

import numpy as np

from slurm_elastic.profiles.base import ThroughputModel
from slurm_elastic.profiles.measured import _interp

GAVEL_GPUS = ("k80", "p100", "v100")
_KEY_RE = re.compile(r"^\('(?P<model>[^']+?)(?: \(batch size (?P<batch>\d+)\))?', (?P<k>\d+)\)$")


def _slug(model: str) -> str:
    return re.sub(r"[^a-z0-9]", "", model.lower())


@lru_cache(maxsize=1)
def _table() -> dict[tuple[str, str, bool], dict[int, dict[int, float]]]:
    """``(gpu, slug, consolidated) -> {k: {batch: rate}}`` and the slug -> model-name map."""
    text = resources.files("slurm_elastic").joinpath("data", "gavel", "simulation_throughputs.json").read_text()
    raw = json.loads(text)
    out: dict = defaultdict(lambda: defaultdict(dict))
    for gpu_key, jobs in raw.items():
        gpu, _, spread = gpu_key.partition("_")
        for key, entry in jobs.items():
            m = _KEY_RE.match(key)
            if not m or not isinstance(entry, dict) or "null" not in entry:
                continue
            batch = int(m.group("batch") or 1)
            out[(gpu, _slug(m.group("model")), not spread)][int(m.group("k"))][batch] = float(entry["null"])
    return {k: {kk: dict(vv) for kk, vv in v.items()} for k, v in out.items()}


def gavel_profile_names() -> list[str]:
    return sorted({f"gavel.{gpu}.{slug}" for gpu, slug, _ in _table()})


class GavelModel(ThroughputModel):
    """One Gavel job family (all its measured batch sizes) on one GPU type."""

    def __init__(self, gpu: str, model: str):
        slug = _slug(model)
        tab = _table()
        if (gpu, slug, True) not in tab:
            raise KeyError(f"no Gavel profile for {model!r} on {gpu!r} (known: {', '.join(gavel_profile_names())})")
        self.gpu, self.model = gpu, slug
        self.name = f"gavel.{gpu}.{slug}"
        self.source = "Gavel OSDI'20 (stanford-futuredata/gavel@c4fa400), MIT"
        self._curves: dict[bool, tuple[np.ndarray, list[tuple[np.ndarray, np.ndarray]]]] = {}
        for consolidated in (True, False):
            by_k = tab.get((gpu, slug, consolidated)) or tab[(gpu, slug, True)]
            # A 0.0 in Gavel's table is a configuration it did not measure (k80 resnet50 at batch 128 on
            # 2-8 GPUs, though 1 GPU ran it): left out, as any unmeasured batch, not an infinite step time
            # (which made samples/s NaN).
            by_k = {k: {b: t for b, t in d.items() if t > 0} for k, d in by_k.items()}
            by_k = {k: d for k, d in by_k.items() if d}
            ks = np.array(sorted(by_k), dtype=np.float64)
            curves = []
            for k in ks:
                b = np.array(sorted(by_k[int(k)]), dtype=np.float64)
                step = np.array([k / by_k[int(k)][int(x)] for x in b])
                curves.append((b, step))
            self._curves[consolidated] = (ks, curves)
        self.max_gpus = int(self._curves[True][0].max())
        self.batches = tuple(int(x) for x in self._curves[True][1][0][0])

    def __repr__(self) -> str:
        return f"GavelModel({self.gpu!r}, {self.model!r})"

    def _step(self, k: int, consolidated: bool, lb: np.ndarray) -> np.ndarray:
        ks, curves = self._curves[consolidated]

        def at(i):
            b, step = curves[i]
            if b.size == 1:  # one measured batch: time proportional to the batch
                return step[0] * lb / b[0]
            return _interp(lb, b, step)

        if k > ks[-1]:
            raise ValueError(f"{self.name} is measured up to {int(ks[-1])} GPUs, not {k}")
        j = int(np.searchsorted(ks, k))
        if ks[j] == k:
            return at(j)
        w = (k - ks[j - 1]) / (ks[j] - ks[j - 1])
        return (1 - w) * at(j - 1) + w * at(j)

    def step_times(self, gpus, nodes, local_batch):
        lb = np.asarray(local_batch, dtype=np.float64)
        step = self._step(gpus, nodes <= 1, lb)
        sync = np.maximum(0.0, step - self._step(1, True, lb)) if gpus > 1 else np.zeros_like(step)
        return step, sync

    def step_time(self, gpus: int, nodes: int, local_batch: int) -> tuple[float, float]:
        st, sy = self.step_times(gpus, nodes, np.array([local_batch], dtype=np.float64))
        return float(st[0]), float(sy[0])


@cache
def gavel_model(gpu: str, model: str) -> GavelModel:
    return GavelModel(gpu, model)


def model_on_type(model: ThroughputModel, gpu_type: str) -> ThroughputModel | None:
    """A job's model on another GPU type: a Gavel table (or a model wrapping one, ``.inner``) on a Gavel
    type (k80, p100, v100) runs at that type's table; None: no per-type data for it."""
    base = model
    for _ in range(3):
        if isinstance(base, GavelModel):
            break
        base = getattr(base, "inner", None)
    t = (gpu_type or "").lower()
    if not isinstance(base, GavelModel) or t not in GAVEL_GPUS:
        return None
    return model if t == base.gpu else gavel_model(t, base.model)
