"""Workloads for the simulator: readers, a synthetic generator, and sacct import.

Every source becomes a list of :class:`WorkloadJob`, sorted by arrival.

**Pollux traces** (``workloads*/workload-N.csv``: ``name,time,application,num_replicas,batch_size``).
Each row is an elastic job of a measured Pollux app: GPU range 1..the app's max, batch and per-GPU
batch ranges of the app (``profiles.measured.POLLUX_RANGES``), gradient accumulation up to
``max_accum`` (default 16), total samples = dataset size N x epochs (:data:`POLLUX_WORK`). The asked-for
GPUs/batch become the spec's ``gpus``/``batch`` (what ``static`` and ``fixed-batch`` use), adjusted to
the nearest pair the placement rule allows: the GPU count nearest to ``num_replicas`` that can run the
batch (ties: the smaller), else the batch nearest to ``batch_size`` that the nearest count can run.

**Our trace CSV** (any site can write one; ``#`` lines are comments; header required, columns in any
order, blank optional cells take their default)::

    arrival_s,name,kind,profile,gpus,batch,min_gpus,max_gpus,min_batch,max_batch,max_local_batch,
    min_local_batch,max_accum,total_samples,duration_s,restart_s,user

- ``kind``: ``elastic`` (default) or ``static`` (a non-elastic job: ``gpus`` and ``duration_s``
  required; it holds its GPUs for ``duration_s``).
- elastic rows: ``profile`` (a measured profile name) and ``total_samples`` required; ranges default to
  the profile's; ``gpus``/``batch`` default to ``min_gpus``/``min_batch``; ``restart_s`` is the job's
  own rescale cost (default: the simulator's).

**Synthetic** (:func:`synthetic`): Poisson arrivals at ``rate_per_h`` jobs/hour, apps drawn from a
mix, and each job's size drawn from the Philly trace (packaged ``data/philly/jobs.csv``): a Philly
job's duration d (clipped to [``min_duration_s``, ``max_duration_s``]) and GPU count g become a job of
the drawn app asking for g GPUs (nearest allowed) at the app's typical per-GPU batch
(:data:`TYPICAL_LOCAL_BATCH`) times g, whose total
samples are what it processes in d seconds at that size. Seeded with numpy's PCG64: same seed, same jobs.

**sacct import** (:func:`read_sacct`): ``sacct -P -X --format=JobID,JobName,Submit,Start,End,AllocTRES``
(``Elapsed``, ``ReqTRES``, ``AllocGRES``, ``User`` are also read where present). Arrivals are submit
times relative to the first; GPU counts come from ``gres/gpu=N`` in the TRES (or ``gpu:N`` in GRES);
job steps (ids with a dot), jobs without GPUs and jobs that never started are skipped. With
``elastic=True`` each job becomes an elastic job of an app drawn from the mix (seeded), sized like
the synthetic ones from its run time; otherwise a static job of its GPUs and run time.

Readers raise :class:`WorkloadError` naming the file and line of the first bad row.
"""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from functools import lru_cache
from importlib import resources
from pathlib import Path

import numpy as np

from slurm_elastic.profiles import load_profile, profile_names
from slurm_elastic.profiles.base import ThroughputModel
from slurm_elastic.spec import ElasticSpec, SpecError, validate_spec

# Dataset size N (samples per epoch) and epochs per Pollux app (shared/data/README.md).
POLLUX_WORK = {
    "bert": (88_644, 2),
    "cifar10": (50_048, 100),
    "deepspeech2": (7_140, 80),
    "imagenet": (1_281_200, 90),
    "ncf": (4_971_008, 10),
    "yolov3": (16_552, 50),
}
# Typical per-GPU batch users ask for, for the synthetic generator's requested batch: the median of
# batch_size/num_replicas over the Pollux workloads 1-5 (bert 32, cifar10 341, deepspeech2 53,
# imagenet 133, ncf 32768, yolov3 16) rounded to the nearest power of two, as users usually ask.
TYPICAL_LOCAL_BATCH = {"bert": 32, "cifar10": 256, "deepspeech2": 64, "imagenet": 128, "ncf": 32768, "yolov3": 16}
# The app mix of the Pollux workloads 1-5 (job counts), the synthetic generator's default.
POLLUX_MIX = {"bert": 47, "cifar10": 296, "deepspeech2": 69, "imagenet": 15, "ncf": 337, "yolov3": 36}

