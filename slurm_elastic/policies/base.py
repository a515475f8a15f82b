"""The policy interface: a pure function from (capacity, jobs) to an allocation of GPUs and batch sizes.

The daemon and the simulator both build an :class:`AllocationProblem` and call ``policy.allocate``;
the planner then turns the :class:`Allocation` into Slurm actions. Policies do no I/O.
"""

from __future__ import annotations

import abc
import math
from collections import Counter
from dataclasses import dataclass, field

from slurm_elastic.profiles.base import ThroughputModel
from slurm_elastic.spec import ElasticSpec


@dataclass(frozen=True)
class JobRequest:
    """One elastic job as a policy sees it. Jobs come to a policy in priority order."""

    job_id: int | str
    spec: ElasticSpec
    model: ThroughputModel
    running_gpus: int = 0  # 0 while pending
    running_batch: int | None = None
    # Checkpoint + requeue + restart time of a rescale: the measured figure, else the spec's (bounded)
    # claim, else the site default (problem.py fills it). None: the spec's ``restart_s``, else 45 s.
    restart_s: float | None = None
    wait_s: float = 0.0  # how long it has been pending (for starvation control)
    # Statistical efficiency (profiles/efficiency.py): the job's gradient noise scale in samples, as the
    # in-job library reports it, and the reference batch it is relative to. None: not measured.
    noise_scale: float | None = None
    base_batch: int | None = None
    # For JCT-aware objectives: GPU-seconds the job has received so far (attained service, as in
    # Tiresias), and the work it has left when it reports its progress.
    attained_gpu_s: float = 0.0
    remaining_samples: float | None = None  # work left, in samples at base_batch (None: not reported)
    # A running job the planner will not resize this cycle (rescale cooldown): policies keep its count.
    frozen: bool = False
    # How long a running job has held its current size (since its last start or resize; None: unknown).
    # The expected life of its next size: a rescale must pay for itself over it (policies/_candidates).
    held_s: float | None = None
    rescales: int = 0  # rescales it has had (the planner's books): each must pay for itself more
    age_s: float | None = None  # time since submission (Pollux's re-allocation factor; None: unknown)
    nodes: tuple[str, ...] = ()  # nodes it holds now (running), for placement-aware policies
    gpus_per_node: int = 0
    # Pools it may run in (issue 13): names of ``AllocationProblem.pools``; () = every pool. A running
    # job's current pool is ``pool`` ("" in a single-pool problem).
    pools: tuple[str, ...] = ()
    pool: str = ""
    # Its throughput model per pool whose GPU type has its own data (pool name, model); other pools use
    # ``model``. ``unscaled_pools``: typed pools where it has no per-type data (``model`` used unscaled).
    pool_models: tuple[tuple[str, ThroughputModel], ...] = ()
    unscaled_pools: tuple[str, ...] = ()
    # Its spec per pool whose GPU type has its own per-GPU batch limit (issue 23, spec
    # ``local_batch_by_type``); other pools use ``spec``.
    pool_specs: tuple[tuple[str, ElasticSpec], ...] = ()
    # Who submitted it ("" unknown): what is learned from a user's ended jobs informs only that user's
    # (policies/_sizes), so naming another user's model buys nothing.
    user: str = ""

    @property
    def is_running(self) -> bool:
        return self.running_gpus > 0

    def model_in(self, pool: str) -> ThroughputModel:
        """Its throughput model in the pool named ``pool`` (its GPU type's data), else ``model``."""
        return dict(self.pool_models).get(pool, self.model) if self.pool_models else self.model

    def spec_in(self, pool: str) -> ElasticSpec | None:
        """Its spec in the pool named ``pool`` (that GPU type's batch limit), else None (``spec`` applies)."""
        return dict(self.pool_specs).get(pool) if self.pool_specs else None

    @property
    def weight(self) -> float:
        return self.spec.weight


@dataclass(frozen=True)
class Pool:
    """A disjoint set of managed nodes that every job sees alike (issue 13): the same partitions, GPU
    type, features and reservations. A job may use a pool when one of its partitions and its gres type
    (or none) and constraint match. ``node_capacity``: (node, GPUs it has for elastic jobs)."""

    name: str
    gpu_type: str = ""
    partitions: tuple[str, ...] = ()
    node_capacity: tuple[tuple[str, int], ...] = ()
    node_size: int = 0  # its most common node GPU count (0: the problem's node_size)

    @property
    def total_gpus(self) -> int:
        return sum(g for _, g in self.node_capacity)


def most_common_size(sizes) -> int:
    """The node size a problem plans with: the most common positive GPU count among ``sizes``, the
    larger on a tie; 0 when there is none."""
    counts = Counter(g for g in sizes if g > 0)
    if not counts:
        return 0
    return max(counts.items(), key=lambda kv: (kv[1], kv[0]))[0]


