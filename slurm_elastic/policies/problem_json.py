"""The allocation-problem document: a JSON-able dict <-> :class:`AllocationProblem`, and answers back.

Format (``slurm-elastic solve PROBLEM.json``; an example is ``examples/problem.json``)::

    {
      "total_gpus": 16,            # GPUs available to elastic jobs (required)
      "node_size": 4,              # GPUs per node (required)
      "horizon_s": 3600,           # restart costs are amortised over this (optional)
      "allow_preemption": false,   # may running jobs be stopped (optional)
      "nodes": {"node1": 4, ...},  # GPUs per node for elastic jobs (optional): placement-aware answers
      "pools": [                   # several pools (optional; issue 13): then total_gpus/node_size/nodes
        {"name": "v100",           #   may be left out, they follow from the pools' nodes
         "gpu_type": "v100", "partitions": ["v100"], "nodes": {"node3": 8, "node4": 8}}
      ],
      "jobs": [                    # in priority order (required)
        {
          "id": "train-a",                       # unique (required)
          "spec": {"min_gpus": 1, "max_gpus": 8, "min_batch": 128, "max_batch": 4096,
                   "max_local_batch": 1024, "profile": "cifar10"},
                                                 # or "comment": "elastic:min_gpus=1,..."
          "points": [[1, 128, 1100.0], [4, 512, 3900.0]],   # optional: (gpus, batch, samples/s)
          "running_gpus": 4, "running_batch": 512,           # optional: omitted = pending
          "restart_s": 45, "wait_s": 0,                      # optional
          "age_s": 7200, "rescales": 1,                      # optional: since submission, rescales so far
          "held_s": 600,                                     # optional: how long it has held its size
          "remaining_samples": 2.5e6, "attained_gpu_s": 9000,  # optional: work left (completion's rank),
                                                             #   GPU-seconds had (its rank when no work left)
          "noise_scale": 850.0, "base_batch": 128,           # optional: its gradient noise scale (goodput)
          "nodes": ["node1"],                                # optional: the nodes a running job holds
          "pools": ["v100", "a100"], "pool": "v100",         # optional: pools it may use (default all),
                                                             #   the one a running job is in
          "pool_points": {"a100": [[1, 128, 2300.0]]}        # optional: measured points per pool
        }
      ]
    }

``spec`` takes every :class:`ElasticSpec` field (``weight``, ``profile``, ``restart_s``, ...) and is
validated by the same strict parser as a job's ``--comment`` (so errors name the job and the field).
A job needs a named ``profile`` or ``points``; the profile wins when both are given. With pools, a job on
a Gavel table (``profile=gavel.<gpu>.<model>``) runs on another Gavel GPU type at that type's table, as in
the daemon; ``pool_points`` give any job its own model in a pool.
"""

from __future__ import annotations

import math
from typing import Any

from slurm_elastic.policies._tables import DEFAULT_RESTART_S
from slurm_elastic.policies.base import Allocation, AllocationProblem, JobRequest, Pool, most_common_size
from slurm_elastic.profiles import model_for_spec
from slurm_elastic.spec import MAX_GPUS_LIMIT, SpecError, ThroughputPoint, parse_spec, validate_spec

_TOP = {"total_gpus", "node_size", "horizon_s", "allow_preemption", "jobs", "policy", "options", "description",
        "nodes", "pools"}
_JOB = {"id", "spec", "comment", "points", "running_gpus", "running_batch", "restart_s", "wait_s", "weight",
        "profile", "nodes", "pools", "pool", "pool_points", "age_s", "rescales", "held_s", "remaining_samples",
        "attained_gpu_s", "noise_scale", "base_batch"}
_POOL = {"name", "gpu_type", "partitions", "nodes"}
MAX_NODES = 1 << 20


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


def _name(v, job, field) -> str:
    if not isinstance(v, str) or not v or len(v) > 256 or not v.isprintable():
        raise SpecError(f"expected a non-empty printable name, got {v!r}", job_id=job, field=field)
    return v


def _node_map(v, field) -> tuple[tuple[str, int], ...]:
    if not isinstance(v, dict) or not v or len(v) > MAX_NODES:
        raise SpecError("expected a non-empty object {node: GPUs}", field=field)
    return tuple((_name(n, None, f"{field}.{n}"), _int(g, None, f"{field}.{n}", 1)) for n, g in v.items())


