"""The crash policy: a job whose spec says ``max_failures=N`` is requeued (held, for the daemon to place
again) after each of its first N failures; it resumes from its last checkpoint. The (N+1)-th failure
is left FAILED. Every outcome is logged and written to the decision log.

A failure is a job Slurm lists as FAILED or NODE_FAIL (a CANCELLED job was stopped on purpose). Each
failure is counted once, keyed by the job's restart count at the time it failed; the counts live in
the state database so a daemon restart neither forgets nor repeats them.
"""

from __future__ import annotations

import logging

from slurm_elastic.backends.base import JobRecord, SlurmBackend, SlurmError
from slurm_elastic.spec import SpecError, is_elastic_comment, parse_spec

FAILED_STATES = ("FAILED", "NODE_FAIL")


def _key(job_id: int) -> str:
    return f"failures.{int(job_id)}"


def apply_crash_policy(jobs: list[JobRecord], backend: SlurmBackend, db, log_event, cycle: int) -> list[str]:
    """Requeue failed elastic jobs that have failures left; returns one line per job acted on."""
    out = []
    for job in jobs:
        if job.state not in FAILED_STATES or job.is_completing or not is_elastic_comment(job.comment):
            continue
        try:
            spec = parse_spec(job.comment, job.job_id)
        except SpecError:
            continue
        if spec.max_failures == 0:
            continue  # no crash policy asked for: a failure ends the job, as in plain Slurm
        seen = db.get_meta(_key(job.job_id), {"restarts": [], "gave_up": False})
        restarts = [int(r) for r in seen.get("restarts", [])]
        if job.restart_count in restarts or seen.get("gave_up"):
            continue  # this failure was handled in an earlier cycle
        n = len(restarts) + 1  # this failure's number
        if n <= spec.max_failures:
            # The daemon's own hold (daemon/oversight.py): marked first, with the restart count the job
            # will have, so the requeued job is placed again and never taken for an operator's hold.
            db.mark_held(job.job_id, job.restart_count + 1)
            try:
                backend.requeue_failed(job.job_id)
            except SlurmError as e:
                db.unmark_held(job.job_id)
                log_event(logging.ERROR, "crash policy: cannot requeue the failed job", job=job.job_id,
                          failure=n, max_failures=spec.max_failures, error=str(e))
                continue
            restarts.append(job.restart_count)
            db.set_meta(_key(job.job_id), {"restarts": restarts, "gave_up": False})
            msg = (f"job failed ({job.state}, failure {n} of max_failures={spec.max_failures}); requeued held, "
                   "it resumes from its last checkpoint")
            db.log_decision(cycle, job.job_id, "requeue-failed", "done", message=msg)
            log_event(logging.WARNING, "crash policy: requeued", job=job.job_id, failure=n,
                      max_failures=spec.max_failures, detail=msg)
        else:
            db.set_meta(_key(job.job_id), {"restarts": restarts, "gave_up": True})
            msg = (f"job failed ({job.state}) {n} time(s); max_failures={spec.max_failures} reached, "
                   "left failed (its checkpoint is kept)")
            db.log_decision(cycle, job.job_id, "requeue-failed", "gave-up", message=msg)
            log_event(logging.ERROR, "crash policy: giving up", job=job.job_id, failures=n,
                      max_failures=spec.max_failures, detail=msg)
        out.append(f"job {job.job_id}: {msg}")
    return out
