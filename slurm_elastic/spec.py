"""The elastic job spec (what a user promises at submit time) and the daemon's decision record.

A job declares itself elastic in its Slurm ``Comment``::

    #SBATCH --comment="elastic:min_gpus=1,max_gpus=8,min_batch=128,max_batch=4096,max_local_batch=512"

The comment is the one free-text field every Slurm version carries verbatim through ``squeue --json``
and that the user controls. The daemon writes its decision (GPU count, node count, global batch for
the next start) into ``AdminComment``, which only root/SlurmUser/operators can set, so a user cannot
forge it and the job can read it back from its own Slurm record when it starts.

Parsing is strict: unknown keys, non-integers, ``min > max`` and batch ranges that no allowed GPU
count can reach raise :class:`SpecError`, which names the job and the field. This module does no I/O.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, fields, replace

SPEC_PREFIX = "elastic:"
DECISION_PREFIX = "elastic-decision:"

# Bounds that keep hostile input (batch 10**18, GPU counts past any cluster) out of the optimizer.
# The site maximum for batch sizes (global, per GPU, points): 2**24 = 16,777,216 samples. No real job
# reaches it: the largest published data-parallel batches are ~64k-128k images (LARS/LAMB ImageNet)
# and ~65k sequences (BERT with LAMB); a user who counts tokens as samples (a 4M-token LLM batch, 2**22)
# still fits. It bounds the arithmetic on batches, not the work of a cycle: nothing walks a batch range
# (see docs/ALGORITHM.md, "What a cycle costs"). The same bound is in plugins/job_submit_elastic.lua.
MAX_GPUS_LIMIT = 1 << 20
MAX_BATCH_LIMIT = 1 << 24
MAX_ACCUM_LIMIT = 1 << 12
MAX_POINTS = 256
_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
# ckpt_dir may not be (or be under) a system directory: the daemon reads there as root. A trailing
# "*" matches any name that starts so (/var/lib/slurm-llnl, /var/lib/slurm-elastic). Same list in the plugin.
SYSTEM_DIRS = ("/etc", "/usr", "/bin", "/sbin", "/lib*", "/boot", "/dev", "/proc", "/sys", "/run", "/root",
               "/var/lib/slurm*", "/var/spool/slurm*", "/var/run", "/var/log", "/var/lib/munge", "/var/lib/dpkg")


def system_dir_of(path: str) -> str | None:
    """The system directory that ``path`` is or lies under (``/`` itself included), else None."""
    norm = "/" + "/".join(p for p in path.split("/") if p not in ("", "."))
    if norm == "/":
        return "/"
    for d in SYSTEM_DIRS:
        if d.endswith("*"):
            if norm.startswith(d[:-1]):
                return d
        elif norm == d or norm.startswith(d + "/"):
            return d
    return None
_INT_RE = re.compile(r"^[0-9]{1,15}$")
_PARTS_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}(\+[A-Za-z0-9_.\-]{1,64}){0,31}$")
_FLOAT_RE = re.compile(r"^[0-9]{1,15}(\.[0-9]{1,12})?([eE][+-]?[0-9]{1,3})?$")


class SpecError(ValueError):
    """A malformed elastic spec or decision. ``job_id`` and ``field`` say where."""

    def __init__(self, message: str, *, job_id: int | str | None = None, field: str | None = None):
        self.job_id = job_id
        self.field = field
        self.reason = message
        where = []
        if job_id is not None:
            where.append(f"job {job_id}")
        if field is not None:
            where.append(f"field '{field}'")
        super().__init__(f"{', '.join(where)}: {message}" if where else message)


def _num(v: float) -> str:
    """Shortest text that parses back to the same float (``:g`` rounds to 6 digits: 112300.1 -> 112300)."""
    return repr(float(v)).removesuffix(".0")


@dataclass(frozen=True)
class ThroughputPoint:
    """One measured (or declared) operating point: ``gpus`` GPUs at global ``batch`` gave ``samples_per_s``."""

    gpus: int
    batch: int
    samples_per_s: float


@dataclass(frozen=True)
class ElasticSpec:
    """What the daemon may do with a job: the GPU and batch ranges it accepts, and how it scales."""

    min_gpus: int
    max_gpus: int
    min_batch: int
    max_batch: int
    max_local_batch: int
    batch: int | None = None  # the batch the user asked for (used by fixed-batch/static, and without a decision)
    gpus: int | None = None  # the GPU count the user asked for (static); defaults to min_gpus
    min_local_batch: int = 1
    max_accum: int = 1  # largest gradient-accumulation factor (1 = none)
    gpus_per_node: int | None = None  # fixed per-node shape, if the job needs one
    profile: str | None = None  # name of a measured throughput profile, e.g. "cifar10"
    # Emulated GPUs only: the job sleeps each step to this profile's step time (train/pacing.py). To the
    # daemon a claim that buys nothing: never a model, only shown by status.
    pace: str | None = None
    points: tuple[ThroughputPoint, ...] = field(default_factory=tuple)
    weight: float = 1.0
    restart_s: float | None = None  # the user's estimate of checkpoint + restart time
    ckpt_dir: str | None = None  # where the job's checkpoints, stop acks and throughput reports go (%j = job id)
    max_failures: int = 0  # crash policy: requeue from the last checkpoint after up to this many failures
    # Issue 23: a lower per-GPU batch limit on GPU types with less memory, ``(type, max_local_batch)``
    # (spec key ``local_batch_by_type=t4:16|rtx:32``); ``max_local_batch`` is the limit on every other type.
    local_batch_by_type: tuple[tuple[str, int], ...] = field(default_factory=tuple)

    def on_type(self, gpu_type: str) -> ElasticSpec:
        """The spec as it runs on ``gpu_type``: that type's per-GPU batch limit, when it has one."""
        for t, lim in self.local_batch_by_type:
            if t == gpu_type and lim != self.max_local_batch:
                return replace(self, max_local_batch=lim, local_batch_by_type=())
        return self
    resume: str = "auto"  # "must": continuing a run; no checkpoint in ckpt_dir is an error, not a fresh start

    def checkpoint_dir(self, job_id: int | str, work_dir: str | None = None) -> str | None:
        """The job's checkpoint directory: ``ckpt_dir`` with ``%j`` replaced by the job id, else the
        template's default ``<work_dir>/elastic-ckpt/<job_id>`` when the working directory is known."""
        if self.ckpt_dir:
            return self.ckpt_dir.replace("%j", str(job_id))
        if work_dir:
            return f"{work_dir.rstrip('/')}/elastic-ckpt/{job_id}"
        return None

    @property
    def requested_batch(self) -> int:
        return self.batch if self.batch is not None else self.min_batch

    @property
    def requested_gpus(self) -> int:
        return self.gpus if self.gpus is not None else self.min_gpus

    def allowed_gpu_counts(self, node_size: int, most: int | None = None) -> list[int]:
        """GPU counts this job may run on, on nodes of ``node_size`` GPUs (at most ``most`` of them).

        The placement rule: ``k <= node_size`` runs on one node; a larger ``k`` takes whole nodes
        (``k`` a multiple of ``node_size``). With ``gpus_per_node=g`` the job runs ``g`` per node,
        so ``k`` is ``g`` times a node count (``g <= node_size``).

        The counts are generated from the bounds, never by walking ``min_gpus..max_gpus``: the work is
        the length of the answer, which callers bound with ``most`` (the GPUs a cluster or cap holds).
        """
        hi = self.max_gpus if most is None else min(self.max_gpus, most)
        lo = self.min_gpus
        if hi < lo or node_size <= 0:
            return []
        if self.gpus_per_node is not None:
            g = self.gpus_per_node
            if g > node_size:
                return []
            return list(range(-(-lo // g) * g, hi + 1, g))
        small = list(range(lo, min(hi, node_size) + 1))
        first = max(-(-lo // node_size), 2) * node_size  # multiples of node_size above one node
        return small + list(range(first, hi + 1, node_size))

    def placement(self, gpus: int, node_size: int) -> tuple[int, int]:
        """``(nodes, gpus_per_node)`` for ``gpus`` GPUs under the rule of :meth:`allowed_gpu_counts`."""
        per_node = self.gpus_per_node or (gpus if gpus <= node_size or node_size <= 0 else node_size)
        if gpus % per_node:
            raise ValueError(f"{gpus} GPUs do not fill whole nodes of {per_node}")
        return gpus // per_node, per_node

    def split_batch(self, gpus: int, batch: int) -> tuple[int, int] | None:
        """``(local_batch, accum_steps)`` for a global ``batch`` on ``gpus`` GPUs, or None if infeasible.

        Feasible means: ``batch`` divides evenly over the GPUs, and the per-GPU share divides into
        ``accum_steps <= max_accum`` equal micro-batches of at most ``max_local_batch`` and at least
        ``min_local_batch`` samples. The fewest accumulation steps are chosen.
        """
        if gpus <= 0 or batch < self.min_batch or batch > self.max_batch or batch % gpus:
            return None
        share = batch // gpus
        first = max(1, -(-share // self.max_local_batch))
        for accum in range(first, min(self.max_accum, share) + 1):
            if share % accum == 0:
                local = share // accum
                if local < self.min_local_batch:
                    return None
                return local, accum
        return None

    def share_bounds(self, gpus: int) -> tuple[int, int]:
        """The per-GPU shares ``[lo, hi]`` a batch on ``gpus`` GPUs can have (empty when ``lo > hi``)."""
        lo = max(-(-self.min_batch // gpus), self.min_local_batch)
        hi = min(self.max_batch // gpus, self.max_local_batch * self.max_accum)
        return lo, hi

    def nearest_batch(self, gpus: int, target: int | None = None) -> int | None:
        """The feasible global batch on ``gpus`` GPUs nearest to ``target`` (ties: the smaller; no target:
        the smallest), or None: what ``min(feasible_batches(gpus), key=...)`` answers, computed from the
        bounds in at most ``max_accum`` steps whatever the range holds.

        A per-GPU share ``s`` splits (see :meth:`split_batch`) exactly when ``s = a * l`` for some
        ``a <= max_accum`` and ``min_local_batch <= l <= max_local_batch`` (the fewest steps ``a' <= a``
        that divide ``s`` leave a micro-batch ``>= l``), so for each ``a`` the nearest such share is a
        clamped rounding of ``target / (gpus * a)``.
        """
        if gpus <= 0:
            return None
        s_lo, s_hi = self.share_bounds(gpus)
        if s_lo > s_hi:
            return None
        t = 0 if target is None else target  # compared as global batches: integers, exact ties
        best = None
        for a in range(1, min(self.max_accum, s_hi) + 1):
            l_lo = max(self.min_local_batch, -(-s_lo // a))
            l_hi = min(self.max_local_batch, s_hi // a)
            if l_lo > l_hi:
                continue
            f = t // (gpus * a)
            for v in (f, f + 1):
                b = gpus * a * min(max(v, l_lo), l_hi)
                key = (abs(b - t), b)
                if best is None or key < best:
                    best = key
        return None if best is None else best[1]

    def has_batch(self, gpus: int) -> bool:
        """Whether any global batch in range runs on ``gpus`` GPUs (bounded: see :meth:`nearest_batch`)."""
        return self.nearest_batch(gpus) is not None

    def feasible_batches(self, gpus: int, limit: int = 1 << 16) -> list[int]:
        """Every global batch in range that ``gpus`` GPUs can run (see :meth:`split_batch`), in order.

        A listing, for tests and small tools: it refuses (ValueError) a range of more than ``limit``
        candidate batches. The daemon, the policies and the simulator never list a range; they use
        :meth:`nearest_batch`, :meth:`share_bounds` or a bounded candidate set.
        """
        s_lo, s_hi = self.share_bounds(gpus) if gpus > 0 else (1, 0)
        if s_hi - s_lo + 1 > limit:
            raise ValueError(f"{s_hi - s_lo + 1} candidate batches on {gpus} GPUs: more than {limit} to list")
        return [s * gpus for s in range(s_lo, s_hi + 1) if self.split_batch(gpus, s * gpus) is not None]

    def to_comment(self) -> str:
        """The canonical ``elastic:...`` string for this spec (round-trips through :func:`parse_spec`)."""
        parts = []
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name == "points":
                if v:
                    parts.append("points=" + "|".join(f"{p.gpus}x{p.batch}@{_num(p.samples_per_s)}" for p in v))
                continue
            if f.name == "local_batch_by_type":
                if v:
                    parts.append("local_batch_by_type=" + "|".join(f"{t}:{n}" for t, n in v))
                continue
            if v is None or v == f.default:
                if f.name not in _REQUIRED:
                    continue
            parts.append(f"{f.name}={_num(v)}" if isinstance(v, float) else f"{f.name}={v}")
        return SPEC_PREFIX + ",".join(parts)


_REQUIRED = ("min_gpus", "max_gpus", "min_batch", "max_batch", "max_local_batch")
_INT_FIELDS = {
    "min_gpus": MAX_GPUS_LIMIT,
    "max_gpus": MAX_GPUS_LIMIT,
    "gpus": MAX_GPUS_LIMIT,
    "gpus_per_node": MAX_GPUS_LIMIT,
    "min_batch": MAX_BATCH_LIMIT,
    "max_batch": MAX_BATCH_LIMIT,
    "batch": MAX_BATCH_LIMIT,
    "max_local_batch": MAX_BATCH_LIMIT,
    "min_local_batch": MAX_BATCH_LIMIT,
    "max_accum": MAX_ACCUM_LIMIT,
}
_FLOAT_FIELDS = {"weight": 1e6, "restart_s": 1e7}
MAX_FAILURES_LIMIT = 100
_KNOWN = set(_INT_FIELDS) | set(_FLOAT_FIELDS) | {"profile", "pace", "points", "ckpt_dir", "max_failures",
                                                  "local_batch_by_type", "resume"}
MAX_TYPE_LIMITS = 16
_TYPE_LIMIT_RE = re.compile(r"([A-Za-z0-9_.-]{1,64}):([0-9]{1,15})")
_PATH_RE = re.compile(r"^/[A-Za-z0-9_./%+-]{0,255}$")


# ASCII whitespace, exactly Lua's %s (C isspace): the plugin and this parser trim the same characters.
_WS = " \t\n\r\v\f"


def _invisible(c: str) -> bool:
    """A character that may hide before the prefix: ASCII space/control, DEL, or any non-ASCII one
    (NBSP, zero-width space, BOM, ...). In UTF-8 bytes: <= 0x20, 0x7f or >= 0x80, which is the rule
    the Lua plugin applies byte by byte, so both sides agree on every string."""
    o = ord(c)
    return o <= 0x20 or o == 0x7F or o >= 0x80


def comment_kind(comment: str | None) -> str:
    """``"elastic"``, ``"malformed"`` or ``"plain"``: THE rule for "is this job elastic" (docs/SPEC.md).

    Elastic: the comment starts with ``elastic:`` at its first character. Malformed: ``elastic:`` in
    any ASCII letter case, or behind whitespace, control or non-ASCII characters (``" elastic:"``,
    ``"\x1felastic:"``, ``"\u00a0elastic:"``, ``"Elastic:"``): such a comment declares intent but
    is refused by the plugin and reported by the daemon, never run as a plain job behind its back
    nor managed. Everything else is plain (not elastic).
    """
    if not comment:
        return "plain"
    if comment.startswith(SPEC_PREFIX):
        return "elastic"
    i = 0
    while i < len(comment) and _invisible(comment[i]):
        i += 1
    head = comment[i:i + len(SPEC_PREFIX)]
    return "malformed" if head.isascii() and head.lower() == SPEC_PREFIX else "plain"


def is_elastic_comment(comment: str | None) -> bool:
    """True when a job's comment declares it elastic (whether or not the spec is valid, or even
    well-placed: a malformed prefix is elastic intent that :func:`parse_spec` refuses)."""
    return comment_kind(comment) != "plain"


def _parse_int(value: str, name: str, job_id, limit: int) -> int:
    if not _INT_RE.match(value):
        raise SpecError(f"expected a positive integer, got {value!r}", job_id=job_id, field=name)
    n = int(value)
    if n < 1:
        raise SpecError("must be at least 1", job_id=job_id, field=name)
    if n > limit:
        raise SpecError(f"{n} exceeds the limit {limit}", job_id=job_id, field=name)
    return n


def _parse_float(value: str, name: str, job_id, limit: float) -> float:
    if not _FLOAT_RE.match(value):
        raise SpecError(f"expected a non-negative number, got {value!r}", job_id=job_id, field=name)
    x = float(value)
    if not math.isfinite(x) or x > limit:
        raise SpecError(f"{value} is out of range (0..{limit:g})", job_id=job_id, field=name)
    return x


def _parse_points(value: str, job_id) -> tuple[ThroughputPoint, ...]:
    pts = []
    items = value.split("|")
    if len(items) > MAX_POINTS:
        raise SpecError(f"at most {MAX_POINTS} points", job_id=job_id, field="points")
    for item in items:
        m = re.fullmatch(r"([0-9]{1,7})x([0-9]{1,13})@([0-9.eE+-]{1,30})", item)
        if not m:
            raise SpecError(
                f"expected GPUSxBATCH@SAMPLES_PER_S items joined by '|', got {item!r}", job_id=job_id, field="points"
            )
        k = _parse_int(m.group(1), "points", job_id, MAX_GPUS_LIMIT)
        b = _parse_int(m.group(2), "points", job_id, MAX_BATCH_LIMIT)
        t = _parse_float(m.group(3), "points", job_id, 1e12)
        if t <= 0:
            raise SpecError(f"throughput must be positive in {item!r}", job_id=job_id, field="points")
        pts.append(ThroughputPoint(k, b, t))
    return tuple(pts)


def _parse_type_limits(value: str, job_id) -> tuple[tuple[str, int], ...]:
    items = value.split("|")
    if len(items) > MAX_TYPE_LIMITS:
        raise SpecError(f"at most {MAX_TYPE_LIMITS} GPU types", job_id=job_id, field="local_batch_by_type")
    out: dict[str, int] = {}
    for item in items:
        m = _TYPE_LIMIT_RE.fullmatch(item)
        if not m:
            raise SpecError(f"expected TYPE:MAX_LOCAL_BATCH items joined by '|', got {item[:40]!r}", job_id=job_id,
                            field="local_batch_by_type")
        if m.group(1) in out:
            raise SpecError(f"GPU type {m.group(1)!r} given twice", job_id=job_id, field="local_batch_by_type")
        out[m.group(1)] = _parse_int(m.group(2), "local_batch_by_type", job_id, MAX_BATCH_LIMIT)
    return tuple(out.items())


def parse_spec(comment: str, job_id: int | str | None = None) -> ElasticSpec:
    """Parse an ``elastic:key=value,...`` comment into an :class:`ElasticSpec`; raise only SpecError."""
    if not isinstance(comment, str):
        raise SpecError("the comment is not text", job_id=job_id, field="comment")
    kind = comment_kind(comment)
    if kind == "malformed":
        raise SpecError(
            f"the comment must start with {SPEC_PREFIX!r} at its first character (found whitespace, control "
            "or non-ASCII characters, or another letter case, before it)", job_id=job_id, field="comment")
    if kind != "elastic":
        raise SpecError(f"an elastic spec starts with {SPEC_PREFIX!r}", job_id=job_id, field="comment")
    body = comment[len(SPEC_PREFIX):]
    if len(body.encode("utf-8", "surrogatepass")) > 4096:  # bytes, as the plugin counts
        raise SpecError("the spec is longer than 4096 characters", job_id=job_id, field="comment")
    values: dict[str, object] = {}
    for item in body.split(","):
        item = item.strip(_WS)
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(_WS), value.strip(_WS)
        if not sep:
            raise SpecError(f"expected key=value, got {item!r}", job_id=job_id, field=key or "comment")
        if not key:
            raise SpecError(f"empty key in {item[:40]!r}", job_id=job_id, field="comment")
        if key not in _KNOWN:
            key = key[:40]
            raise SpecError(f"unknown key (known: {', '.join(sorted(_KNOWN))})", job_id=job_id, field=key)
        if key in values:
            raise SpecError("given twice", job_id=job_id, field=key)
        if key in _INT_FIELDS:
            values[key] = _parse_int(value, key, job_id, _INT_FIELDS[key])
        elif key in _FLOAT_FIELDS:
            values[key] = _parse_float(value, key, job_id, _FLOAT_FIELDS[key])
        elif key == "max_failures":
            if not re.fullmatch(r"[0-9]{1,3}", value) or int(value) > MAX_FAILURES_LIMIT:
                raise SpecError(f"expected an integer 0..{MAX_FAILURES_LIMIT}, got {value[:40]!r}",
                                job_id=job_id, field=key)
            values[key] = int(value)
        elif key == "resume":
            if value not in ("auto", "must"):
                raise SpecError(f"expected auto or must, got {value[:40]!r}", job_id=job_id, field=key)
            values[key] = value
        elif key == "ckpt_dir":
            if not _PATH_RE.match(value) or "/../" in value + "/" or "%" in value.replace("%j", ""):
                raise SpecError(
                    f"expected an absolute path of [A-Za-z0-9_./+-] (and %j for the job id), got {value[:80]!r}",
                    job_id=job_id,
                    field=key,
                )
            sysdir = system_dir_of(value)
            if sysdir:
                raise SpecError(f"{value[:80]!r} is a system directory ({sysdir}); use a directory of your own",
                                job_id=job_id, field=key)
            values[key] = value
        elif key == "local_batch_by_type":
            values[key] = _parse_type_limits(value, job_id)
        elif key in ("profile", "pace"):
            if not _NAME_RE.match(value):
                raise SpecError(f"expected a profile name ([A-Za-z0-9_.-]), got {value!r}", job_id=job_id, field=key)
            values[key] = value
        else:
            values[key] = _parse_points(value, job_id)
    for key in _REQUIRED:
        if key not in values:
            raise SpecError("required", job_id=job_id, field=key)
    if "weight" in values and values["weight"] <= 0:
        raise SpecError("must be positive", job_id=job_id, field="weight")
    spec = ElasticSpec(**values)  # type: ignore[arg-type]
    validate_spec(spec, job_id)
    return spec


def validate_spec(spec: ElasticSpec, job_id: int | str | None = None, node_size: int | None = None) -> None:
    """Check the cross-field rules; with ``node_size`` also that some placement on such nodes exists."""
    if spec.min_gpus > spec.max_gpus:
        raise SpecError(f"min_gpus {spec.min_gpus} > max_gpus {spec.max_gpus}", job_id=job_id, field="min_gpus")
    if spec.min_batch > spec.max_batch:
        raise SpecError(f"min_batch {spec.min_batch} > max_batch {spec.max_batch}", job_id=job_id, field="min_batch")
    if spec.min_local_batch > spec.max_local_batch:
        raise SpecError(
            f"min_local_batch {spec.min_local_batch} > max_local_batch {spec.max_local_batch}",
            job_id=job_id,
            field="min_local_batch",
        )
    for t, lim in spec.local_batch_by_type:
        if not spec.min_local_batch <= lim <= spec.max_local_batch:
            raise SpecError(f"the limit {lim} on {t} is outside [min_local_batch {spec.min_local_batch}, "
                            f"max_local_batch {spec.max_local_batch}] (max_local_batch is the largest type's)",
                            job_id=job_id, field="local_batch_by_type")
    if spec.batch is not None and not spec.min_batch <= spec.batch <= spec.max_batch:
        raise SpecError(
            f"batch {spec.batch} is outside [{spec.min_batch}, {spec.max_batch}]", job_id=job_id, field="batch"
        )
    if spec.gpus is not None and not spec.min_gpus <= spec.gpus <= spec.max_gpus:
        raise SpecError(f"gpus {spec.gpus} is outside [{spec.min_gpus}, {spec.max_gpus}]", job_id=job_id, field="gpus")
    if spec.gpus_per_node is not None and spec.max_gpus < spec.gpus_per_node:
        raise SpecError(
            f"gpus_per_node {spec.gpus_per_node} > max_gpus {spec.max_gpus}", job_id=job_id, field="gpus_per_node"
        )
    if node_size is not None and spec.gpus_per_node is not None and spec.gpus_per_node > node_size:
        raise SpecError(
            f"gpus_per_node {spec.gpus_per_node} exceeds the node size {node_size}", job_id=job_id, field="gpus_per_node"
        )
    # Some allowed GPU count must reach the batch range (cheap check: no enumeration of huge ranges).
    counts = range(spec.min_gpus, min(spec.max_gpus, spec.min_gpus + 4096) + 1)
    if spec.gpus_per_node is not None:
        counts = [k for k in counts if k % spec.gpus_per_node == 0]
    if node_size is not None:
        allowed = set(spec.allowed_gpu_counts(node_size, most=spec.min_gpus + 4096))
        counts = [k for k in counts if k in allowed]
    if not any(_reachable(spec, k) for k in counts):
        raise SpecError(
            f"no allowed GPU count in [{spec.min_gpus}, {spec.max_gpus}] can run a global batch in "
            f"[{spec.min_batch}, {spec.max_batch}] with {spec.min_local_batch}..{spec.max_local_batch} "
            f"samples per GPU and at most {spec.max_accum} accumulation steps",
            job_id=job_id,
            field="max_batch",
        )
    if spec.batch is not None and spec.gpus is not None and spec.split_batch(spec.gpus, spec.batch) is None:
        raise SpecError(
            f"the requested batch {spec.batch} cannot run on the requested {spec.gpus} GPUs", job_id=job_id, field="batch"
        )


def _reachable(spec: ElasticSpec, k: int) -> bool:
    """Is there a feasible batch on k GPUs? Checked arithmetically (the range may be huge)."""
    lo = max(spec.min_batch, k * spec.min_local_batch)
    hi = min(spec.max_batch, k * spec.max_local_batch * spec.max_accum)
    if lo > hi:
        return False
    # Try accumulation factors; with `a` steps the batch is k*a*local, local in [min_local, max_local].
    for a in range(1, min(spec.max_accum, 64) + 1):
        step = k * a
        lo_l = max(spec.min_local_batch, -(-spec.min_batch // step))
        hi_l = min(spec.max_local_batch, spec.max_batch // step)
        if lo_l <= hi_l:
            return True
    return False


@dataclass(frozen=True)
class Decision:
    """What the daemon decided for a job's next start; written into the job's AdminComment."""

    gpus: int
    nodes: int
    batch: int
    local_batch: int
    accum: int = 1
    seq: int = 0  # increases with every decision for this job, so a job can tell a stale one
    # The partitions the job was submitted to, when the daemon pinned it to one of them (issue 23: a job
    # moved between GPU types may go back; Slurm then shows only the pinned one). Root-only AdminComment.
    parts: tuple[str, ...] = ()

    def __post_init__(self):
        if not isinstance(self.parts, tuple):  # read back from JSON (daemon/state.py): a list
            object.__setattr__(self, "parts", tuple(self.parts))

    def to_admin_comment(self) -> str:
        return (
            f"{DECISION_PREFIX}gpus={self.gpus},nodes={self.nodes},batch={self.batch},"
            f"local_batch={self.local_batch},accum={self.accum},seq={self.seq}"
            + (f",parts={'+'.join(self.parts)}" if self.parts else "")
        )

    def with_seq(self, seq: int) -> Decision:
        return replace(self, seq=seq)


def parse_decision(admin_comment: str | None, job_id: int | str | None = None) -> Decision | None:
    """Read a decision back from an AdminComment; None when the daemon has written none."""
    if not admin_comment or not admin_comment.strip().startswith(DECISION_PREFIX):
        return None
    body = admin_comment.strip()[len(DECISION_PREFIX):]
    values: dict = {}
    for item in body.split(","):
        key, sep, value = item.partition("=")
        if sep and key == "parts" and _PARTS_RE.match(value):
            values["parts"] = tuple(value.split("+"))
            continue
        if not sep or key not in ("gpus", "nodes", "batch", "local_batch", "accum", "seq"):
            raise SpecError(f"bad decision item {item!r}", job_id=job_id, field="admin_comment")
        if not _INT_RE.match(value):
            raise SpecError(f"{key} is not an integer: {value!r}", job_id=job_id, field="admin_comment")
        values[key] = int(value)
    missing = {"gpus", "nodes", "batch", "local_batch"} - set(values)
    if missing:
        raise SpecError(f"decision lacks {', '.join(sorted(missing))}", job_id=job_id, field="admin_comment")
    d = Decision(**values)
    if d.gpus < 1 or d.nodes < 1 or d.local_batch < 1 or d.accum < 1:
        raise SpecError("decision values must be positive", job_id=job_id, field="admin_comment")
    if d.gpus * d.local_batch * d.accum != d.batch:
        raise SpecError(
            f"batch {d.batch} != gpus {d.gpus} x local_batch {d.local_batch} x accum {d.accum}",
            job_id=job_id,
            field="admin_comment",
        )
    return d
