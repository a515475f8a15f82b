"""A job's model learned from its own reports, on top of a prior. Pure: no I/O.

Why: until now the daemon used a default model until a job had reported at three GPU counts (a job
measured at 48 samples/s was shown, and planned, at 4,414). Here the first report already counts:

* **prior**: the job's named profile (``profile``), a fit of its declared points (``declared``), or
  the conservative default model (``prior``);
* **observations** (the ``(gpus, batch, samples/s)`` points the job reported): with fewer than
  ``MIN_FIT_GPU_COUNTS`` distinct GPU counts the prior's *shape* is kept and its scale matched to
  them (the geometric mean of observed / predicted; one observation is then reproduced exactly);
  from three GPU counts on, the six-term parametric model is fitted to them alone. Either way the
  provenance is ``fitted from N reports``.

Uncertainty (a relative error, kept with the model): the prior's own (:data:`PRIOR_UNCERTAINTY`), then
the spread of the observations around the scaled prior plus the prior's, shrunk by the number of GPU
counts observed; for a fit, its relative residual.

Conservative while uncertain: a *running* job whose model rests on the default prior (no profile, no
declared points, fewer than three GPU counts reported) is capped (``max_gpus``) at
``GROWTH_WHILE_UNCERTAIN`` times the largest GPU count it reported at (never below its current size or
its minimum): no big grow on a guess. A pending job is admitted on its prior (the planner's stability
guard then keeps it at that size until it has reported a step).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from slurm_elastic.profiles.base import ThroughputModel
from slurm_elastic.profiles.parametric import Observation, ParametricModel

MIN_FIT_GPU_COUNTS = 3
GROWTH_WHILE_UNCERTAIN = 2
PRIOR_UNCERTAINTY = {"profile": 0.3, "declared": 0.3, "prior": 1.0}


@dataclass(frozen=True)
class JobFacts:
    """What a job reported besides throughput (all optional; checked by the reader)."""

    noise_scale: float | None = None  # gradient noise scale, samples
    base_batch: int | None = None  # the batch its lr is meant for (efficiency 1)
    restart_s: float | None = None  # measured restart cost (signal -> first step), seconds
    # restart counts with a reported first step; None when the job has no report directory (unknown)
    stepped_restarts: frozenset[int] | None = None


class LearnedModel(ThroughputModel):
    """A throughput model with its provenance, uncertainty and the job's reported facts."""

    def __init__(self, inner: ThroughputModel, *, provenance: str, uncertainty: float, scale: float = 1.0,
                 max_gpus: int | None = None, facts: JobFacts = JobFacts(), name: str = ""):
        if not (math.isfinite(scale) and scale > 0):
            raise ValueError("scale must be finite and positive")
        self.inner = inner
        self.scale = float(scale)  # samples/s multiplier on the inner model (step time divided by it)
        self.provenance = provenance
        self.uncertainty = float(uncertainty)
        self.facts = facts
        self.name = name or getattr(inner, "name", "")
        self.source = f"{provenance} (+/-{100 * self.uncertainty:.0f}%)"
        inner_max = getattr(inner, "max_gpus", None)
        self.max_gpus = min(x for x in (max_gpus, inner_max) if x is not None) \
            if (max_gpus is not None or inner_max is not None) else None
        app = getattr(inner, "app", None)
        if app is not None:
            self.app = app  # keeps the Pollux validation-data efficiency (profiles/goodput.py) reachable
        # Issue 23: the GPU type its reports come from ("" unknown), and its models on the other types it
        # reported on (profiles/types.py asks :meth:`on_type` first)
        self.gpu_type = ""
        self.by_type: dict[str, LearnedModel] = {}

    def on_type(self, gpu_type: str) -> LearnedModel | None:
        """Its model on ``gpu_type`` from its own reports there; None if it never reported there."""
        if gpu_type and gpu_type == self.gpu_type:
            return self
        return self.by_type.get(gpu_type)

    @property
    def noise_scale(self) -> float | None:
        return self.facts.noise_scale

    @property
    def base_batch(self) -> int | None:
        return self.facts.base_batch

    @property
    def restart_s(self) -> float | None:
        return self.facts.restart_s

    @property
    def kind(self) -> str:
        return self.provenance.split()[0]

    def __repr__(self) -> str:
        return f"LearnedModel({self.provenance}, x{self.scale:.3g}, +/-{self.uncertainty:.2f}, inner={self.inner!r})"

    def step_time(self, gpus: int, nodes: int, local_batch: int) -> tuple[float, float]:
        step, sync = self.inner.step_time(gpus, nodes, local_batch)
        return step / self.scale, sync / self.scale

    def step_times(self, gpus, nodes, local_batch):
        step, sync = self.inner.step_times(gpus, nodes, local_batch)
        return step / self.scale, sync / self.scale


def learn(prior: ThroughputModel, prior_kind: str, obs: Sequence[Observation], *, running_gpus: int = 0,
          min_gpus: int = 1, facts: JobFacts = JobFacts(), name: str = "") -> LearnedModel:
    """The job's model from its ``prior`` (kind ``profile``/``declared``/``prior``) and observations."""
    if prior_kind not in PRIOR_UNCERTAINTY:
        raise ValueError(f"unknown prior kind {prior_kind!r}")
    obs = [o for o in obs if o.samples_per_s > 0 and math.isfinite(o.samples_per_s)]
    base_unc = PRIOR_UNCERTAINTY[prior_kind]
    if not obs:
        label = prior_kind if prior_kind != "profile" else f"profile {getattr(prior, 'name', '')}".strip()
        cap = None
        if prior_kind == "prior" and running_gpus > 0:
            cap = max(running_gpus, min_gpus)  # running, nothing reported yet: no grow on a guess
        return LearnedModel(prior, provenance=label, uncertainty=base_unc, max_gpus=cap, facts=facts, name=name)
    counts = {o.gpus for o in obs}
    n = len(obs)
    provenance = f"fitted from {n} report{'s' if n != 1 else ''}"
    if len(counts) >= MIN_FIT_GPU_COUNTS:
        model = ParametricModel.fit(obs, name=name or "fitted")
        rel = [abs(model.samples_per_s(o.gpus, o.nodes, o.local_batch, o.accum) / o.samples_per_s - 1) for o in obs]
        return LearnedModel(model, provenance=provenance, uncertainty=float(np.median(rel)) + 0.05, facts=facts,
                            name=name)
    ratios = np.array([math.log(o.samples_per_s / prior.samples_per_s(o.gpus, o.nodes, o.local_batch, o.accum))
                       for o in obs])
    scale = float(math.exp(ratios.mean()))
    spread = float(ratios.std()) if len(ratios) > 1 else 0.0
    unc = spread + base_unc / (1 + len(counts))
    cap = None
    if prior_kind == "prior":
        cap = max(min_gpus, running_gpus, GROWTH_WHILE_UNCERTAIN * max(counts))
    return LearnedModel(prior, provenance=provenance, uncertainty=unc, scale=scale, max_gpus=cap, facts=facts,
                        name=name)