DEFAULT_MAX_ACCUM = 16


class WorkloadError(ValueError):
    """A malformed workload file; the message names the file and line."""


@dataclass(frozen=True)
class WorkloadJob:
    name: str
    arrival_s: float
    spec: ElasticSpec | None  # None: a non-elastic (static) job
    total_samples: float = 0.0  # elastic jobs
    gpus: int = 0  # static jobs: GPUs held
    duration_s: float = 0.0  # static jobs: run time
    user: str = "user"

    @property
    def elastic(self) -> bool:
        return self.spec is not None

    @property
    def profile(self) -> str | None:
        return self.spec.profile if self.spec else None


# ---------------------------------------------------------------- throughput models


def _pollux_key(profile: str) -> str:
    key = profile.strip().lower()
    return key[len("pollux."):] if key.startswith("pollux.") else key


def profile_ranges(profile: str) -> dict:
    """The batch / per-GPU batch / GPU ranges of a measured Pollux app (empty for other profiles)."""
    from slurm_elastic.profiles.measured import POLLUX_RANGES

    return dict(POLLUX_RANGES.get(_pollux_key(profile), {}))


def profile_model(profile: str) -> ThroughputModel:
    """The measured throughput model for a profile name (the profiles registry's)."""
    return load_profile(profile)


def known_profiles() -> tuple[str, ...]:
    return tuple(profile_names())


def pollux_apps() -> tuple[str, ...]:
    from slurm_elastic.profiles.measured import POLLUX_APPS

    return tuple(POLLUX_APPS)


# ---------------------------------------------------------------- spec construction


def _nearest_request(spec: ElasticSpec, node_size: int, gpus: int, batch: int) -> tuple[int, int]:
    """The allowed (gpus, batch) nearest to what the user asked for; see the module docstring."""
    allowed = spec.allowed_gpu_counts(node_size)
    if not allowed:
        raise SpecError("no GPU count fits the node size", field="max_gpus")
    batch = min(max(batch, spec.min_batch), spec.max_batch)
    fits = [k for k in allowed if spec.split_batch(k, batch) is not None]
    if fits:
        k = min(fits, key=lambda k: (abs(k - gpus), k))
        return k, batch
    for k in sorted(allowed, key=lambda k: (abs(k - gpus), k)):
        b = spec.nearest_batch(k, batch)
        if b is not None:
            return k, b
    raise SpecError("no GPU count can run any batch in range", field="batch")


def app_spec(
    app: str,
    *,
    gpus: int,
    batch: int,
    node_size: int = 4,
    max_gpus: int | None = None,
    max_accum: int = DEFAULT_MAX_ACCUM,
    restart_s: float | None = None,
    overrides: dict | None = None,
) -> ElasticSpec:
    """An elastic spec for a measured app, asking for the allowed (gpus, batch) nearest to the given."""
    r = profile_ranges(app)
    top = r.pop("max_gpus", None)
    fields = dict(min_gpus=1, max_accum=max_accum, profile=app, restart_s=restart_s, **r)
    if overrides:
        fields.update({k: v for k, v in overrides.items() if v is not None})
    top = fields.get("max_gpus", top)
    if top is None:
        raise SpecError(f"profile {app!r} has no default ranges: give max_gpus", field="max_gpus")
    fields["max_gpus"] = min(top, max_gpus) if max_gpus is not None else top
    missing = [f for f in ("min_batch", "max_batch", "max_local_batch") if f not in fields]
    if missing:
        raise SpecError(f"profile {app!r} has no default ranges: give {', '.join(missing)}", field=missing[0])
    base = ElasticSpec(**fields)
    validate_spec(base, node_size=node_size)
    k, b = _nearest_request(base, node_size, gpus, batch)
    spec = replace(base, gpus=k, batch=b)
    validate_spec(spec, node_size=node_size)
    return spec


def samples_in(spec: ElasticSpec, model: ThroughputModel, duration_s: float, node_size: int) -> float:
    """Samples the job processes in ``duration_s`` at its requested GPUs and batch."""
    k, b = spec.requested_gpus, spec.requested_batch
    local, accum = spec.split_batch(k, b)
    nodes, _ = spec.placement(k, node_size)
    return duration_s * model.samples_per_s(k, nodes, local, accum)


