"""``dp``: the paper's optimizer -- GPU count *and* global batch per job, exactly, every cycle.

After admission (see :mod:`slurm_elastic.policies._candidates`), the GPUs left over are distributed by an
exact multiple-choice knapsack over every admitted job's allowed GPU counts, each at its best
batch ``b*(k)``: maximise the total weighted speedup, net of restart costs. The numba kernel is in
:mod:`slurm_elastic.policies._mckp`; the algorithm, its complexity and its memory are described in
docs/ALGORITHM.md.
"""

from __future__ import annotations

import math
import time

from slurm_elastic.policies._candidates import Candidates, build_allocation, gc_paused, make_candidates
from slurm_elastic.policies._mckp import mckp
from slurm_elastic.policies._placement import solve_placeable
from slurm_elastic.policies.base import Allocation, AllocationProblem, Policy, bool_option, number_option


class DPPolicy(Policy):
    """Exact DP over (GPU count, batch) per job.

    ``admission``: ``"joint"`` (default; the optimiser decides which pending jobs start: short jobs
    first under ``completion``), ``"priority"`` (pending jobs get their minimum in priority order
    before optimising) or ``"auto"`` (priority while every pending minimum fits, else joint). ``starvation_s``: a pending job blocked this long is admitted first and stops
    later jobs from passing it. ``objective``:

    * ``"completion"`` (default): goodput tables, each job's speedup weighted by its SRPT rank (the
      number of jobs expected to finish no earlier; see :func:`~slurm_elastic.policies._candidates._scale`).
      The rank needs the work jobs have left; a job that reports none is ranked by what jobs of its model
      had left at its attained GPU-seconds (``infer``, default on; mean residual life over the sizes its
      ended jobs ran and its running ones' service so far, :mod:`~slurm_elastic.policies._sizes`; nothing
      the job claims counts). When fewer than half of the jobs report their remaining work and fewer than
      the share ``ranked`` (3/4) have a reported or inferred one, the ranks would rest on guesses (an
      inferred size is an estimate; a job with nothing known ranks as if it had one horizon left), and
      ``unranked`` says what values them instead: ``"pnorm"`` (default; Pollux's p-norm of speedups over
      each job's minimum, which needs no ranks) or ``"las"`` (rank by attained service, as Tiresias).
      Measured on the Pollux workloads 1-5 (docs/EVALUATION.md section 3): with no job reporting, 0.664 /
      1.426 h at 1x / 2x against 0.670 / 1.448 h with ranks once half the jobs had a reported or inferred
      work (``ranked=0.5``, the rule before) and 0.700 / 1.523 h with nothing inferred; with half of them
      reporting, 2x: 1.359 h, where 3/4 reported or inferred alone gave 1.417 h; every job reporting: the
      same as before;
    * ``"goodput"``: total weighted goodput speedup (throughput x statistical efficiency);
    * ``"pnorm"``: Pollux's p-norm (p = -1) of goodput speedups;
    * ``"throughput"``: the paper's total weighted speedup of samples/s (no statistical efficiency).

    Goodput uses each job's reported noise scale, else its app's measured table, else a conservative
    efficiency (``profiles.goodput.efficiency_for_request``). The default was chosen by measurement:
    docs/EVALUATION.md.

    Stability (``realloc="life"``, the default; issue 23): a rescale keeps ``(1 - restart_s / life) x
    (1 - thrash)`` of the new size's value, ``life`` the job's expected remaining life (the progress rule:
    the restart is paid back by the faster rate over what the job has left), ``thrash = restart_margin x
    (1 + backoff x rescales) x restart_s / held`` (``held``: how long it has held its size, with
    ``tenure``), at most ``thrash_cap``: a job just resized or resized often needs a larger gain, but a
    gain above ``1 / (1 - thrash_cap)`` always pays, for any restart cost
    (:func:`~slurm_elastic.policies._candidates._rescale_factor`). Defaults ``restart_margin=4``,
    ``backoff=0`` (were 8 and 0.15: the back-off counted every rescale, those forced on a long job by
    short ones too, so an imagenet job shrunk 47 times for arrivals needed twice its speed to grow onto
    idle GPUs for 9 h; measured over restart costs of 10 s to 10 minutes, one type and Sia's cluster,
    docs/EVALUATION.md). ``realloc="share"``: the charge before
    issue 23 (``restart_margin x (1 + backoff x rescales) x restart_s / min(horizon, remaining, held)``,
    which no gain could pay once a restart cost 450 s). ``round_trip``: a grow also pays the restart
    back to its minimum (off). ``hold`` (on; ``completion``): a grow or a move pays its restart back over
    at most how long the GPUs it takes are expected to stay the job's, measured from how soon grows were
    undone lately (the job's own, with the cluster's at its outranked share as a prior;
    :mod:`~slurm_elastic.policies._hold`), or over the time it has held its size if that is longer: under SRPT ranks a long job's grow lasts until a shorter one
    wants the GPUs, and on Sia's cluster 90 of 153 imagenet grows were undone before they had trained
    for their 250 s restart (docs/EVALUATION.md). ``regrow`` (on; ``completion``): a shrink also pays the
    restart of growing back, at the job's current rate, over as long as it has held its size
    (:func:`~slurm_elastic.policies._candidates._regrow_charge`): the GPUs it gives up go to jobs that end
    sooner, and then it grows back; a job just grown is not bounced for a small gain. Measured on Sia's
    cluster (mean, p99 and longest JCT down at 30 s, per-model and 600 s restarts; level at 10 s) and
    one type (docs/EVALUATION.md). ``rank_cap``: the most a job's SRPT rank may weigh (``completion``).
    ``age_credit`` (``completion``): a job ranks as if it had that many seconds less left per second of
    its age, by at most ``credit_cap`` of what it has left (4 and 0.97, the defaults: once a job has
    waited, only jobs with less than 3% of its remaining work pass it, so what short jobs take from long
    ones is bounded while a new short job still passes an old long one; measured on workloads 1-3 at both
    loads: p95 JCT 2.62 / 5.00 h against 3.07 / 5.55 h with pure SRPT ranks (``age_credit=0``), finish-time
    fairness p95 6.4 at 2x against 33.9 uncapped (``credit_cap=inf``), docs/EVALUATION.md section 3).
    ``fills``: rounds that give GPUs the placement repair left idle to grows that pay (pending jobs
    always start on them). Defaults chosen by measurement (docs/EVALUATION.md sections 3 and 5).
    """

    name = "dp"
    OBJECTIVES = {"completion": ("completion", True), "goodput": ("speedup", True), "pnorm": ("pnorm", True),
                  "throughput": ("speedup", False)}

    def __init__(self, admission: str = "joint", starvation_s: float = 3600.0, objective: str = "completion",
                 placement: bool = True, restart_margin: float = 4.0, tenure: bool | str = True,
                 backoff: float = 0.0, round_trip: bool | str = False, unranked: str = "pnorm",
                 realloc: str = "life", thrash_cap: float = 0.5, rank_cap: float = float("inf"),
                 fills: int = 0, age_credit: float = 4.0, credit_cap: float = 0.97,
                 infer: bool | str = True, ranked: float = 0.75, hold: bool | str = True,
                 regrow: bool | str = True):
        if objective not in self.OBJECTIVES:
            raise ValueError(f"objective must be one of {sorted(self.OBJECTIVES)}, not {objective!r}")
        self.restart_margin = number_option("restart_margin", restart_margin, low=0)
        self.tenure = bool_option("tenure", tenure)
        self.round_trip = bool_option("round_trip", round_trip)
        self.backoff = number_option("backoff", backoff, low=0)
        if realloc not in ("life", "share"):
            raise ValueError(f"realloc must be 'life' or 'share', not {realloc!r}")
        self.realloc = realloc
        self.thrash_cap = number_option("thrash_cap", thrash_cap, low=0, high=1, open_high=True)
        self.rank_cap = number_option("rank_cap", rank_cap, low=1, finite=False)
        self.fills = int(number_option("fills", fills, low=0, whole=True))
        self.age_credit = number_option("age_credit", age_credit, low=0)
        self.credit_cap = number_option("credit_cap", credit_cap, low=0, finite=False)
        if isinstance(infer, str):  # "dp:infer=1"
            if infer.lower() not in ("0", "1", "true", "false", "yes", "no", "pooled"):
                raise ValueError(f"infer must be a boolean or 'pooled', not {infer!r}")
            infer = "pooled" if infer.lower() == "pooled" else infer.lower() in ("1", "true", "yes")
        from slurm_elastic.policies._sizes import SizeHistory

        self.sizes = SizeHistory(pooled=infer == "pooled") if infer else None  # what jobs that report no work left are inferred to have
        self.admission = admission
        self.starvation_s = number_option("starvation_s", starvation_s, low=0, finite=False)
        self.objective = objective
        if unranked not in ("pnorm", "las"):
            raise ValueError(f"unranked must be 'pnorm' or 'las', not {unranked!r}")
        self.unranked = unranked
        self.ranked = number_option("ranked", ranked, low=0, high=1)
        self.placement = bool_option("placement", placement)  # re-solve until the allocation places on the nodes (policies/_placement)
        from slurm_elastic.policies._hold import GrowHold

        self.hold = GrowHold() if bool_option("hold", hold) else None  # how long grows were kept (policies/_hold)
        self.regrow = bool_option("regrow", regrow)  # a shrink pays for growing back (_candidates._regrow_charge)

    def learned(self) -> dict:
        """The sizes ended jobs had (``infer``), kept across a daemon restart."""
        return {"sizes": self.sizes.to_json()} if self.sizes is not None else {}

    def restore(self, learned: dict) -> None:
        if self.sizes is not None and isinstance(learned, dict) and "sizes" in learned:
            from slurm_elastic.policies._sizes import SizeHistory

            self.sizes = SizeHistory.from_json(learned["sizes"], keep=self.sizes.keep, pooled=self.sizes.pooled)

    def objective_for(self, problem: AllocationProblem, inferred: dict | None = None) -> str:
        """The objective this problem is solved with (with ``unranked="pnorm"``): ``completion`` while at
        least half of the jobs report the work they have left, or the share ``ranked`` (3/4) have a
        reported or inferred one, each user counted once (:meth:`_shares`); else ``pnorm``. A reported
        remaining work is the job's own count (under the trust rule); an inferred one is an estimate from
        its model's history, so ranks resting on estimates need more of them. Not across several pools: p-norm values are per pool there
        (``_multipool``), blind to a faster GPU type. ``inferred``: :meth:`_inferred`'s answer, when the
        caller has it."""
        if self.objective != "completion" or self.unranked != "pnorm" or not problem.jobs or len(problem.pools) > 1:
            return self.objective
        rep, known = self._shares(problem, inferred)
        return "completion" if rep >= 0.5 or known >= self.ranked - 1e-12 else "pnorm"

    def _known(self, problem: AllocationProblem, inferred: dict | None = None) -> tuple[int, int]:
        """How many jobs report a remaining work, and for how many more one is inferred."""
        if inferred is None:
            inferred = self._inferred(problem)
        return sum(r.remaining_samples is not None for r in problem.jobs), len(inferred)

    def _shares(self, problem: AllocationProblem, inferred: dict | None = None) -> tuple[float, float]:
        """(share of jobs reporting their work left, share with a reported or inferred one), each user
        counted once: the mean over users of the shares of her jobs. Who submits many jobs, reporting or
        not, must not switch how every other user's jobs are valued; with one user (or none named) these
        are the plain shares of jobs."""
        if inferred is None:
            inferred = self._inferred(problem)
        per: dict[str, list[int]] = {}
        for j, r in enumerate(problem.jobs):
            c = per.setdefault(r.user or "", [0, 0, 0])
            c[0] += 1
            c[1] += r.remaining_samples is not None
            c[2] += r.remaining_samples is not None or j in inferred
        if not per:
            return 0.0, 0.0
        return (sum(c[1] / c[0] for c in per.values()) / len(per), sum(c[2] / c[0] for c in per.values()) / len(per))

    def _inferred(self, problem: AllocationProblem) -> dict[int, float]:
        """Job index -> GPU-seconds left, inferred from its model's ended and running jobs, for jobs that report none
        (``infer``; policies/_sizes)."""
        if self.sizes is None:
            return {}
        out = {}
        for j, r in enumerate(problem.jobs):
            if r.remaining_samples is None:
                est = self.sizes.remaining_gpu_s(r.user, r.spec.profile, r.attained_gpu_s)
                if est is not None:
                    out[j] = est
        return out

    def candidates(self, problem: AllocationProblem) -> Candidates:
        """Admission and the knapsack's choice arrays (the benchmark solves these with every solver)."""
        inferred = self._inferred(problem)
        objective = self.objective_for(problem, inferred)
        value, goodput = self.OBJECTIVES[objective]
        eff = None
        if goodput:
            from slurm_elastic.profiles.goodput import efficiency_for_request as eff
        plan = make_candidates(problem, fixed_batch=False, admission=self.admission,
                               starvation_s=self.starvation_s, efficiency=eff, objective=value,
                               restart_margin=self.restart_margin, tenure=self.tenure, backoff=self.backoff,
                               round_trip=self.round_trip, realloc=self.realloc, thrash_cap=self.thrash_cap,
                               rank_cap=self.rank_cap, age_credit=self.age_credit, credit_cap=self.credit_cap,
                               inferred=inferred, grow_hold=self.hold.hold_s if self.hold is not None else None,
                               regrow=self.regrow)
        if self.hold is not None and plan.ahead:  # the ranks the next cycle's exposure is weighted by
            n = max(1, plan.ranked_among)
            self.hold.note_ranks({problem.jobs[j].job_id: a / n for j, a in plan.ahead.items()
                                  if problem.jobs[j].running_gpus > 0})
        if objective != self.objective:  # the p-norm fallback: a waiting job's reason says why
            n = len(problem.jobs)
            reported, inferred_n = self._known(problem, inferred)
            users = len({r.user or "" for r in problem.jobs})
            if users > 1:
                rep, known = self._shares(problem, inferred)
                plan.valuation = (f"; jobs valued by speedup, not work left: {reported} of {n} report it, {inferred_n} "
                                  f"inferred; by user, {rep:.0%} of a user's jobs report it, {known:.0%} with the "
                                  f"inferred (ranks need 50% or {self.ranked:.0%}; each of the {users} users "
                                  f"counts once)")
            else:
                plan.valuation = (f"; jobs valued by speedup, not work left: {reported} of {n} report it, "
                                  f"{inferred_n} inferred (ranks need {math.ceil(n / 2)} reported or "
                                  f"{math.ceil(self.ranked * n)} in all)")
        return plan

    def allocate(self, problem: AllocationProblem) -> Allocation:
        with gc_paused():
            return self._allocate(problem)

    def _allocate(self, problem: AllocationProblem) -> Allocation:
        if self.hold is not None:
            self.hold.observe(problem.jobs)
        if self.sizes is not None:  # jobs gone since the last cycle: sizes jobs of their models end at
            self.sizes.observe(problem.jobs)
        if len(problem.pools) > 1:  # several pools (issue 13): policies/_multipool.py
            from slurm_elastic.policies._multipool import allocate_pools

            objective = self.objective_for(problem)
            value, goodput = self.OBJECTIVES[objective]
            # the objective decided for the whole problem (no fallback per pool), the same stability rule
            joint = DPPolicy(admission="joint", starvation_s=float("inf"), objective=objective, unranked="las",
                             restart_margin=self.restart_margin, tenure=self.tenure, backoff=self.backoff,
                             round_trip=self.round_trip, realloc=self.realloc, thrash_cap=self.thrash_cap,
                             rank_cap=self.rank_cap, age_credit=self.age_credit, credit_cap=self.credit_cap,
                             infer=False, hold=False)
            joint.hold = self.hold  # measured over the whole cluster, kept across cycles
            joint.sizes = self.sizes  # the history is this policy's, kept across cycles
            return allocate_pools(problem, joint.candidates, admission=self.admission, starvation_s=self.starvation_s,
                                  objective=value, placement=self.placement, name=self.name)
        t0 = time.perf_counter()
        plan = self.candidates(problem)
        chosen = solve_placeable(plan, fills=self.fills, start_fills=1) if self.placement else mckp(plan.offsets, plan.weights, plan.values,
                                                                    plan.capacity)[1]
        return build_allocation(plan, chosen, self.name, time.perf_counter() - t0)
