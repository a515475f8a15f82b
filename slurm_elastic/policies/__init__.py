"""Scheduling policies: pure functions from (capacity, jobs) to GPUs and batch sizes per job.

``get_policy(name, **options)`` returns one of:

* ``dp`` -- the paper's optimizer: exact knapsack DP over GPU count and batch (:mod:`.dp`);
* ``fixed-batch`` -- elastic GPU count at the requested batch, greedy as Optimus (:mod:`.fixed_batch`);
* ``static`` -- FIFO gang scheduling at the requested GPUs and batch, never resized (:mod:`.static`);
* ``pollux-dp`` -- Pollux's objective (goodput, p-norm p=-1, Pollux's re-allocation factor) solved by our DP (:mod:`.pollux`);
* ``tiresias`` -- Tiresias's 2D-LAS, rigid sizes, preemptive (:mod:`.tiresias`);
* ``sia`` -- Sia's objective (per-job normalised goodput across GPU types) solved by our optimizer (:mod:`.sia`);
* ``gavel`` -- Gavel's heterogeneity-aware max-min fairness, rigid sizes, rounds (:mod:`.gavel`).
"""

from slurm_elastic.policies.base import Allocation, AllocationProblem, JobAllocation, JobRequest, Policy

POLICY_NAMES = ("dp", "fixed-batch", "static", "pollux-dp", "tiresias", "sia", "gavel")

__all__ = ["Allocation", "AllocationProblem", "JobAllocation", "JobRequest", "Policy", "POLICY_NAMES", "get_policy"]


def get_policy(name: str, **options) -> Policy:
    """A new policy object by name (``dp``, ``fixed-batch``/``fixed_batch``, ``static``, ``pollux-dp``,
    ``tiresias``, ``sia``, ``gavel``); an option the policy does not have is an error that lists the ones
    it has (a misspelt ``dp:age_credt=8`` must not run the defaults)."""
    import inspect

    cls = _policy_class(name)
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    known = [p.name for p in inspect.signature(cls.__init__).parameters.values() if p.kind in kinds and p.name != "self"]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"policy {cls.name!r} has no option {', '.join(map(repr, unknown))} "
                         f"(its options: {', '.join(known) or 'none'})")
    return cls(**options)


def _policy_class(name: str) -> type[Policy]:
    key = name.strip().lower().replace("_", "-")
    if key == "dp":
        from slurm_elastic.policies.dp import DPPolicy

        return DPPolicy
    if key == "fixed-batch":
        from slurm_elastic.policies.fixed_batch import FixedBatchPolicy

        return FixedBatchPolicy
    if key == "static":
        from slurm_elastic.policies.static import StaticPolicy

        return StaticPolicy
    if key == "pollux-dp":
        from slurm_elastic.policies.pollux import PolluxDPPolicy

        return PolluxDPPolicy
    if key == "tiresias":
        from slurm_elastic.policies.tiresias import TiresiasPolicy

        return TiresiasPolicy
    if key == "sia":
        from slurm_elastic.policies.sia import SiaPolicy

        return SiaPolicy
    if key == "gavel":
        from slurm_elastic.policies.gavel import GavelPolicy

        return GavelPolicy
    raise KeyError(f"unknown policy {name!r} (known: {', '.join(POLICY_NAMES)})")
