"""The allocation-problem document: a JSON-able dict <-> :class:`AllocationProblem`, and answers back.

Format (``slurm-elastic solve PROBLEM.json``; an example is ``examples/problem.json``)::

    {
      "total_gpus": 16,            # GPUs available to elastic jobs (required)
      "node_size": 4,              # GPUs per node (required)
      "horizon_s": 3600,           # restart costs are amortised over this (optional)
      "allow_preemption": false,   # may running jobs be stopped (optional)
      "jobs": [                    # in priority order (required)
        {
          "id": "train-a",                       # unique (required)
          "spec": {"min_gpus": 1, "max_gpus": 8, "min_batch": 128, "max_batch": 4096,
                   "max_local_batch": 1024, "profile": "cifar10"},
                                                 # or "comment": "elastic:min_gpus=1,..."
          "points": [[1, 128, 1100.0], [4, 512, 3900.0]],   # optional: (gpus, batch, samples/s)
          "running_gpus": 4, "running_batch": 512,           # optional: omitted = pending
          "restart_s": 45, "wait_s": 0                       # optional
        }
      ]
    }

``spec`` takes every :class:`ElasticSpec` field (``weight``, ``profile``, ``restart_s``, ...) and is
validated by the same strict parser as a job's ``--comment`` (so errors name the job and the field).
A job needs a named ``profile`` or ``points``; the profile wins when both are given.
"""

from __future__ import annotations

import math
from typing import Any

from slurm_elastic.policies.base import Allocation, AllocationProblem, JobRequest
from slurm_elastic.profiles import model_for_spec
from slurm_elastic.spec import MAX_GPUS_LIMIT, SpecError, ThroughputPoint, parse_spec, validate_spec

_TOP = {"total_gpus", "node_size", "horizon_s", "allow_preemption", "jobs", "policy", "options", "description"}
_JOB = {"id", "spec", "comment", "points", "running_gpus", "running_batch", "restart_s", "wait_s", "weight",
        "profile"}


def _int(v, job, field, lo=0, hi=MAX_GPUS_LIMIT):
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise SpecError(f"expected an integer in [{lo}, {hi}], got {v!r}", job_id=job, field=field)
    return v


def _num(v, job, field, lo=0.0, hi=1e9):
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or not lo <= v <= hi:
        raise SpecError(f"expected a number in [{lo:g}, {hi:g}], got {v!r}", job_id=job, field=field)
    return float(v)


def _spec_comment(spec: dict, job) -> str:
    items = []
    for key, v in spec.items():
        if key == "points":
            raise SpecError("give points at the job level, as [[gpus, batch, samples_per_s], ...]", job_id=job,
                            field="spec.points")
        if isinstance(v, bool) or not isinstance(v, int | float | str) or v is None:
            raise SpecError(f"expected a number or a name, got {v!r}", job_id=job, field=f"{key}")
        if isinstance(v, float) and v.is_integer() and key not in ("weight", "restart_s"):
            v = int(v)
        if isinstance(v, str) and ("," in v or "=" in v):
            raise SpecError(f"invalid value {v!r}", job_id=job, field=key)
        items.append(f"{key}={v:g}" if isinstance(v, float) else f"{key}={v}")
    return "elastic:" + ",".join(items)


def _points(v, job) -> tuple[ThroughputPoint, ...]:
    if not isinstance(v, list) or not v:
        raise SpecError("expected a non-empty list of [gpus, batch, samples_per_s]", job_id=job, field="points")
    out = []
    for i, p in enumerate(v):
        where = f"points[{i}]"
        if isinstance(p, dict):
            unknown = set(p) - {"gpus", "batch", "samples_per_s"}
            if unknown:
                raise SpecError(f"unknown keys {sorted(unknown)}", job_id=job, field=where)
            p = [p.get("gpus"), p.get("batch"), p.get("samples_per_s")]
        if not isinstance(p, list | tuple) or len(p) != 3:
            raise SpecError("expected [gpus, batch, samples_per_s]", job_id=job, field=where)
        k = _int(p[0], job, where, 1)
        b = _int(p[1], job, where, 1, 1 << 40)
        t = _num(p[2], job, where, 0.0, 1e12)
        if t <= 0:
            raise SpecError("samples_per_s must be positive", job_id=job, field=where)
        out.append(ThroughputPoint(k, b, t))
    return tuple(out)