@dataclass(frozen=True)
class AllocationProblem:
    """GPUs available to elastic jobs, the node size, and the jobs in priority order."""

    total_gpus: int
    node_size: int
    jobs: tuple[JobRequest, ...]
    horizon_s: float = 3600.0  # restart costs are amortised over this planning horizon
    allow_preemption: bool = False  # may a running job be stopped (shrunk to 0)?
    free_gpus_per_node: tuple[int, ...] | None = None  # optional finer capacity, when known
    # (node name, GPUs it has for elastic jobs) per managed node: with the jobs' ``nodes``, lets a
    # policy check that its allocation can be placed (None: a pool, no placement check).
    node_capacity: tuple[tuple[str, int], ...] | None = None
    # Several pools (issue 13): () = one pool, the fields above. When given, ``total_gpus`` and
    # ``node_capacity`` are the sums over the pools.
    pools: tuple[Pool, ...] = ()


@dataclass(frozen=True)
class JobAllocation:
    """What a policy gives one job. ``gpus == 0`` means: not now (stay pending / be stopped)."""

    job_id: int | str
    gpus: int
    nodes: int = 0
    batch: int = 0
    local_batch: int = 0
    accum: int = 1
    samples_per_s: float = 0.0
    reason: str = ""
    pool: str = ""  # the pool chosen (issue 13; "" in a single-pool problem)


@dataclass(frozen=True)
class Allocation:
    """The answer: one entry per job of the problem, the objective value, and how long it took."""

    jobs: dict[int | str, JobAllocation] = field(default_factory=dict)
    objective: float = 0.0
    solve_s: float = 0.0
    policy: str = ""
    # A proven upper bound on ``objective``'s optimum when the solver is not exact (several pools:
    # policies/_multipool.py); ``bound - objective`` is the optimality gap. None: solved exactly.
    bound: float | None = None

    def gpus_used(self) -> int:
        return sum(a.gpus for a in self.jobs.values())


def number_option(name: str, value, *, low: float = float("-inf"), high: float = float("inf"),
                  open_low: bool = False, open_high: bool = False, finite: bool = True,
                  whole: bool = False) -> float:
    """A policy option's number, checked: in ``[low, high]`` (an open end with ``open_low`` /
    ``open_high``), finite unless ``finite=False``, a whole number with ``whole``. Options come as strings
    from ``policy:key=value`` specs, so a bare ``float()`` answers "could not convert string to float",
    and "nan" or "inf" would pass it silently; the error here names the option and what it must be."""
    try:
        x = float(value)
    except (TypeError, ValueError):
        x = None
    ok = (x is not None and not math.isnan(x) and (not finite or math.isfinite(x))
          and (x > low if open_low else x >= low) and (x < high if open_high else x <= high)
          and (not whole or not math.isfinite(x) or x == int(x)))
    if not ok:
        parts = ["a finite" if finite else "a", "whole number" if whole else "number"]
        if low > float("-inf"):
            parts.append(f"{'>' if open_low else '>='} {low:g}")
        if high < float("inf"):
            parts.append(f"{'and ' if low > float('-inf') else ''}{'<' if open_high else '<='} {high:g}")
        raise ValueError(f"{name} must be {' '.join(parts)}, not {value!r}")
    return x


def bool_option(name: str, value) -> bool:
    """A policy option's boolean: a bool, or ``0/1/true/false/yes/no`` from a ``policy:key=value`` spec."""
    if isinstance(value, str):
        v = value.strip().lower()
        if v not in ("0", "1", "true", "false", "yes", "no"):
            raise ValueError(f"{name} must be a boolean (0/1, true/false, yes/no), not {value!r}")
        return v in ("1", "true", "yes")
    return bool(value)


class Policy(abc.ABC):
    """One scheduling policy. Implementations live one per file in ``slurm_elastic/policies/``."""

    name: str = ""
    rigid: bool = False  # starts only at the size it chose (the planner may not start it smaller)
    preemptive: bool = False  # needs the planner to preempt (checkpoint, requeue, hold) running jobs

    @abc.abstractmethod
    def allocate(self, problem: AllocationProblem) -> Allocation:
        """Choose GPUs and batch for every job of ``problem``."""

    def learned(self) -> dict:
        """What the policy learned across cycles that a daemon restart should keep (JSON-able; {}: none)."""
        return {}

    def restore(self, learned: dict) -> None:  # noqa: B027 -- a no-op by default, as learned() returns {}
        """Take back what :meth:`learned` returned before a restart (anything malformed is dropped)."""
