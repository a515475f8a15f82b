"""What every policy needs per job: the allowed GPU counts, the best batch for each, and values.

A :class:`JobTable` lists, for one job on one cluster shape, every GPU count the job may run on
(its spec's range, the node-shape rule of :meth:`ElasticSpec.allowed_gpu_counts`, the capacity and
the model's ``max_gpus``) for which some batch is feasible, and for each count ``k`` the batch
``b*(k)`` that maximises the model's samples/s (or goodput, with an ``efficiency`` function):

* the global batch ``b`` ranges over ``[min_batch, max_batch]`` with ``b % k == 0``;
* the per-GPU share ``b / k`` is split exactly as :meth:`ElasticSpec.split_batch` splits it (the
  fewest accumulation steps ``a <= max_accum`` that bring the micro-batch to ``<= max_local_batch``;
  the micro-batch must be ``>= min_local_batch``);
* ties go to the smaller batch. When a count admits more than ``MAX_SHARES`` per-GPU shares (only
  with huge ranges), ``LOG_SHARES`` log-spaced shares are tried instead (then ``b*`` is approximate).
  A job whose exact shares over all its counts exceed ``JOB_SHARES`` gets that budget split over its
  counts (log-spaced). So a table costs ``O(JOB_SHARES log max_accum + counts x max_accum)`` element
  work whatever the spec's ranges, with at most ``min(max_gpus, capacity)`` counts (docs/ALGORITHM.md,
  "What a cycle costs").

Tables are cached per model object (weakly) and per spec shape, so a daemon cycle that sees the
same jobs again does not recompute them.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from slurm_elastic.policies.base import JobRequest
from slurm_elastic.profiles.base import ThroughputModel
from slurm_elastic.spec import ElasticSpec

MAX_SHARES = 1 << 16  # the most per-GPU shares tried exactly on one GPU count
LOG_SHARES = 1 << 12  # log-spaced shares tried instead beyond MAX_SHARES (neighbours ~0.4% apart at 2**24)
# The most shares tried for one job over all its counts: a job whose exact ranges add up to more (only
# huge ranges do) gets log-spaced shares, this budget split over its counts (at least MIN_COUNT_SHARES
# each), so a hostile range costs a cycle no more than an ordinary one (benchmarks/hostile_ranges.py).
JOB_SHARES = 1 << 16
MAX_SIEVE_STEPS = 512  # accumulation steps sieved exactly on one count; more (max_accum in the thousands): bounded split
MIN_COUNT_SHARES = 256


@dataclass(frozen=True)
class JobTable:
    counts: np.ndarray  # int64, ascending
    nodes: np.ndarray
    batch: np.ndarray
    local: np.ndarray
    accum: np.ndarray
    sps: np.ndarray  # float64 samples/s at (counts[i], batch[i])
    value: np.ndarray  # what b*(k) maximises: samples/s, or goodput (samples/s x efficiency)
    mat: np.ndarray = field(default=None, repr=False)  # the 7 columns above as one (7, K) float array
    pos: dict = field(default=None, repr=False)  # count -> row

    def __post_init__(self):
        if self.mat is None:
            cols = (self.counts, self.nodes, self.batch, self.local, self.accum, self.sps, self.value)
            object.__setattr__(self, "mat", np.array(cols, dtype=np.float64).reshape(7, -1))
        if self.pos is None:
            object.__setattr__(self, "pos", {int(k): i for i, k in enumerate(self.counts.tolist())})

    def __len__(self) -> int:
        return int(self.counts.size)

    def index(self, k: int) -> int:
        """Position of count ``k`` in the table, or -1."""
        return self.pos.get(k, -1)


_EMPTY = JobTable(*(np.empty(0, np.int64) for _ in range(5)), np.empty(0, np.float64), np.empty(0, np.float64))
_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _spec_key(spec: ElasticSpec) -> tuple:
    return (spec.min_gpus, spec.max_gpus, spec.min_batch, spec.max_batch, spec.max_local_batch,
            spec.min_local_batch, spec.max_accum, spec.gpus_per_node, spec.batch)


def allowed_counts(spec: ElasticSpec, node_size: int, cap: int, model: ThroughputModel | None = None) -> list[int]:
    """``spec.allowed_gpu_counts(node_size)`` limited to ``cap`` GPUs and the model's ``max_gpus``."""
    hi = min(spec.max_gpus, cap)
    if model is not None and model.max_gpus is not None:
        hi = min(hi, int(model.max_gpus))
    if hi < spec.min_gpus:
        return []
    return spec.allowed_gpu_counts(node_size, most=hi)