# ---------------------------------------------------------------- Pollux CSV

POLLUX_HEADER = ["name", "time", "application", "num_replicas", "batch_size"]


def _lines(path: str | Path) -> Iterable[tuple[int, str]]:
    text = Path(path).read_text()
    return enumerate(text.splitlines(), start=1)


def _num(value: str, what: str, where: str, *, integer: bool = False, positive: bool = False) -> float:
    try:
        x = int(value) if integer else float(value)
    except ValueError:
        raise WorkloadError(f"{where}: {what} is not {'an integer' if integer else 'a number'}: {value!r}") from None
    if not math.isfinite(x) or x < 0 or (positive and x <= 0):
        raise WorkloadError(f"{where}: {what} must be {'positive' if positive else 'non-negative'}: {value!r}")
    return x


def read_pollux(path: str | Path, *, node_size: int = 4, max_gpus: int | None = None,
                max_accum: int = DEFAULT_MAX_ACCUM) -> list[WorkloadJob]:
    """Read a Pollux workload CSV (see the module docstring)."""
    rows = list(_lines(path))
    if not rows or [c.strip() for c in rows[0][1].split(",")] != POLLUX_HEADER:
        raise WorkloadError(f"{path}:1: expected the header {','.join(POLLUX_HEADER)}")
    apps = set(pollux_apps())
    jobs = []
    for lineno, line in rows[1:]:
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(POLLUX_HEADER):
            raise WorkloadError(f"{where}: expected {len(POLLUX_HEADER)} fields, got {len(cells)}")
        name, t, app, k, b = cells
        if not name:
            raise WorkloadError(f"{where}: empty name")
        if app not in apps:
            raise WorkloadError(f"{where}: unknown application {app!r} (known: {', '.join(sorted(apps))})")
        arrival = _num(t, "time", where)
        k = int(_num(k, "num_replicas", where, integer=True, positive=True))
        b = int(_num(b, "batch_size", where, integer=True, positive=True))
        try:
            spec = app_spec(app, gpus=k, batch=b, node_size=node_size, max_gpus=max_gpus, max_accum=max_accum)
        except SpecError as e:
            raise WorkloadError(f"{where}: {e}") from None
        n, epochs = POLLUX_WORK[app]
        jobs.append(WorkloadJob(name=name, arrival_s=arrival, spec=spec, total_samples=float(n * epochs)))
    jobs.sort(key=lambda j: j.arrival_s)
    return jobs


# ---------------------------------------------------------------- our trace CSV

TRACE_COLUMNS = [
    "arrival_s", "name", "kind", "profile", "gpus", "batch", "min_gpus", "max_gpus", "min_batch", "max_batch",
    "max_local_batch", "min_local_batch", "max_accum", "total_samples", "duration_s", "restart_s", "user",
]
_INT_COLS = ("gpus", "batch", "min_gpus", "max_gpus", "min_batch", "max_batch", "max_local_batch",
             "min_local_batch", "max_accum")


