"""A job's speed on each GPU type, before it has run there. Pure: no I/O.

Why (issue 23): a pending job's model was the same in every pool, so a T4 start looked as good as an
A100 start, and what a job reported on one type was used as-is on another. A job's model on GPU type
``t`` is, first found first:

1. **measured** -- the model knows its own numbers on ``t`` (``model.on_type(t)``: the job reported
   there, profiles/learned.py; or a per-type table such as Sia's);
2. **table** -- a Gavel table for the job's Gavel family on a Gavel type (profiles/gavel.py);
3. **type ratio from N jobs** -- its model on the type its numbers come from (``home``), scaled by how
   much faster ``t`` ran than ``home`` for the cluster's own jobs that reported on both
   (:class:`TypeRatios`), shrunk toward the prior ratio while N is small;
4. **type prior** -- scaled by :data:`TYPE_SPEED`, the measured per-GPU speed of each type;
5. none (an unknown type): the allocator uses the model unscaled and says so.

A model whose ``home`` type is unknown (a prior or profile never run on this cluster) is anchored at
T4 (:data:`ANCHOR`): Pollux's and Sia's base tables were measured on T4s. Only ratios between pools
matter to the allocator, so the anchor changes no choice between types.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from slurm_elastic.profiles.base import ThroughputModel

# Per-GPU samples/s relative to a T4: the prior, until the cluster's own jobs say more. Built only from data
# the simulator does not run at (issue 23: a prior taken from Sia's tables would be told the answer):
# Gavel's measured tables (OSDI'20, profiles/gavel.py; one worker, geometric mean over its models and
# batches) for k80 0.297x and p100 0.943x a v100; for the types Gavel did not measure, the ratio of
# NVIDIA's data-sheet FP32 peaks to the v100's 15.7 TFLOPs (t4 8.1, RTX 2080Ti 13.4, Quadro RTX 6000 16.3,
# A100 19.5). Data-sheet peaks overstate real training speed unevenly (Sia measured the A100 at 0.94x
# to 4.07x a T4 depending on the model): the prior only orders the types until measurements exist.
_V100 = 8.1 / 15.7  # a T4 in v100s, by the data sheets
TYPE_SPEED: Mapping[str, float] = {
    "k80": 0.297 / _V100, "t4": 1.0, "2080ti": 13.4 / 8.1, "quadro": 16.3 / 8.1, "p100": 0.943 / _V100,
    "v100": 1.0 / _V100, "a100": 19.5 / 8.1,
}
# Other names sites give the same GPUs (Sia's cluster names among them): aws (T4), rtx (2080Ti), quad
# (Quadro RTX 6000), dgx (V100), dgx-ext (A100). Ratios learned under one name serve the other.
ALIASES: Mapping[str, str] = {"aws": "t4", "rtx": "2080ti", "rtx2080ti": "2080ti", "quad": "quadro",
                              "dgx": "v100", "dgx-ext": "a100"}
ANCHOR = "t4"
PRIOR_WEIGHT = 2.0  # the prior ratio counts as this many jobs against the cluster's own ratios
USER_RATIO_SPAN = 8.0  # another user's mean type ratio counts within this factor of the prior (TypeRatios)


def canonical(gpu_type: str) -> str:
    t = (gpu_type or "").lower()
    return ALIASES.get(t, t)


def type_speed(gpu_type: str) -> float | None:
    return TYPE_SPEED.get(canonical(gpu_type))


class OnType(ThroughputModel):
    """``inner`` scaled to another GPU type by ``ratio`` (samples/s multiplied, step time divided), with
    where the ratio comes from. Everything else the job reported (noise scale, restart cost, facts) is the
    inner model's."""

    def __init__(self, inner: ThroughputModel, ratio: float, gpu_type: str, provenance: str):
        if not (math.isfinite(ratio) and ratio > 0):
            raise ValueError(f"type ratio must be finite and positive, got {ratio!r}")
        self.inner, self.ratio, self.gpu_type, self.provenance = inner, float(ratio), gpu_type, provenance
        self.name = getattr(inner, "name", "")
        self.source = f"{provenance} (x{self.ratio:.2f} of {getattr(inner, 'source', self.name)})"

    def __getattr__(self, attr):  # noise_scale, base_batch, restart_s, facts, app, max_gpus, ...
        if attr == "inner":
            raise AttributeError(attr)
        return getattr(self.inner, attr)

    def __repr__(self) -> str:
        return f"OnType({self.gpu_type}, x{self.ratio:.3g}, {self.provenance!r}, inner={self.inner!r})"

    def step_time(self, gpus: int, nodes: int, local_batch: int) -> tuple[float, float]:
        step, sync = self.inner.step_time(gpus, nodes, local_batch)
        return step / self.ratio, sync / self.ratio

    def step_times(self, gpus, nodes, local_batch):
        step, sync = self.inner.step_times(gpus, nodes, local_batch)
        return step / self.ratio, sync / self.ratio