def _canonical_split(spec: ElasticSpec, k: int, shares: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Vectorised :meth:`ElasticSpec.split_batch` over per-GPU shares: (local, accum); accum 0 = infeasible.

    Contiguous shares (the exact branch of :func:`best_batch`) are sieved: the canonical accumulation of
    ``s`` is the smallest ``a`` dividing ``s`` with ``s / a <= max_local_batch``, so each ``a`` marks the
    unmarked multiples ``a * l`` (``l <= max_local_batch``) once, in ``O(S log max_accum)`` element work
    and ``max_accum`` steps at most. Other share sets (log-spaced, from huge ranges), and ranges that would
    take more than ``MAX_SIEVE_STEPS`` steps, get :func:`_fast_split`.
    """
    if shares.size == 0:
        return shares.copy(), np.zeros(0, np.int64)
    lo, hi = int(shares[0]), int(shares[-1])
    top = min(spec.max_accum, hi)
    if hi - lo + 1 != shares.size or top - max(1, -(-lo // spec.max_local_batch)) > MAX_SIEVE_STEPS:
        return _fast_split(spec, shares)
    acc = np.zeros(shares.size, np.int64)
    for a in range(max(1, -(-lo // spec.max_local_batch)), top + 1):
        first = max(-(-lo // a), 1) * a  # smallest multiple of a in range
        last = min(hi, a * spec.max_local_batch)
        if first > last:
            continue
        seg = acc[first - lo:last - lo + 1:a]
        seg[seg == 0] = a
        if a % 64 == 0 and acc.all():
            break
    local = np.where(acc > 0, shares // np.maximum(acc, 1), 0)
    bad = (acc == 0) | (local < spec.min_local_batch)
    acc[bad] = 0
    return local, acc


def _fast_split(spec: ElasticSpec, shares: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A bounded split of arbitrary shares: ``a = ceil(s / max_local_batch)`` steps, local ``s // a``, so
    ``a * local <= s`` is feasible (used for the log-spaced candidates of huge ranges, where ``b*`` is
    approximate anyway; the chosen batch is then split canonically by :func:`best_batch`)."""
    acc = np.maximum(1, -(-shares // spec.max_local_batch))
    local = shares // acc
    bad = (acc > spec.max_accum) | (local < spec.min_local_batch) | (local > spec.max_local_batch)
    acc = np.where(bad, 0, acc)
    return local, acc


def best_batch(
    model: ThroughputModel,
    spec: ElasticSpec,
    k: int,
    nodes: int,
    fixed_batch: int | None = None,
    efficiency: Callable[[np.ndarray], np.ndarray] | None = None,
    budget: int = MAX_SHARES,
) -> tuple[int, int, int, float, float] | None:
    """``(batch, local_batch, accum, samples_per_s, value)`` of the best batch on ``k`` GPUs, or None.
    ``budget``: the most shares tried (log-spaced beyond it)."""
    if fixed_batch is not None:
        split = spec.split_batch(k, fixed_batch)
        if split is None:
            return None
        local, acc = split
        raw = float(model.samples_per_s(k, nodes, local, acc))
        v = raw
        if efficiency is not None:
            v *= float(efficiency(np.array([fixed_batch], dtype=np.float64))[0])
        if not np.isfinite(v) or v <= 0:
            return None
        return fixed_batch, local, acc, raw, v
    s_lo = max(-(-spec.min_batch // k), spec.min_local_batch)
    s_hi = min(spec.max_batch // k, spec.max_local_batch * spec.max_accum)
    if s_hi < s_lo:
        return None
    if s_hi - s_lo + 1 <= min(MAX_SHARES, budget):
        shares = np.arange(s_lo, s_hi + 1, dtype=np.int64)
    else:
        shares = np.unique(np.round(np.geomspace(s_lo, s_hi, min(LOG_SHARES, budget))).astype(np.int64))
    local, acc = _canonical_split(spec, k, shares)
    ok = acc > 0
    if not ok.any():
        return None
    shares, local, acc = shares[ok], local[ok], acc[ok]
    shares = acc * local  # the same shares, but for log-spaced ones moved down to what they split into
    raw = np.asarray(model.samples_per_s_array(k, nodes, local.astype(np.float64), acc.astype(np.float64)))
    v = raw * efficiency((shares * k).astype(np.float64)) if efficiency is not None else raw
    v = np.where(np.isfinite(v) & (shares * k >= spec.min_batch), v, -np.inf)
    # The best candidate whose batch splits canonically (always the first for contiguous shares; a few
    # tries for the bounded split of huge ranges), reported with that split.
    for i in np.argsort(-v, kind="stable")[:32].tolist():
        if not np.isfinite(v[i]) or v[i] <= 0:
            return None
        b = int(shares[i] * k)
        split = spec.split_batch(k, b)
        if split is None:
            continue
        if split == (int(local[i]), int(acc[i])):
            return b, int(local[i]), int(acc[i]), float(raw[i]), float(v[i])
        r = float(model.samples_per_s(k, nodes, split[0], split[1]))
        w = r * float(efficiency(np.array([b], dtype=np.float64))[0]) if efficiency is not None else r
        if np.isfinite(w) and w > 0:
            return b, split[0], split[1], r, w
    return None


def job_table(
    model: ThroughputModel,
    spec: ElasticSpec,
    node_size: int,
    cap: int,
    fixed_batch: int | None = None,
    efficiency: Callable[[np.ndarray], np.ndarray] | None = None,
    efficiency_key: object = None,
) -> JobTable:
    """The (cached) table of allowed counts and best batches for one job (see the module docstring)."""
    key = (_spec_key(spec), node_size, cap, fixed_batch, efficiency_key if efficiency is not None else None)
    try:
        per_model = _CACHE.get(model)
        if per_model is None:
            per_model = {}
            _CACHE[model] = per_model
    except TypeError:  # an unhashable / non-weakrefable model: no caching
        per_model = {}
    hit = per_model.get(key)
    if hit is not None:
        return hit
    rows = []
    counts = allowed_counts(spec, node_size, cap, model)
    budget = _share_budget(spec, counts)
    for k in counts:
        n = spec.placement(k, node_size)[0]
        bb = best_batch(model, spec, k, n, fixed_batch, efficiency, budget)
        if bb is not None:
            rows.append((k, n, *bb))
    if not rows:
        table = _EMPTY
    else:
        cols = list(zip(*rows, strict=True))
        table = JobTable(*(np.array(c, dtype=np.int64) for c in cols[:5]),
                         *(np.array(c, dtype=np.float64) for c in cols[5:]))
    if len(per_model) > 4096:
        per_model.clear()
    per_model[key] = table
    return table


def _share_budget(spec: ElasticSpec, counts: list[int]) -> int:
    """Shares per count: every exact one while the job's counts add up to at most ``JOB_SHARES``, else
    that budget split over its counts."""
    total = 0
    for k in counts:
        lo = max(-(-spec.min_batch // k), spec.min_local_batch)
        total += max(0, min(spec.max_batch // k, spec.max_local_batch * spec.max_accum) - lo + 1)
        if total > JOB_SHARES:
            return max(MIN_COUNT_SHARES, JOB_SHARES // max(1, len(counts)))
    return MAX_SHARES


DEFAULT_RESTART_S = 45.0  # a request's restart cost when neither it nor its spec gives one


def restart_s(req: JobRequest) -> float:
    """A rescale's cost in seconds: the request's (measured, else the spec's bounded claim, else the
    site default: problem.py), else, for a request built without one, the spec's ``restart_s``, else 45 s.
    Not the spec's over a measured figure: a claimed cost of days would make every rescale of the job
    unpayable, so it could never be shrunk for another user's job."""
    if req.restart_s is not None:
        return float(req.restart_s)
    return float(req.spec.restart_s if req.spec.restart_s is not None else DEFAULT_RESTART_S)


def current_samples_per_s(req: JobRequest, node_size: int) -> float | None:
    """What a running job does now (its current GPUs and batch), if the model can say (cached)."""
    if req.running_gpus <= 0 or req.running_batch is None:
        return None
    key = ("current", _spec_key(req.spec), node_size, req.running_gpus, req.running_batch)
    try:
        per_model = _CACHE.setdefault(req.model, {})
    except TypeError:
        per_model = {}
    if key in per_model:
        return per_model[key]
    v = _current(req, node_size)
    per_model[key] = v
    return v


def _current(req: JobRequest, node_size: int) -> float | None:
    k = req.running_gpus
    b = req.running_batch
    try:
        n = req.spec.placement(k, node_size)[0]
    except ValueError:
        n = -(-k // node_size)
    if b is None:
        return None
    split = req.spec.split_batch(k, b)
    if split is None:
        local, acc = b / k, 1
    else:
        local, acc = split
    try:
        v = float(req.model.samples_per_s(k, n, local, acc))
    except (ValueError, ZeroDivisionError):
        return None
    return v if np.isfinite(v) and v > 0 else None


def pct(new: float, old: float | None) -> str:
    if not old:
        return ""
    return f"{100.0 * (new / old - 1.0):+.0f}% samples/s"