def read_trace(path: str | Path, *, node_size: int = 4) -> list[WorkloadJob]:
    """Read our trace CSV (see the module docstring)."""
    content = [(n, line) for n, line in _lines(path) if line.strip() and not line.lstrip().startswith("#")]
    if not content:
        raise WorkloadError(f"{path}:1: empty trace (a header line is required)")
    hline, header = content[0]
    cols = [c.strip() for c in header.split(",")]
    unknown = [c for c in cols if c not in TRACE_COLUMNS]
    if unknown:
        raise WorkloadError(f"{path}:{hline}: unknown column(s) {', '.join(unknown)} (known: {', '.join(TRACE_COLUMNS)})")
    for req in ("arrival_s", "name"):
        if req not in cols:
            raise WorkloadError(f"{path}:{hline}: the header lacks the required column {req!r}")
    if len(set(cols)) != len(cols):
        raise WorkloadError(f"{path}:{hline}: a column is named twice")
    profiles = set(known_profiles())
    jobs = []
    for lineno, line in content[1:]:
        where = f"{path}:{lineno}"
        cells = next(csv.reader([line]))
        if len(cells) != len(cols):
            raise WorkloadError(f"{where}: expected {len(cols)} fields, got {len(cells)}")
        row = {c: v.strip() for c, v in zip(cols, cells, strict=True)}
        name = row["name"]
        if not name:
            raise WorkloadError(f"{where}: empty name")
        arrival = _num(row["arrival_s"], "arrival_s", where)
        kind = row.get("kind") or "elastic"
        user = row.get("user") or "user"
        ints = {c: int(_num(row[c], c, where, integer=True, positive=True)) for c in _INT_COLS if row.get(c)}
        if kind == "static":
            if "gpus" not in ints or not row.get("duration_s"):
                raise WorkloadError(f"{where}: a static job needs gpus and duration_s")
            dur = _num(row["duration_s"], "duration_s", where, positive=True)
            jobs.append(WorkloadJob(name=name, arrival_s=arrival, spec=None, gpus=ints["gpus"], duration_s=dur, user=user))
            continue
        if kind != "elastic":
            raise WorkloadError(f"{where}: kind must be 'elastic' or 'static', got {kind!r}")
        prof = row.get("profile", "")
        if prof not in profiles:
            raise WorkloadError(f"{where}: unknown or missing profile {prof!r} (known: {', '.join(sorted(profiles))})")
        if not row.get("total_samples"):
            raise WorkloadError(f"{where}: an elastic job needs total_samples")
        total = _num(row["total_samples"], "total_samples", where, positive=True)
        restart = _num(row["restart_s"], "restart_s", where) if row.get("restart_s") else None
        over = {c: ints.get(c) for c in ("min_gpus", "max_gpus", "min_batch", "max_batch", "max_local_batch",
                                         "min_local_batch", "max_accum")}
        try:
            r = profile_ranges(prof)
            gpus = ints.get("gpus", over["min_gpus"] or 1)
            batch = ints.get("batch", over["min_batch"] or r.get("min_batch") or 1)
            spec = app_spec(prof, gpus=gpus, batch=batch, node_size=node_size, restart_s=restart,
                            max_accum=over.pop("max_accum") or DEFAULT_MAX_ACCUM, overrides=over)
        except (SpecError, TypeError) as e:
            raise WorkloadError(f"{where}: {e}") from None
        jobs.append(WorkloadJob(name=name, arrival_s=arrival, spec=spec, total_samples=total, user=user))
    jobs.sort(key=lambda j: j.arrival_s)
    return jobs


