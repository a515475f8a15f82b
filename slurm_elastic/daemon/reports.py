"""Throughput reports earn trust: strict validation, physical plausibility, and what the daemon saw.

A job's ``throughput.json`` is written by the job, i.e. by its user, so it can be forged: a perfect
scaling curve would grow the job at the others' expense. The rules, in order:

1. :func:`validate_report` - the shape and every number: each point's numeric fields (whatever their
   names, so fields added to the protocol later are covered too) must be finite and in
   ``[0, MAX_NUMBER]``; ``gpus``/``batch`` positive integers within the spec limits; ``samples_per_s``
   positive and at most :data:`MAX_SAMPLES_PER_S_PER_GPU` per GPU; a ``job_id`` field must be this job's.
   A file failing this is rejected as a whole (that job's error).
2. :func:`verify_points` - each point against what the daemon *saw* (:class:`RunEvidence`: how long
   Slurm ran the job on each GPU count): a point at a GPU count the job never ran on is unverified, as is
   one that claims more training time than the job ran, or whose samples/steps/seconds disagree. A point
   scaling super-linearly (per-GPU throughput above :data:`SUPERLINEAR_FACTOR` x that of the smallest
   verified GPU count) needs repeated evidence: runs on that GPU count in two or more separate starts.
   Only verified points reach the model fit; unverified ones have no influence, so a report can never
   move a job beyond what its observed runs support.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from slurm_elastic.spec import MAX_BATCH_LIMIT, MAX_GPUS_LIMIT

MAX_POINTS = 256
MAX_NUMBER = 1e15  # any numeric field of a point
MAX_SAMPLES_PER_S_PER_GPU = 1e6  # no accelerator trains a million samples/s (stated physical bound)
SUPERLINEAR_FACTOR = 1.25  # per-GPU throughput may exceed the smallest GPU count's by this much
MIN_REPEATS_FOR_SUPERLINEAR = 2  # separate starts on that GPU count needed to believe more
TIME_SLACK = 1.10  # a report may claim at most this x the observed run time (+ TIME_SLACK_S)
TIME_SLACK_S = 30.0
MAX_ENDED = 256  # ended jobs whose runs a resubmission may continue


class ReportError(ValueError):
    """A report is malformed; names the point and field."""


def _check_number(v, where: str, lo: float = 0.0, hi: float = MAX_NUMBER) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ReportError(f"{where}: expected a number, got {type(v).__name__}")
    x = float(v)
    if not math.isfinite(x) or not lo <= x <= hi:
        raise ReportError(f"{where}: {v!r} is out of range [{lo:g}, {hi:g}]")
    return x


def validate_report(data, job_id: int | str, also: int | str | None = None) -> list[dict]:
    """The report's points, each checked; raises ReportError naming the first bad field. ``also``: the
    job this one continues (its proven lineage, :meth:`RunEvidence.lineage_of`), whose id the report may
    still carry until the new job's first report."""
    if not isinstance(data, dict):
        raise ReportError("the report is not a JSON object")
    jid = data.get("job_id")
    if jid is not None and str(jid) != str(job_id) and (also is None or str(jid) != str(also)):
        raise ReportError(f"job_id {str(jid)[:20]!r} is not this job ({job_id})")
    points = data.get("points", [])
    if not isinstance(points, list):
        raise ReportError("'points' is not a list")
    if len(points) > MAX_POINTS:
        raise ReportError(f"{len(points)} points, more than {MAX_POINTS}")
    out = []
    for i, p in enumerate(points):
        if not isinstance(p, dict):
            raise ReportError(f"point {i}: not an object")
        for k, v in p.items():
            if len(str(k)) > 64:
                raise ReportError(f"point {i}: field name longer than 64 characters")
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                _check_number(v, f"point {i} field {k!r}")
            elif not (v is None or isinstance(v, bool) or (isinstance(v, str) and len(v) <= 256)):
                raise ReportError(f"point {i} field {k!r}: expected a number")
        for k in ("gpus", "batch", "samples_per_s"):
            if k not in p:
                raise ReportError(f"point {i}: field {k!r} missing")
        for k, hi in (("gpus", MAX_GPUS_LIMIT), ("batch", MAX_BATCH_LIMIT)):
            if not isinstance(p[k], int) or isinstance(p[k], bool) or not 1 <= p[k] <= hi:
                raise ReportError(f"point {i} field {k!r}: expected an integer in [1, {hi}], got {p[k]!r}")
        _check_number(p["samples_per_s"], f"point {i} field 'samples_per_s'", 1e-9,
                      MAX_SAMPLES_PER_S_PER_GPU * p["gpus"])
        out.append(p)
    return out


