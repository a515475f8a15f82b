"""Per-GPU batch limits learned from out-of-memory failures (issue 23 item 2), and what they restart.

A job's training step that runs out of memory at local batch ``b`` leaves ``oom.<job>.<restart>.json``
(:mod:`slurm_elastic.train.oom`). The daemon takes it as a claim that can only restrict the job itself:

* it counts only for the start it names (the job's current restart count) and only when its local batch,
  global batch and world size are those of the daemon's decision for that start and the GPUs Slurm shows;
* the GPU type is the one Slurm shows the job's nodes to have, never the job's word;
* it only lowers: the job's limit on that type becomes ``b - 1`` (never below the spec's
  ``min_local_batch``, where the library does not report, and never above a limit already learned);
* one limit per GPU type the cluster has, ints only, so the book is bounded and finite.

Why it cannot buy GPUs from another user: the limit enters the policy as the spec's own
``local_batch_by_type`` (problem.py), which the user could have submitted at any value down to
``min_local_batch``; it removes the job's choices, adds none, and the per-job and per-user GPU caps
(daemon/caps.py) apply to it as to any spec. A false claim costs the claimant a restart and its own
batch range.

Nor GPUs its twin in cooldown cannot have: the restart is not a fresh admission. Until its next start
runs, the job may get at most :meth:`OomBook.most_gpus` (the GPUs it had, or the fewest on which its
batch range still fits below the limit), as an owner's requeue is held to the decided size
(daemon/oversight.py). Found live: without it a job in cooldown, at 1 GPU where no batch fits below
the limit, was requeued and re-admitted on the 3 free GPUs its twin could not take.

Limits are kept across daemon restarts (``meta.oom_limits``), dropped when Slurm forgets the job.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from slurm_elastic.backends.base import JobRecord
from slurm_elastic.daemon.logfmt import event, note_problem
from slurm_elastic.daemon.userfiles import UserFileError
from slurm_elastic.daemon.userfiles import read_json as read_user_json
from slurm_elastic.problem import capped_spec
from slurm_elastic.spec import MAX_TYPE_LIMITS, ElasticSpec, SpecError, parse_decision
from slurm_elastic.train.protocol import MAX_BATCH, oom_path, parse_oom

MAX_OOM_BYTES = 4096


@dataclass(frozen=True)
class OomLimit:
    """Local batches above ``limit`` do not fit this job on the type: out of memory at ``at`` (start
    ``restart``)."""

    limit: int
    at: int
    restart: int

    def text(self, gpu_type: str) -> str:
        return f"local batch <= {self.limit} on {gpu_type or 'its GPUs'}: out of memory at {self.at}"


@dataclass
class OomBook:
    """Job -> GPU type -> :class:`OomLimit` (learned), and the starts that must be restarted now."""

    limits: dict = field(default_factory=dict)  # job id -> {gpu type: OomLimit}
    restart: dict = field(default_factory=dict)  # job id -> (restart count, reason, local batch): out of memory
    problems: dict = field(default_factory=dict)  # job id -> why its report was not used (logged once)
    most: dict = field(default_factory=dict)  # job id -> (restart count of the failed start, most GPUs until the next runs)
    changed: bool = False  # limits changed since the last save

    def observe(self, job: JobRecord, spec: ElasticSpec, ckpt_dir: str | None, gpu_type: str,
                node_size: int = 0) -> None:
        """Read the running job's out-of-memory report for its current start, if any, and learn from it
        (``node_size``: the GPUs per node, for the shapes :meth:`most_gpus` allows; 0: any count)."""
        jid = job.job_id
        held = self.restart.get(jid)
        if held is not None and held[0] != job.restart_count:
            del self.restart[jid]  # a new start: the old one's failure is dealt with
        if not ckpt_dir or not job.is_running or jid in self.restart:
            return
        name = oom_path(ckpt_dir, jid, job.restart_count).name
        try:
            data = read_user_json(ckpt_dir, name, job.user_id, max_bytes=MAX_OOM_BYTES)
        except UserFileError as e:
            return self._problem(jid, f"{e.path}: {e.reason}")
        except OSError as e:
            return self._problem(jid, f"{ckpt_dir}/{name}: {e.strerror or e}")
        if data is None:
            return
        why = self._learn(job, spec, parse_oom(data, jid, job.restart_count), gpu_type, node_size)
        self._problem(jid, f"{ckpt_dir.rstrip('/')}/{name} not used: {why}" if why else "")

    def _learn(self, job: JobRecord, spec: ElasticSpec, rep: dict | None, gpu_type: str, node_size: int) -> str:
        if rep is None:
            return "not a report for this job and start (job_id, restart_count, positive int counts)"
        try:
            d = parse_decision(job.admin_comment, job.job_id)
        except SpecError as e:
            return f"its decision cannot be read ({e})"
        if d is None:
            return "this start has no daemon decision to check it against"
        mine = (d.local_batch, d.accum, d.gpus, d.batch)
        if (rep["local_batch"], rep["accum"], rep["world_size"], rep["global_batch"]) != mine or \
                job.gpus_total != d.gpus:
            return (f"local batch {rep['local_batch']} x {rep['accum']} on {rep['world_size']} GPUs is not this "
                    f"start's decision ({d.local_batch} x {d.accum} on {d.gpus} GPUs, Slurm shows {job.gpus_total})")
        b = rep["local_batch"]
        if b <= spec.min_local_batch:
            return f"local batch {b} is the spec's min_local_batch: nothing smaller to run"
        book = self.limits.setdefault(job.job_id, {})
        if gpu_type not in book and len(book) >= MAX_TYPE_LIMITS:
            return f"limits on {MAX_TYPE_LIMITS} GPU types already"
        old = book.get(gpu_type)
        new = OomLimit(min(b - 1, old.limit if old else b - 1), b, job.restart_count)
        book[gpu_type] = new
        self.changed = True
        most = _fewest_gpus(capped_spec(spec, self.of(job.job_id)).on_type(gpu_type), d.gpus, node_size)
        if most is not None:
            self.most[job.job_id] = (job.restart_count, most)
        reason = f"out of memory at local batch {b} on {gpu_type or 'its GPUs'}"
        self.restart[job.job_id] = (job.restart_count, reason, b)
        event(logging.WARNING, "out of memory: batch limit learned", job=job.job_id, gpu_type=gpu_type,
              local_batch=b, limit=new.limit, restart=job.restart_count)
        return ""

    def _problem(self, job_id: int, text: str) -> None:
        note_problem(self.problems, job_id, text, "out-of-memory report not used")

    def of(self, job_id: int) -> tuple[tuple[str, int], ...]:
        """The job's learned limits as ``(gpu type, max local batch)``, for problem.JobInfo."""
        return tuple(sorted((t, x.limit) for t, x in self.limits.get(job_id, {}).items()))

    def restart_reason(self, job: JobRecord) -> tuple[str, int]:
        """Why the job's current start must be restarted now and the local batch that failed ('', 0: it
        need not)."""
        held = self.restart.get(job.job_id)
        return held[1:] if held is not None and held[0] == job.restart_count and job.is_running else ("", 0)

    def most_gpus(self, job: JobRecord) -> int | None:
        """The most GPUs the job may get while its out-of-memory restart is carried out (from the failed
        start until its next start runs; daemon/caps.py applies it); None: no such bound."""
        held = self.most.get(job.job_id)
        if held is None:
            return None
        if job.is_running and job.restart_count != held[0]:
            del self.most[job.job_id]  # its next start runs: the planner's cooldown holds it from here
            return None
        return held[1]

    def notes(self, job_id: int) -> list[str]:
        """What ``status`` shows: one line per type with a learned limit."""
        return [x.text(t) for t, x in sorted(self.limits.get(job_id, {}).items())]

    def forget(self, live: set) -> None:
        for d in (self.limits, self.restart, self.problems, self.most):
            for jid in [j for j in d if j not in live]:
                del d[jid]
                self.changed = self.changed or d is self.limits

    def to_json(self) -> dict:
        return {str(j): {t: [x.limit, x.at, x.restart] for t, x in by.items()} for j, by in self.limits.items()}

    @classmethod
    def from_json(cls, data) -> OomBook:
        """What :meth:`to_json` wrote; anything else (an older or edited database) is skipped, entry by entry."""
        book = cls()
        if not isinstance(data, dict):
            return book
        for j, by in data.items():
            if not (isinstance(j, str) and j.isdigit() and isinstance(by, dict)):
                continue
            out = {}
            for t, v in list(by.items())[:MAX_TYPE_LIMITS]:
                if isinstance(t, str) and len(t) <= 64 and isinstance(v, list) and len(v) == 3 and \
                        all(isinstance(x, int) and not isinstance(x, bool) for x in v) and \
                        1 <= v[0] < v[1] <= MAX_BATCH and 0 <= v[2]:
                    out[t] = OomLimit(*v)
            if out:
                book.limits[int(j)] = out
        return book


def _fewest_gpus(spec: ElasticSpec, had: int, node_size: int) -> int | None:
    """``had`` when some batch in the spec's range still runs on it, else the fewest GPUs above it, of a
    shape the nodes allow, on which one does; None when there is none within a bounded search (no bound:
    the policy then finds what it can)."""
    first = max(had, -(-spec.min_batch // (spec.max_local_batch * spec.max_accum)))
    if first == had and spec.nearest_batch(had) is not None:
        return had
    counts = spec.allowed_gpu_counts(node_size, most=first + 64 * node_size) if node_size > 0 else \
        range(max(first, spec.min_gpus), min(spec.max_gpus, first + 64) + 1)
    return next((k for k in counts if k >= first and spec.nearest_batch(k) is not None), None)