def _pools(v) -> tuple[Pool, ...]:
    if not isinstance(v, list) or not v:
        raise SpecError("expected a non-empty list of pools", field="pools")
    out, names, where = [], set(), {}
    for i, pd in enumerate(v):
        f = f"pools[{i}]"
        if not isinstance(pd, dict):
            raise SpecError("expected an object", field=f)
        unknown = set(pd) - _POOL
        if unknown:
            raise SpecError(f"unknown keys {sorted(unknown)} (known: {sorted(_POOL)})", field=f"{f}.{sorted(unknown)[0]}")
        if "name" not in pd or "nodes" not in pd:
            raise SpecError("required", field=f"{f}.{'name' if 'name' not in pd else 'nodes'}")
        name = _name(pd["name"], None, f"{f}.name")
        if name in names:
            raise SpecError(f"duplicate pool name {name!r}", field=f"{f}.name")
        names.add(name)
        gpu_type = pd.get("gpu_type", "")
        if gpu_type != "":
            gpu_type = _name(gpu_type, None, f"{f}.gpu_type")
        parts = pd.get("partitions", [])
        if not isinstance(parts, list):
            raise SpecError("expected a list of partition names", field=f"{f}.partitions")
        parts = tuple(_name(p, None, f"{f}.partitions") for p in parts)
        caps = _node_map(pd["nodes"], f"{f}.nodes")
        for n, _ in caps:
            if n in where:
                raise SpecError(f"node {n!r} is in pools {where[n]!r} and {name!r}: pools are disjoint",
                                field=f"{f}.nodes")
            where[n] = name
        out.append(Pool(name, gpu_type, parts, caps, most_common_size(g for _, g in caps)))
    return tuple(out)


def problem_from_dict(data: Any) -> AllocationProblem:
    """Validate a problem document and build the :class:`AllocationProblem`; raises :class:`SpecError`."""
    if not isinstance(data, dict):
        raise SpecError("the problem must be a JSON object", field="problem")
    unknown = set(data) - _TOP
    if unknown:
        raise SpecError(f"unknown keys {sorted(unknown)} (known: {sorted(_TOP)})", field=sorted(unknown)[0])
    pools = _pools(data["pools"]) if "pools" in data else ()
    if pools and "nodes" in data:
        raise SpecError("give the nodes in the pools, not both", field="nodes")
    node_caps = tuple(c for p in pools for c in p.node_capacity) if pools else (
        _node_map(data["nodes"], "nodes") if "nodes" in data else None)
    for key in ("jobs",) if pools else ("total_gpus", "node_size", "jobs"):
        if key not in data:
            raise SpecError("required", field=key)
    if pools:
        total = sum(g for _, g in node_caps)
        if "total_gpus" in data and _int(data["total_gpus"], None, "total_gpus", 0) != total:
            raise SpecError(f"{data['total_gpus']} is not the {total} GPUs of the pools' nodes", field="total_gpus")
        node_size = _int(data["node_size"], None, "node_size", 1) if "node_size" in data else \
            most_common_size(g for _, g in node_caps)
    else:
        total = _int(data["total_gpus"], None, "total_gpus", 0)
        node_size = _int(data["node_size"], None, "node_size", 1)
        if node_caps is not None and sum(g for _, g in node_caps) < total:
            raise SpecError(f"total_gpus {total} is more than the nodes' {sum(g for _, g in node_caps)}",
                            field="total_gpus")
    pool_by = {p.name: p for p in pools}
    node_names = {n for n, _ in node_caps} if node_caps else set()
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
        restart = _num(jd.get("restart_s", spec.restart_s if spec.restart_s is not None else DEFAULT_RESTART_S), jid,
                       "restart_s", 0.0, 1e7)
        wait = _num(jd.get("wait_s", 0.0), jid, "wait_s", 0.0, 1e10)
        model = model_for_spec(spec, node_size, job_id=jid)
        age = _num(jd["age_s"], jid, "age_s", 0.0, 1e10) if "age_s" in jd else None
        rescales = _int(jd.get("rescales", 0), jid, "rescales", 0, 1 << 30)
        held = _num(jd["held_s"], jid, "held_s", 0.0, 1e10) if "held_s" in jd else None
        if held is not None and not running:
            raise SpecError("held_s without running_gpus", job_id=jid, field="held_s")
        left = _num(jd["remaining_samples"], jid, "remaining_samples", 0.0, 1e15) if "remaining_samples" in jd else None
        attained = _num(jd.get("attained_gpu_s", 0.0), jid, "attained_gpu_s", 0.0, 1e12)
        ns = _num(jd["noise_scale"], jid, "noise_scale", 0.0, 1e12) if "noise_scale" in jd else None
        b0 = _int(jd["base_batch"], jid, "base_batch", 1, 1 << 31) if "base_batch" in jd else None
        if (ns is None) != (b0 is None):
            raise SpecError("give noise_scale and base_batch together (efficiency is relative to base_batch)",
                            job_id=jid, field="noise_scale" if ns is None else "base_batch")
        req = JobRequest(jid, spec, model, running, rb, restart, wait, age_s=age, rescales=rescales, held_s=held,
                         remaining_samples=left, attained_gpu_s=attained, noise_scale=ns, base_batch=b0)
        req = _placement_fields(req, jd, node_names, pool_by, node_size)
        jobs.append(req)
    return AllocationProblem(total, node_size, tuple(jobs), horizon, preempt, node_capacity=node_caps,
                             pools=pools)