@dataclass
class RunEvidence:
    """What Slurm showed about a job's runs: (restart count) -> (GPUs, start time, last seen running).

    Built from the job records of each cycle (start time is Slurm's), so it survives a daemon restart
    through :meth:`to_json`/:meth:`from_json`.
    """

    runs: dict[int, dict[int, tuple[int, float, float]]] = field(default_factory=dict)
    # Ended jobs, kept so that a resubmission that resumes their checkpoint keeps what Slurm saw of them:
    # job id -> {"user", "ckpt" (the checkpoint directory the daemon read for it), "runs"}.
    ended: dict[int, dict] = field(default_factory=dict)
    continues: dict[int, int] = field(default_factory=dict)  # new job id -> the ended job it continues

    def observe(self, job_id: int, restart_count: int, gpus: int, start_time: float | None, now: float) -> None:
        if gpus <= 0 or start_time is None or start_time <= 0 or now < start_time:
            return
        self.runs.setdefault(int(job_id), {})[int(restart_count)] = (int(gpus), float(start_time), float(now))

    def seconds_on(self, job_id: int, gpus: int) -> float:
        return sum(last - start for k, start, last in self.runs.get(int(job_id), {}).values() if k == gpus)

    def running_seconds(self, job_id: int) -> float:
        """Seconds Slurm has shown the job running, over all its runs."""
        return sum(last - start for _, start, last in self.runs.get(int(job_id), {}).values())

    def gpu_seconds(self, job_id: int) -> float:
        """GPU-seconds Slurm has shown the job running, over all its runs (its attained service)."""
        return sum(k * (last - start) for k, start, last in self.runs.get(int(job_id), {}).values())

    def starts_on(self, job_id: int, gpus: int) -> int:
        return sum(1 for k, _, _ in self.runs.get(int(job_id), {}).values() if k == gpus)

    def forget_except(self, job_ids, owners: dict | None = None) -> None:
        """Drop the jobs not in ``job_ids``; one whose owner and checkpoint directory the daemon knew
        (``owners``: job id -> (user, ckpt dir)) is kept in :attr:`ended` for a resubmission."""
        keep = {int(j) for j in job_ids}
        for j, r in self.runs.items():
            if j not in keep and owners and j in owners and r:
                user, ckpt = owners[j]
                self.ended[j] = {"user": str(user), "ckpt": str(ckpt), "runs": dict(r)}
        while len(self.ended) > MAX_ENDED:
            del self.ended[min(self.ended)]
        self.runs = {j: r for j, r in self.runs.items() if j in keep}
        self.continues = {n: o for n, o in self.continues.items() if n in keep}

    def lineage_of(self, job_id: int, user: str, ckpt: str, reported_id) -> int | None:
        """The ended job that ``job_id`` continues, when its report names it: only a job the same user
        owned whose checkpoint directory was this same one, as the daemon recorded it (a user cannot
        borrow another job's runs). Its runs become this job's (once: a lineage has one heir)."""
        job_id = int(job_id)
        if job_id in self.continues:
            return self.continues[job_id]
        try:
            old = int(str(reported_id))
        except ValueError:
            return None
        e = self.ended.get(old)
        if old == job_id or e is None or e["user"] != str(user) or e["ckpt"] != str(ckpt):
            return None
        mine = self.runs.setdefault(job_id, {})
        for i, v in enumerate(e["runs"].values()):
            mine[-1 - i - 1000 * len(self.continues)] = v  # negative keys: never a restart count of this job
        del self.ended[old]
        self.continues[job_id] = old
        return old

    def to_json(self) -> dict:
        return {"runs": {str(j): {str(rc): list(v) for rc, v in r.items()} for j, r in self.runs.items()},
                "ended": {str(j): {"user": e["user"], "ckpt": e["ckpt"],
                                   "runs": {str(rc): list(v) for rc, v in e["runs"].items()}}
                          for j, e in self.ended.items()},
                "continues": {str(n): o for n, o in self.continues.items()}}

    @classmethod
    def from_json(cls, data) -> RunEvidence:
        ev = cls()

        def runs(r):
            return {int(rc): (int(v[0]), float(v[1]), float(v[2])) for rc, v in r.items()}

        try:
            data = data or {}
            if "runs" not in data:  # the format before lineage: job id -> runs
                data = {"runs": data}
            for j, r in data["runs"].items():
                ev.runs[int(j)] = runs(r)
            for j, e in (data.get("ended") or {}).items():
                ev.ended[int(j)] = {"user": str(e["user"]), "ckpt": str(e["ckpt"]), "runs": runs(e["runs"])}
            ev.continues = {int(n): int(o) for n, o in (data.get("continues") or {}).items()}
        except (TypeError, ValueError, IndexError, AttributeError, KeyError):
            return cls()
        return ev


def verify_points(points: list[dict], job_id: int, evidence: RunEvidence) -> tuple[list[dict], list[str]]:
    """(verified points, one reason per unverified point)."""
    checked, why = [], []
    for p in points:
        k = p["gpus"]
        ran = evidence.seconds_on(job_id, k)
        where = f"{k} GPUs x batch {p['batch']}"
        if ran <= 0:
            why.append(f"{where}: the job never ran on {k} GPUs")
            continue
        secs = p.get("seconds")
        if isinstance(secs, (int, float)) and secs > ran * TIME_SLACK + TIME_SLACK_S:
            why.append(f"{where}: claims {secs:.0f} s, ran {ran:.0f} s")
            continue
        samples, steps = p.get("samples"), p.get("steps")
        if isinstance(samples, (int, float)) and isinstance(secs, (int, float)) and secs > 0:
            if abs(samples / secs - p["samples_per_s"]) > 0.02 * p["samples_per_s"] + 1e-9:
                why.append(f"{where}: samples/seconds disagree with samples_per_s")
                continue
        if isinstance(samples, (int, float)) and isinstance(steps, (int, float)) and samples > steps * p["batch"] * 1.01:
            why.append(f"{where}: more samples than steps x batch")
            continue
        checked.append(p)
    if not checked:
        return [], why
    base_k = min(p["gpus"] for p in checked)
    base = max(p["samples_per_s"] / p["gpus"] for p in checked if p["gpus"] == base_k)
    out = []
    for p in checked:
        per_gpu = p["samples_per_s"] / p["gpus"]
        if (p["gpus"] > base_k and per_gpu > SUPERLINEAR_FACTOR * base
                and evidence.starts_on(job_id, p["gpus"]) < MIN_REPEATS_FOR_SUPERLINEAR):
            why.append(f"{p['gpus']} GPUs x batch {p['batch']}: super-linear ({per_gpu / base:.2f}x per GPU of "
                       f"{base_k} GPUs) seen in fewer than {MIN_REPEATS_FOR_SUPERLINEAR} starts")
            continue
        out.append(p)
    return out, why
