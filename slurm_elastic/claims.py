"""The trust rule: what a job says about itself counts only as far as what Slurm saw makes it plausible.

A job reports the work it has left (``samples_seen`` of ``total_samples``) and its gradient noise scale.
Both move GPUs: less work left ranks a job first under the ``completion`` objective and makes a rescale
look too costly for it; a larger noise scale makes large batches (so more GPUs) look efficient. Both are
the user's word, so :class:`ClaimBook` turns them into scheduling inputs under these rules (the numbers
are class constants; docs/ALGORITHM.md, "Claims and the trust rule"):

Work left
  * counts only after the job has run ``PROBATION_S`` (x ``1 + strikes`` of its user) under Slurm's eyes
    and has a verified throughput (points checked against the GPU counts and times Slurm showed): a job
    that never ran has no standing to claim, so it cannot jump the queue; except for a user whose
    earlier jobs ended with their claims borne out (``BORNE_OUT`` of their total trained under Slurm's
    eyes, the claim never false) and who has no strike: her waiting jobs' claims order the queue;
  * the first total is kept, samples seen only go up, and only what the job trained since its first
    report counts as done (a job that starts by claiming 99% done is planned as one with all to do: a
    resubmitted job's earlier progress is not provable from here);
  * **over-claim**: seen may not grow by more than ``OVERCLAIM`` x its fastest verified samples/s x the
    seconds Slurm showed it running since the last report (+ ``SLACK_S`` of it): a jump to just below
    the total is caught in the cycle that reads it;
  * **implied finish**: when a claim first counts, and whenever the job's GPU count changes, the claim
    implies a finish: ``OVERRUN`` x left / its verified samples/s + ``GRACE_S`` of running from now. A job
    still running past it (a claim that creeps, or was spent long ago) proved its claim false.
  A false claim is not used for the rest of the job's life, and its user gets a strike: the user's other
  and later jobs serve a longer probation (colder trust).

Noise scale
  * clipped to ``[0, NOISE_CLIP x max_batch]``: past it, the efficiency over the job's own batch range
    moves by under 10% (``(10 M + b0) / (10 M + M)`` at the largest batch ``M``), so a claim of 1e12
    buys no more than that;
  * not used at all (the conservative efficiency instead) for a user whose jobs made a false progress
    claim. A noise scale cannot be checked against anything Slurm shows, and honest ones jump 25-200x
    within an epoch (the Pollux traces), so no rate limit tells a forgery from training: docs/ALGORITHM.md
    says what a forged one can still buy (at most what its own batch range allows).

Restart cost
  * a spec's ``restart_s`` counts until the daemon has measured the job's own (signal -> first step),
    which then replaces it; either counts for at most :data:`RESTART_CLAIM_MAX_S`
    (:func:`restart_claim`). A rescale must pay its restart back, so a cost of days would make the job
    unshrinkable for every other user's job; a job never resized is never measured, and the measured
    figure ends at a first step the job itself reports (one slow start would buy it for good).

Pure: the daemon feeds it what Slurm showed (``Evidence``) and the job's report; the simulator feeds it
its honest jobs, so docs/EVALUATION.md measures what the rule costs honest reports.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Evidence:
    """What Slurm showed of one job, never the job's word (the throughput rates are the job's report,
    kept only where verified against the GPU counts and run times Slurm showed)."""

    running_s: float  # seconds Slurm showed it running, over all its runs
    gpus: int = 0  # GPUs it runs on now (0: not running)
    rate: float | None = None  # verified samples/s at its current GPU count
    best_rate: float | None = None  # its fastest verified samples/s on any GPU count


@dataclass(frozen=True)
class Trusted:
    """The claims as the scheduler may use them (None: not used), with a note for ``status``."""

    remaining_samples: float | None = None
    noise_scale: float | None = None
    note: str = ""


@dataclass
class _Job:
    user: str = ""
    total: float | None = None
    seen: float | None = None
    seen0: float | None = None  # seen at its first report: progress counts from there
    seen_run_s: float = 0.0  # running seconds at the last increase of seen
    deadline_s: float | None = None  # running seconds by which the claim says it is done
    deadline_gpus: int = 0
    false: str = ""  # why the progress claim proved false ("" while it has not)
    noise: float | None = None  # its noise scale, clipped


@dataclass
class ClaimBook:
    """Per job: its claims and how far they are trusted; per user: strikes (false claims)."""

    PROBATION_S = 60.0
    OVERCLAIM = 2.0
    SLACK_S = 60.0
    OVERRUN = 2.0
    GRACE_S = 300.0
    MAX_STRIKES = 8
    BORNE_OUT = 0.9
    NOISE_CLIP = 10.0  # x max_batch: past it, efficiency over the job's range moves by under 10%

    jobs: dict = field(default_factory=dict)  # job id -> _Job
    strikes: dict = field(default_factory=dict)  # user -> false claims of its jobs
    credits: dict = field(default_factory=dict)  # user -> jobs that ended with their claim borne out

    def update(self, job_id: int, user: str, ev: Evidence, *, seen=None, total=None, noise_scale=None,
               max_batch: int) -> Trusted:
        """Take this cycle's report of ``job_id`` and return what of it the scheduler may use."""
        c = self.jobs.get(job_id)
        if c is None:
            c = self.jobs[job_id] = _Job(user=user or "")
        left, note = self._progress(c, ev, _finite(seen), _finite(total))
        ns = self._noise(c, _finite(noise_scale), max_batch)
        return Trusted(remaining_samples=left, noise_scale=ns, note=note)

    def probation_s(self, user: str) -> float:
        return self.PROBATION_S * (1 + min(self.strikes.get(user or "", 0), self.MAX_STRIKES))

    def trusted_user(self, user: str) -> bool:
        """A user whose jobs' claims were borne out (at least one ended near its claimed total) and never
        proved false: her jobs' claims count before they have run (their place in the queue)."""
        u = user or ""
        return self.credits.get(u, 0) > 0 and self.strikes.get(u, 0) == 0

    def _discredit(self, c: _Job, why: str) -> None:
        if not c.false:
            c.false = why
            self.strikes[c.user] = self.strikes.get(c.user, 0) + 1

    def _progress(self, c: _Job, ev: Evidence, seen, total) -> tuple[float | None, str]:
        if c.total is None and total is not None and total > 0:
            c.total = total
        if c.total is None or c.false:
            return None, (f"progress claim not used: {c.false}" if c.false else "")
        if seen is not None and 0 <= seen and (c.seen is None or seen > c.seen):
            if c.seen is not None and ev.best_rate:
                ran = max(0.0, ev.running_s - c.seen_run_s)
                most = self.OVERCLAIM * ev.best_rate * (ran + self.SLACK_S)
                if seen - c.seen > most:
                    self._discredit(c, f"samples seen rose by {seen - c.seen:.3g} in {ran:.0f} s of running, "
                                       f"more than {most:.3g} its verified throughput allows")
                    return None, f"progress claim not used: {c.false}"
            c.seen, c.seen_run_s = seen, ev.running_s
            if c.seen0 is None:
                c.seen0 = seen
        if c.seen is None:
            return None, ""
        left = c.total - (c.seen - (c.seen0 or 0.0))  # only what it was seen to train counts as done
        done = f"{100 * min(c.seen, c.total) / c.total:.0f}% of {c.total:.3g} samples done"
        if ev.gpus <= 0 and self.trusted_user(c.user) and left > 0:
            return left, f"{done} (trusted: the user's claims were borne out)"
        if ev.running_s < self.probation_s(c.user) or not ev.rate:
            return None, f"{done}; not used until verified ({ev.running_s:.0f} s run, throughput " \
                         f"{'verified' if ev.rate else 'not verified'})"
        if ev.gpus > 0 and (c.deadline_s is None or ev.gpus != c.deadline_gpus):
            c.deadline_s = ev.running_s + self.OVERRUN * max(left, 0.0) / ev.rate + self.GRACE_S
            c.deadline_gpus = ev.gpus
        if ev.gpus > 0 and c.deadline_s is not None and ev.running_s > c.deadline_s:
            self._discredit(c, f"still running {ev.running_s - c.deadline_s:.0f} s past the finish its claim "
                               f"implied ({left:.3g} samples left)")
            return None, f"progress claim not used: {c.false}"
        if left <= 0:
            return None, f"{done}; spent"
        return left, done

    def _noise(self, c: _Job, ns, max_batch: int) -> float | None:
        """The noise scale clipped to ``NOISE_CLIP`` x the job's largest batch; none from a user with a
        false claim."""
        if self.strikes.get(c.user, 0) > 0:
            return None
        if ns is not None and ns >= 0:
            c.noise = min(ns, self.NOISE_CLIP * float(max_batch))
        return c.noise

    def forget(self, live) -> None:
        """Drop the jobs no longer in Slurm (users keep their strikes). A job that leaves with its claim
        in good standing, verified once, and ``BORNE_OUT`` of its total trained since its first report
        earns its user a credit."""
        for j in [j for j in self.jobs if j not in live]:
            c = self.jobs.pop(j)
            trained = (c.seen or 0.0) - (c.seen0 or 0.0)
            if not c.false and c.total and trained >= self.BORNE_OUT * c.total and c.deadline_s is not None:
                self.credits[c.user] = self.credits.get(c.user, 0) + 1

    def to_json(self) -> dict:
        return {"strikes": dict(self.strikes), "credits": dict(self.credits),
                "jobs": {str(j): vars(c) for j, c in self.jobs.items()}}

    @classmethod
    def from_json(cls, data) -> ClaimBook:
        """Restore from the daemon's state DB; anything malformed is dropped (trust starts cold)."""
        book = cls()
        if not isinstance(data, dict):
            return book
        for key in ("strikes", "credits"):
            for u, n in (data.get(key) or {}).items():
                if isinstance(u, str) and isinstance(n, int) and not isinstance(n, bool) and 0 < n < 1 << 20:
                    getattr(book, key)[u] = n
        names = set(_Job.__dataclass_fields__)
        for j, c in (data.get("jobs") or {}).items():
            try:
                if isinstance(c, dict) and set(c) <= names:
                    book.jobs[int(j)] = _Job(**c)
            except (TypeError, ValueError):
                continue
        return book


# The costliest restart the rescale rule is measured over (docs/EVALUATION.md); the daemon's default
# (``restart_claim_max_s``: a site whose honest restarts take longer raises it)
RESTART_CLAIM_MAX_S = 600.0


def restart_claim(claimed: float | None, most_s: float = RESTART_CLAIM_MAX_S) -> float | None:
    """A job's restart cost (its spec's claim, or the measured one, which ends at the first step the job
    reports) as the scheduler may use it: at most ``most_s``, so a job that claims or stages more is
    planned as an honest one whose restart costs that; None for none, or nothing finite and
    non-negative."""
    v = _finite(claimed)
    if v is None or v < 0:
        return None
    return min(v, most_s)


def _finite(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    v = float(v)
    return v if math.isfinite(v) else None