def problem_from_dict(data: Any) -> AllocationProblem:
    """Validate a problem document and build the :class:`AllocationProblem`; raises :class:`SpecError`."""
    if not isinstance(data, dict):
        raise SpecError("the problem must be a JSON object", field="problem")
    unknown = set(data) - _TOP
    if unknown:
        raise SpecError(f"unknown keys {sorted(unknown)} (known: {sorted(_TOP)})", field=sorted(unknown)[0])
    for key in ("total_gpus", "node_size", "jobs"):
        if key not in data:
            raise SpecError("required", field=key)
    total = _int(data["total_gpus"], None, "total_gpus", 0)
    node_size = _int(data["node_size"], None, "node_size", 1)
    horizon = _num(data.get("horizon_s", 3600.0), None, "horizon_s", 1e-9, 1e9)
    preempt = data.get("allow_preemption", False)
    if not isinstance(preempt, bool):
        raise SpecError("expected true or false", field="allow_preemption")
    jobs_in = data["jobs"]
    if not isinstance(jobs_in, list):
        raise SpecError("expected a list of jobs", field="jobs")
    seen = set()
    jobs = []
    for idx, jd in enumerate(jobs_in):
        if not isinstance(jd, dict):
            raise SpecError("expected an object", job_id=f"#{idx}", field="jobs")
        jid = jd.get("id", f"#{idx}")
        if isinstance(jid, bool) or not isinstance(jid, int | str) or jid == "":
            raise SpecError(f"expected a string or integer id, got {jid!r}", job_id=f"#{idx}", field="id")
        if jid in seen:
            raise SpecError("duplicate job id", job_id=jid, field="id")
        seen.add(jid)
        unknown = set(jd) - _JOB
        if unknown:
            raise SpecError(f"unknown keys {sorted(unknown)} (known: {sorted(_JOB)})", job_id=jid,
                            field=sorted(unknown)[0])
        if ("spec" in jd) == ("comment" in jd):
            raise SpecError("give exactly one of 'spec' (an object) or 'comment' (elastic:...)", job_id=jid,
                            field="spec")
        if "spec" in jd:
            if not isinstance(jd["spec"], dict):
                raise SpecError("expected an object", job_id=jid, field="spec")
            sd = dict(jd["spec"])
            for k in ("weight", "profile"):
                if k in jd:
                    sd.setdefault(k, jd[k])
            comment = _spec_comment(sd, jid)
        else:
            comment = jd["comment"]
            if not isinstance(comment, str):
                raise SpecError("expected a string", job_id=jid, field="comment")
        spec = parse_spec(comment, job_id=jid)
        if "points" in jd:
            from dataclasses import replace

            spec = replace(spec, points=_points(jd["points"], jid))
        validate_spec(spec, job_id=jid, node_size=node_size)
        running = _int(jd.get("running_gpus", 0), jid, "running_gpus", 0)
        rb = jd.get("running_batch")
        if rb is not None:
            rb = _int(rb, jid, "running_batch", 1, 1 << 40)
            if not running:
                raise SpecError("running_batch without running_gpus", job_id=jid, field="running_batch")
        restart = _num(jd.get("restart_s", spec.restart_s if spec.restart_s is not None else 45.0), jid,
                       "restart_s", 0.0, 1e7)
        wait = _num(jd.get("wait_s", 0.0), jid, "wait_s", 0.0, 1e10)
        model = model_for_spec(spec, node_size, job_id=jid)
        jobs.append(JobRequest(jid, spec, model, running, rb, restart, wait))
    return AllocationProblem(total, node_size, tuple(jobs), horizon, preempt)


def allocation_to_dict(problem: AllocationProblem, alloc: Allocation) -> dict:
    """The answer as a JSON-able dict (the ``--json`` output of ``slurm-elastic solve``)."""
    return {
        "policy": alloc.policy,
        "objective": alloc.objective,
        "solve_s": alloc.solve_s,
        "total_gpus": problem.total_gpus,
        "node_size": problem.node_size,
        "gpus_used": alloc.gpus_used(),
        "jobs": [
            {
                "id": a.job_id,
                "gpus": a.gpus,
                "nodes": a.nodes,
                "batch": a.batch,
                "local_batch": a.local_batch,
                "accum": a.accum,
                "samples_per_s": a.samples_per_s,
                "reason": a.reason,
            }
            for a in alloc.jobs.values()
        ],
    }