class TypeRatios:
    """How much faster one GPU type ran than another for the cluster's own jobs: per job, its latest
    measured ratio (samples/s on ``b`` over ``a`` at the same GPU count and batch); per pair, the geometric
    mean over jobs, shrunk toward the prior (:data:`TYPE_SPEED`) with weight :data:`PRIOR_WEIGHT`. A job's
    ``family`` (its profile or model name; "" none) keys a second level: the ratio over jobs of the same
    family, shrunk toward the cluster's ratio with the same weight (the spread between models is wide:
    an A100 is 0.94x to 4.07x a T4 in Sia's tables). A job's ratio is what it ran at, which its user
    controls (a job can run slowly on one type on purpose), and it informs other users' placement: so
    where only the asking user's jobs saw the pair, theirs is the figure; else every other user is one
    vote, its mean within :data:`USER_RATIO_SPAN` of the prior, in a median with the asking user's own
    mean and (fewer than three votes) the prior: a user's many jobs, or one user in three, cannot move
    what another user's jobs are told, and one other user at most half-way."""

    def __init__(self, speeds: Mapping[str, float] | None = None):
        self._by_job: dict[object, dict[tuple[str, str], float]] = {}
        self._family: dict[object, str] = {}
        self._weight: dict[object, float] = {}
        self._user: dict[object, str] = {}
        # the prior: the built-in measured table, with what the site measured (daemon ``gpu_speed``) over it
        self.set_speeds(speeds or {})

    def observe(self, job_id, a: str, b: str, ratio: float, family: str = "", weight: float = 1.0,
                user: str = "") -> None:
        """``weight``: how many jobs' reports the observation counts as (a profile of several batches
        on every type: more than one); ``user``: who ran the job (one vote per user)."""
        a, b = canonical(a), canonical(b)
        if a == b or not (math.isfinite(ratio) and ratio > 0):
            return
        d = self._by_job.pop(job_id, {})
        self._by_job[job_id] = d  # the latest observed last
        d[(a, b)] = float(ratio)
        d.pop((b, a), None)
        if family:
            self._family[job_id] = family
        if weight != 1.0:
            self._weight[job_id] = float(weight)
        if user:
            self._user[job_id] = user

    def to_json(self) -> list:
        """Per job, oldest first: ``[job id, family, weight, user, [[a, b, ratio], ...]]`` (a daemon restart
        keeps what finished jobs taught; the prior is the config's, not stored)."""
        return [[j, self._family.get(j, ""), self._weight.get(j, 1.0), self._user.get(j, ""),
                 [[a, b, r] for (a, b), r in d.items()]] for j, d in self._by_job.items()]

    def load_json(self, rows, most: int) -> None:
        """:meth:`to_json`'s rows back (the last ``most``), through :meth:`observe`: names are strings of at
        most 256 characters, ratios and weights finite and > 0; anything else is dropped."""
        def name(x) -> bool:
            return isinstance(x, str) and len(x) <= 256

        for row in (rows if isinstance(rows, list) else [])[-most:]:
            if not (isinstance(row, list) and len(row) == 5 and isinstance(row[0], (int, str))
                    and not isinstance(row[0], bool) and name(row[1]) and name(row[3])
                    and isinstance(row[2], (int, float)) and math.isfinite(row[2]) and row[2] > 0
                    and isinstance(row[4], list)):
                continue
            for pair in row[4][:64]:
                if (isinstance(pair, list) and len(pair) == 3 and name(pair[0]) and name(pair[1])
                        and isinstance(pair[2], (int, float)) and not isinstance(pair[2], bool)):
                    self.observe(row[0], pair[0], pair[1], float(pair[2]), family=row[1], weight=float(row[2]),
                                 user=row[3])

    def set_speeds(self, speeds: Mapping[str, float]) -> None:
        """The prior again: the built-in table with ``speeds`` over it (a reloaded site table)."""
        self.speeds = {**TYPE_SPEED, **{canonical(k): float(v) for k, v in speeds.items()}}

    def keep_last(self, n: int) -> None:
        """Keep the ``n`` jobs observed last (a bounded memory that outlives the jobs)."""
        if len(self._by_job) > n:
            self._by_job = dict(list(self._by_job.items())[-n:])
            self._family = {j: f for j, f in self._family.items() if j in self._by_job}
            self._weight = {j: w for j, w in self._weight.items() if j in self._by_job}
            self._user = {j: u for j, u in self._user.items() if j in self._by_job}

    def _logs(self, a: str, b: str, family: str | None, prior: float | None,
              user: str) -> tuple[float, float, int]:
        """(weighted sum of log ratios, total weight, jobs) over the jobs (of ``family``) that saw the pair,
        as ``user``'s jobs are told: only ``user``'s jobs, the plain sums; with other users', the sum is the
        median of the votes (above) times the total weight."""
        per_user: dict[str, list] = {}
        for j, d in self._by_job.items():
            if family is not None and self._family.get(j) != family:
                continue
            x = math.log(d[(a, b)]) if (a, b) in d else -math.log(d[(b, a)]) if (b, a) in d else None
            if x is not None:
                wj = self._weight.get(j, 1.0)
                u = per_user.setdefault(self._user.get(j, ""), [0.0, 0.0, 0])
                u[0], u[1], u[2] = u[0] + wj * x, u[1] + wj, u[2] + 1
        own = per_user.get(user)
        if len(per_user) - (own is not None) == 0:
            return tuple(own) if own else (0.0, 0.0, 0)
        span = math.log(USER_RATIO_SPAN)
        votes = [s / w if prior is None else min(prior + span, max(prior - span, s / w))
                 for u, (s, w, _) in per_user.items() if u != user]
        if own is not None:
            votes.append(own[0] / own[1])
        if len(votes) < 3 and prior is not None:
            votes.append(prior)
        votes.sort()
        k = len(votes)
        median = votes[k // 2] if k % 2 else (votes[k // 2 - 1] + votes[k // 2]) / 2
        w = sum(u[1] for u in per_user.values())
        return median * w, w, sum(u[2] for u in per_user.values())

    def ratio(self, a: str, b: str, family: str = "", user: str = "") -> tuple[float, str] | None:
        """(speed on ``b`` / speed on ``a``, provenance) as ``user``'s jobs are told, or None when nothing
        is known of the pair."""
        a, b = canonical(a or ANCHOR), canonical(b)
        if a == b:
            return 1.0, "measured"
        sa, sb = self.speeds.get(a), self.speeds.get(b)
        prior = math.log(sb / sa) if sa and sb else None
        s, wt, n = self._logs(a, b, None, prior, user)
        if n:
            w = PRIOR_WEIGHT if prior is not None else 0.0
            v = (s + w * (prior or 0.0)) / (wt + w)
            why = f"type ratio from {n} job{'s' if n != 1 else ''}"
        elif prior is not None:
            v, why = prior, "type prior"
        else:
            return None
        if family:
            s, wt, n = self._logs(a, b, family, v if prior is None else prior, user)
            if n:
                v = (s + PRIOR_WEIGHT * v) / (wt + PRIOR_WEIGHT)
                why = f"type ratio from {n} {family} job{'s' if n != 1 else ''} ({why})"
        return math.exp(v), why


def measured_pairs(obs_by_type: Mapping[str, list]) -> dict[tuple[str, str], float]:
    """Per pair of types a job reported on, its ratio: the geometric mean of samples/s on ``b`` over ``a``
    at the (GPU count, local batch, accumulation) configurations measured on both. ``obs_by_type``: type ->
    profiles.parametric.Observation list."""
    keyed = {t: {(o.gpus, o.local_batch, o.accum): o.samples_per_s for o in obs if o.samples_per_s > 0}
             for t, obs in obs_by_type.items() if t}
    out = {}
    types = sorted(keyed)
    for i, a in enumerate(types):
        for b in types[i + 1:]:
            common = keyed[a].keys() & keyed[b].keys()
            if common:
                out[(a, b)] = math.exp(sum(math.log(keyed[b][c] / keyed[a][c]) for c in common) / len(common))
    return out


def measured_on(model: ThroughputModel) -> str:
    """The GPU type a model's numbers are for ("" unknown): its ``gpu_type``, or a Gavel table's."""
    from slurm_elastic.profiles.gavel import GavelModel

    m = model
    for _ in range(4):
        t = getattr(m, "gpu_type", "") or (m.gpu if isinstance(m, GavelModel) else "")
        if t:
            return str(t)
        m = getattr(m, "inner", None)
        if m is None:
            break
    return ""


def model_on_type(model: ThroughputModel, gpu_type: str, home: str = "",
                  ratios: TypeRatios | None = None, family: str = "", user: str = "") -> ThroughputModel | None:
    """The job's model on ``gpu_type`` (module docstring); ``home``: the type its numbers come from ("" =
    unknown: the anchor); ``family``: its kind for the learned ratios (TypeRatios); ``user``: whose job it
    is (another user's reports are one vote). None when nothing is known of ``gpu_type``."""
    t = (gpu_type or "").lower()
    if not t:
        return None
    own = getattr(model, "on_type", None)
    if callable(own):
        m = own(t)
        if m is not None:
            return m
    from slurm_elastic.profiles.gavel import model_on_type as gavel_on_type

    g = gavel_on_type(model, t)
    if g is not None:
        return g
    home = (home or measured_on(model)).lower()
    if canonical(home) == canonical(t):
        return model
    r = (ratios or TypeRatios()).ratio(home, t, family, user)
    if r is None:
        return None
    return OnType(model, r[0], t, r[1])
