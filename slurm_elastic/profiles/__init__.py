"""Throughput models: how many samples/s a job processes on k GPUs at global batch b.

Registry:

* :func:`load_profile` ``(name)`` -> a shared, cached model for a named measured profile:
  the Pollux apps (``cifar10``, ``bert``, ``deepspeech2``, ``imagenet``, ``ncf``, ``yolov3``, also
  spelled ``pollux.<app>``) and Gavel's job families (``gavel.<gpu>.<model>``, e.g. ``gavel.v100.lm``);
* :func:`model_for_spec` ``(spec, node_size)`` -> the model for a job: its ``profile=`` if named,
  else a parametric fit of its declared ``points``;
* :func:`profile_names` lists every name :func:`load_profile` accepts.
"""

from __future__ import annotations

from functools import cache

from slurm_elastic.profiles.base import ThroughputModel
from slurm_elastic.profiles.parametric import Observation, ParametricModel, fit_error
from slurm_elastic.spec import ElasticSpec, SpecError, ThroughputPoint

__all__ = [
    "ThroughputModel",
    "ParametricModel",
    "Observation",
    "fit_error",
    "load_profile",
    "model_for_spec",
    "model_from_points",
    "profile_names",
]


def profile_names() -> list[str]:
    from slurm_elastic.profiles.gavel import gavel_profile_names
    from slurm_elastic.profiles.measured import POLLUX_APPS

    return list(POLLUX_APPS) + gavel_profile_names()


@cache
def load_profile(name: str) -> ThroughputModel:
    """The measured model called ``name``; raises KeyError naming the known profiles."""
    from slurm_elastic.profiles.gavel import gavel_model
    from slurm_elastic.profiles.measured import POLLUX_APPS, pollux_model

    key = name.strip().lower()
    if key.startswith("pollux."):
        key = key[len("pollux."):]
    if key in POLLUX_APPS:
        return pollux_model(key)
    parts = key.split(".")
    if len(parts) == 3 and parts[0] == "gavel":
        try:
            return gavel_model(parts[1], parts[2])
        except KeyError:
            pass
    raise KeyError(f"unknown profile {name!r} (known: {', '.join(profile_names())})")


def model_from_points(
    points: tuple[ThroughputPoint, ...] | list[ThroughputPoint], spec: ElasticSpec | None, node_size: int
) -> ParametricModel:
    """Fit the parametric model to declared ``(gpus, batch, samples/s)`` points.

    Each point's per-GPU batch and accumulation follow ``spec.split_batch`` (the rule the job runs
    under) and its node count the placement rule for ``node_size``-GPU nodes.
    """
    obs = []
    for p in points:
        split = spec.split_batch(p.gpus, p.batch) if spec is not None else None
        local, accum = split if split is not None else (p.batch / p.gpus, 1)
        try:
            nodes = spec.placement(p.gpus, node_size)[0] if spec is not None else -(-p.gpus // node_size)
        except ValueError:
            nodes = -(-p.gpus // node_size)
        obs.append(Observation(p.gpus, nodes, local, accum, p.samples_per_s))
    return ParametricModel.fit(obs, name="points")


def model_for_spec(spec: ElasticSpec, node_size: int = 4, job_id=None) -> ThroughputModel:
    """The throughput model for a job: its named ``profile``, else a fit of its ``points``.

    Raises :class:`SpecError` (naming the job and field) when the profile is unknown or the spec
    gives neither.
    """
    if spec.profile:
        try:
            return load_profile(spec.profile)
        except KeyError as e:
            raise SpecError(str(e.args[0]), job_id=job_id, field="profile") from None
    if spec.points:
        try:
            return model_from_points(spec.points, spec, node_size)
        except ValueError as e:
            raise SpecError(str(e), job_id=job_id, field="points") from None
    raise SpecError("a job needs a measured 'profile' or throughput 'points'", job_id=job_id, field="profile")
