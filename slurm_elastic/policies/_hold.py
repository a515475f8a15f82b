"""How long the GPUs a grow takes are kept: the rate at which grows were undone, measured.

Under SRPT ranks a job's grow onto free GPUs lasts until jobs that outrank it want them. On Sia's
cluster (per-model restarts) 90 of 153 imagenet grows were shrunk again before they had trained for
their 250 s restart, for jobs that arrived after the grow or were in their cooldown when it was made:
the restart was paid, the gain never came (docs/EVALUATION.md). What a grow can expect is measured here, not assumed: every
cycle, each running job whose last change raised its GPU count is *exposed* (for the time since the
last cycle, weighted by the share of the jobs that outrank it); a grown job shrunk again is an
*undo*. The hazard ``undos / exposure`` (both decayed over ``tau_s``) times a job's outranked share is
its rate of being undone, so ``1 / that`` is the expected hold of a grow it would make now, which caps
the life its restart is paid back over (``policies/_candidates.py``; or the time the job has held its
size, when longer: a size that has lasted is evidence the next will). With nothing undone (a quiet
cluster, or the top-ranked job) the hold is unbounded and nothing changes; where restarts are short
against the hold, little does.

The clock is read from the jobs' ages (the median advance of the ages of jobs seen in both cycles),
so the simulator and the daemon drive it alike; a daemon restart starts it afresh (unbounded holds
until grows are undone again).
"""

from __future__ import annotations

import math


class GrowHold:
    """Undo hazard of grows, measured over the cycles seen (state of one policy instance)."""

    def __init__(self, tau_s: float = 3600.0):
        self.tau_s = float(tau_s)
        self.undos = 0.0  # grows undone (decayed)
        self.exposure = 0.0  # seconds x outranked share spent in a grown size (decayed)
        self._ages: dict = {}  # job id -> its age when last seen
        self._size: dict = {}  # job id -> (GPUs, pool) it last ran at
        self._grown: set = set()  # running jobs whose last change raised their count
        self._outranked: dict = {}  # job id -> share of the jobs that outranked it, last cycle
        self._own: dict = {}  # job id -> [its undos, its seconds in a grown size] (decayed)

    def observe(self, jobs) -> None:
        """One cycle's jobs: advance the clock, count exposure and undos."""
        ages = {r.job_id: float(r.age_s) for r in jobs if r.age_s is not None and math.isfinite(r.age_s)}
        steps = sorted(ages[j] - a for j, a in self._ages.items() if j in ages and ages[j] >= a)
        dt = steps[len(steps) // 2] if steps else 0.0
        self._ages = ages
        if dt > 0:
            decay = math.exp(-dt / self.tau_s)
            self.undos *= decay
            self.exposure = self.exposure * decay + dt * sum(self._outranked.get(j, 0.0) for j in self._grown)
            for j, c in self._own.items():
                c[0] *= decay
                c[1] = c[1] * decay + (dt if j in self._grown else 0.0)
        present = set()
        for r in jobs:
            present.add(r.job_id)
            if r.running_gpus <= 0:
                continue  # pending, or between the stop and the start of a resize: its last size stands
            was = self._size.get(r.job_id)
            self._size[r.job_id] = (r.running_gpus, r.pool)
            if was is None or was == (r.running_gpus, r.pool):
                continue
            if r.running_gpus < was[0]:
                if r.job_id in self._grown:
                    self.undos += 1.0
                    self._own.setdefault(r.job_id, [0.0, 0.0])[0] += 1.0
                self._grown.discard(r.job_id)
            elif r.running_gpus > was[0]:
                self._grown.add(r.job_id)
                self._own.setdefault(r.job_id, [0.0, 0.0])
        for gone in set(self._size) - present:
            del self._size[gone]
            self._own.pop(gone, None)
        self._grown &= present

    def note_ranks(self, outranked: dict) -> None:
        """Job id -> share of the optimised jobs ranked ahead of it, as the allocation just ranked them."""
        self._outranked.update(outranked)
        if len(self._outranked) > 4 * max(1, len(self._size)):
            self._outranked = {j: s for j, s in self._outranked.items() if j in self._size}

    def hazard(self) -> float:
        """Undos per second of exposure (per unit of outranked share); 0 when none were undone."""
        return self.undos / self.exposure if self.exposure > 0 else 0.0

    def hold_s(self, job_id, outranked: float) -> float:
        """Expected seconds a grow job ``job_id`` makes now keeps its GPUs: its own undos over its own
        time grown, with the cluster's hazard at its outranked share as a prior worth one undo."""
        u, e = self._own.get(job_id, (0.0, 0.0))
        prior = self.hazard() * max(0.0, outranked)
        if prior > 0:
            rate = (u + 1.0) / (e + 1.0 / prior)
        else:
            rate = u / e if u > 0 and e > 0 else 0.0
        return 1.0 / rate if rate > 0 else math.inf