def write_trace(jobs: Sequence[WorkloadJob], path: str | Path | None = None) -> str:
    """Write jobs in our trace format (returns the text; writes ``path`` when given)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(TRACE_COLUMNS)
    for j in jobs:
        if j.spec is None:
            row = {"arrival_s": f"{j.arrival_s:g}", "name": j.name, "kind": "static", "gpus": j.gpus,
                   "duration_s": f"{j.duration_s:g}", "user": j.user}
        else:
            s = j.spec
            row = {"arrival_s": f"{j.arrival_s:g}", "name": j.name, "kind": "elastic", "profile": s.profile,
                   "gpus": s.requested_gpus, "batch": s.requested_batch, "min_gpus": s.min_gpus,
                   "max_gpus": s.max_gpus, "min_batch": s.min_batch, "max_batch": s.max_batch,
                   "max_local_batch": s.max_local_batch, "min_local_batch": s.min_local_batch,
                   "max_accum": s.max_accum, "total_samples": f"{j.total_samples:.17g}",
                   "restart_s": "" if s.restart_s is None else f"{s.restart_s:g}", "user": j.user}
        w.writerow([row.get(c, "") for c in TRACE_COLUMNS])
    text = buf.getvalue()
    if path is not None:
        Path(path).write_text(text)
    return text


# ---------------------------------------------------------------- synthetic


@lru_cache(maxsize=1)
def philly_jobs() -> tuple[np.ndarray, np.ndarray]:
    """(durations in s, GPU counts) of the packaged Philly jobs."""
    text = resources.files("slurm_elastic").joinpath("data", "philly", "jobs.csv").read_text()
    arr = np.loadtxt(io.StringIO(text), delimiter=",", skiprows=1)
    return arr[:, 0].copy(), arr[:, 1].astype(np.int64)


def _app_job(app: str, duration: float, gpus: int, node_size: int, max_gpus: int | None,
             name: str, arrival: float, user: str = "user") -> WorkloadJob:
    r = profile_ranges(app)
    k = max(1, min(gpus, r["max_gpus"], max_gpus or r["max_gpus"]))
    batch = TYPICAL_LOCAL_BATCH[app] * k
    spec = app_spec(app, gpus=k, batch=batch, node_size=node_size, max_gpus=max_gpus)
    total = samples_in(spec, profile_model(app), duration, node_size)
    return WorkloadJob(name=name, arrival_s=arrival, spec=spec, total_samples=total, user=user)


def _mix(mix: dict[str, float] | None) -> tuple[list[str], np.ndarray]:
    m = dict(POLLUX_MIX if mix is None else mix)
    apps = sorted(m)
    unknown = [a for a in apps if a not in pollux_apps()]
    if unknown:
        raise ValueError(f"unknown app(s) in the mix: {', '.join(unknown)}")
    w = np.array([float(m[a]) for a in apps])
    if (w < 0).any() or w.sum() <= 0:
        raise ValueError("the mix weights must be non-negative and not all zero")
    return apps, w / w.sum()


def parse_mix(text: str | None) -> dict[str, float] | None:
    """``"cifar10=2,bert=1"`` -> {"cifar10": 2.0, "bert": 1.0}; None or "" -> the Pollux mix."""
    if not text:
        return None
    out = {}
    for item in text.split(","):
        k, sep, v = item.partition("=")
        if not sep:
            out[k.strip()] = 1.0
            continue
        try:
            out[k.strip()] = float(v)
        except ValueError:
            raise ValueError(f"bad mix weight in {item!r}") from None
    return out


def synthetic(
    *,
    rate_per_h: float,
    seed: int = 0,
    jobs: int | None = None,
    hours: float | None = None,
    mix: dict[str, float] | None = None,
    node_size: int = 4,
    max_gpus: int | None = None,
    min_duration_s: float = 60.0,
    max_duration_s: float = 24 * 3600.0,
) -> list[WorkloadJob]:
    """Poisson arrivals at ``rate_per_h``; stop after ``jobs`` jobs or ``hours`` hours (one is required)."""
    if rate_per_h <= 0:
        raise ValueError("rate_per_h must be positive")
    if jobs is None and hours is None:
        raise ValueError("give jobs= or hours=")
    rng = np.random.Generator(np.random.PCG64(seed))
    apps, p = _mix(mix)
    dur, gpus = philly_jobs()
    out: list[WorkloadJob] = []
    t = 0.0
    while True:
        t += rng.exponential(3600.0 / rate_per_h)
        if hours is not None and t > hours * 3600.0:
            break
        if jobs is not None and len(out) >= jobs:
            break
        app = apps[int(rng.choice(len(apps), p=p))]
        i = int(rng.integers(len(dur)))
        d = float(min(max(dur[i], min_duration_s), max_duration_s))
        out.append(_app_job(app, d, int(gpus[i]), node_size, max_gpus, f"{app}-{len(out)}", round(t, 3)))
    return out


# ---------------------------------------------------------------- sacct import

_GPU_TRES = re.compile(r"(?:^|,)gres/gpu(?::[^=,]*)?=(\d+)")
_GPU_GRES = re.compile(r"(?:^|,)gpu(?::[^:,(]*)?:(\d+)")


def _sacct_time(value: str, where: str, what: str) -> float | None:
    if value in ("", "Unknown", "None"):
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        raise WorkloadError(f"{where}: {what} is not a time (YYYY-MM-DDTHH:MM:SS): {value!r}") from None


def _elapsed(value: str, where: str) -> float:
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)(?:\.\d+)?", value)
    if not m:
        raise WorkloadError(f"{where}: Elapsed is not [D-][HH:]MM:SS: {value!r}")
    d, h, mi, s = (int(x) if x else 0 for x in m.groups())
    return ((d * 24 + h) * 60 + mi) * 60 + s


def _gpus(row: dict[str, str]) -> int:
    for col in ("AllocTRES", "ReqTRES"):
        m = _GPU_TRES.search(row.get(col, ""))
        if m:
            return int(m.group(1))
    for col in ("AllocGRES", "ReqGRES"):
        m = _GPU_GRES.search(row.get(col, ""))
        if m:
            return int(m.group(1))
    return 0


def read_sacct(
    path: str | Path,
    *,
    elastic: bool = True,
    mix: dict[str, float] | None = None,
    seed: int = 0,
    node_size: int = 4,
    max_gpus: int | None = None,
) -> list[WorkloadJob]:
    """Import ``sacct -P`` output (see the module docstring)."""
    rows = [(n, line) for n, line in _lines(path) if line.strip()]
    if not rows:
        raise WorkloadError(f"{path}:1: empty file (expected sacct -P output with its header)")
    hline, header = rows[0]
    cols = header.split("|")
    for req in ("JobID", "Submit"):
        if req not in cols:
            raise WorkloadError(f"{path}:{hline}: the header lacks {req} (use sacct -P --format=JobID,JobName,Submit,Start,End,AllocTRES)")
    if "Elapsed" not in cols and not {"Start", "End"} <= set(cols):
        raise WorkloadError(f"{path}:{hline}: the header needs Elapsed or Start and End")
    if not ({"AllocTRES", "ReqTRES", "AllocGRES", "ReqGRES"} & set(cols)):
        raise WorkloadError(f"{path}:{hline}: the header needs AllocTRES, ReqTRES, AllocGRES or ReqGRES for GPU counts")
    rng = np.random.Generator(np.random.PCG64(seed))
    apps, p = _mix(mix)
    raw = []
    for lineno, line in rows[1:]:
        where = f"{path}:{lineno}"
        cells = line.split("|")
        if len(cells) == len(cols) + 1 and cells[-1] == "":
            cells = cells[:-1]  # sacct -P ends lines with '|' when --parsable (not --parsable2)
        if len(cells) != len(cols):
            raise WorkloadError(f"{where}: expected {len(cols)} '|'-separated fields, got {len(cells)}")
        row = dict(zip(cols, cells, strict=True))
        job_id = row["JobID"].strip()
        if not job_id:
            raise WorkloadError(f"{where}: empty JobID")
        if "." in job_id:
            continue  # a job step
        submit = _sacct_time(row["Submit"].strip(), where, "Submit")
        if submit is None:
            raise WorkloadError(f"{where}: Submit is missing")
        start = _sacct_time(row.get("Start", "").strip(), where, "Start") if "Start" in row else None
        if "Elapsed" in row and row["Elapsed"].strip():
            dur = _elapsed(row["Elapsed"].strip(), where)
        else:
            end = _sacct_time(row.get("End", "").strip(), where, "End")
            if start is None or end is None:
                continue  # never ran (or still running)
            dur = end - start
        if "Start" in row and start is None:
            continue
        g = _gpus(row)
        if g <= 0 or dur <= 0:
            continue
        name = (row.get("JobName") or "").strip() or f"job{job_id}"
        name = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:48] + f"-{job_id}"
        raw.append((submit, name, g, float(dur), (row.get("User") or "user").strip() or "user"))
    if not raw:
        return []
    t0 = min(r[0] for r in raw)
    out = []
    for submit, name, g, dur, user in sorted(raw):
        if elastic:
            app = apps[int(rng.choice(len(apps), p=p))]
            out.append(_app_job(app, dur, g, node_size, max_gpus, name, submit - t0, user))
        else:
            out.append(WorkloadJob(name=name, arrival_s=submit - t0, spec=None, gpus=g, duration_s=dur, user=user))
    return out


def load(path: str | Path, *, node_size: int = 4, fmt: str = "auto", **kw) -> list[WorkloadJob]:
    """Read a workload file, telling Pollux CSV, our trace CSV and sacct output apart by the header."""
    if fmt == "auto":
        first = ""
        for _, line in _lines(path):
            if line.strip() and not line.lstrip().startswith("#"):
                first = line
                break
        if first.startswith("name,time,application"):
            fmt = "pollux"
        elif "|" in first and "JobID" in first:
            fmt = "sacct"
        else:
            fmt = "trace"
    if fmt == "pollux":
        return read_pollux(path, node_size=node_size)
    if fmt == "sacct":
        return read_sacct(path, node_size=node_size, **kw)
    if fmt == "trace":
        return read_trace(path, node_size=node_size)
    raise ValueError(f"unknown workload format {fmt!r}")