def _placement_fields(req: JobRequest, jd: dict, node_names: set, pool_by: dict, node_size: int) -> JobRequest:
    """A job's nodes (running), allowed pools, current pool and per-pool models, checked against the
    problem's nodes and pools."""
    from dataclasses import replace

    jid = req.job_id
    nodes: tuple[str, ...] = ()
    if "nodes" in jd:
        if not req.is_running:
            raise SpecError("nodes without running_gpus", job_id=jid, field="nodes")
        if not node_names:
            raise SpecError("job nodes need the problem's nodes (top-level 'nodes' or 'pools')", job_id=jid,
                            field="nodes")
        v = jd["nodes"]
        if not isinstance(v, list) or not v or len(v) > req.running_gpus:
            raise SpecError(f"expected 1 to {req.running_gpus} node names", job_id=jid, field="nodes")
        nodes = tuple(_name(n, jid, "nodes") for n in v)
        for n in nodes:
            if n not in node_names:
                raise SpecError(f"unknown node {n!r}", job_id=jid, field="nodes")
    for key in ("pools", "pool", "pool_points"):
        if key in jd and not pool_by:
            raise SpecError("the problem has no 'pools'", job_id=jid, field=key)
    allowed: tuple[str, ...] = ()
    if "pools" in jd:
        v = jd["pools"]
        if not isinstance(v, list) or not v:
            raise SpecError("expected a non-empty list of pool names", job_id=jid, field="pools")
        allowed = tuple(_name(n, jid, "pools") for n in v)
        for n in allowed:
            if n not in pool_by:
                raise SpecError(f"unknown pool {n!r} (pools: {sorted(pool_by)})", job_id=jid, field="pools")
    pool = ""
    if pool_by and req.is_running:
        if "pool" in jd:
            pool = _name(jd["pool"], jid, "pool")
        elif nodes:
            pool = next((p.name for p in pool_by.values() if nodes[0] in dict(p.node_capacity)), "")
        elif len(allowed or pool_by) == 1:
            pool = (allowed or tuple(pool_by))[0]
        else:
            raise SpecError("a running job in a problem with several pools needs its 'pool' or 'nodes'",
                            job_id=jid, field="pool")
        if pool not in pool_by or (allowed and pool not in allowed):
            raise SpecError(f"{pool!r} is not one of its pools", job_id=jid, field="pool")
        if nodes and any(n not in dict(pool_by[pool].node_capacity) for n in nodes):
            raise SpecError(f"its nodes are not all in pool {pool!r}", job_id=jid, field="nodes")
    elif "pool" in jd:
        raise SpecError("pool without running_gpus", job_id=jid, field="pool")
    models = []
    if pool_by:
        from slurm_elastic.profiles.gavel import model_on_type

        given = {}
        if "pool_points" in jd:
            v = jd["pool_points"]
            if not isinstance(v, dict):
                raise SpecError("expected an object {pool: points}", job_id=jid, field="pool_points")
            for name, pts in v.items():
                if name not in pool_by:
                    raise SpecError(f"unknown pool {name!r}", job_id=jid, field="pool_points")
                spec = replace(req.spec, points=_points(pts, jid), profile=None)
                given[name] = model_for_spec(spec, node_size, job_id=jid)
        for name in allowed or tuple(pool_by):
            if name in given:
                models.append((name, given[name]))
            elif pool_by[name].gpu_type:
                m = model_on_type(req.model, pool_by[name].gpu_type)
                if m is not None and m is not req.model:
                    models.append((name, m))
        allowed = allowed or tuple(pool_by)
    per_node = req.running_gpus // len(nodes) if nodes and req.running_gpus % len(nodes) == 0 else 0
    return replace(req, nodes=nodes, gpus_per_node=per_node, pools=allowed, pool=pool, pool_models=tuple(models))


def allocation_to_dict(problem: AllocationProblem, alloc: Allocation) -> dict:
    """The answer as a JSON-able dict (the ``--json`` output of ``slurm-elastic solve``)."""
    return {
        "policy": alloc.policy,
        "objective": alloc.objective,
        "solve_s": alloc.solve_s,
        "total_gpus": problem.total_gpus,
        "node_size": problem.node_size,
        "gpus_used": alloc.gpus_used(),
        "bound": alloc.bound,  # a proven upper bound on the objective when not solved exactly (several pools)
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
                **({"pool": a.pool} if problem.pools else {}),
            }
            for a in alloc.jobs.values()
        ],
    }
