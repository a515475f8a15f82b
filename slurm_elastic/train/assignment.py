"""This start's batch assignment: the global batch, per-GPU batch and accumulation steps.

Torch-free. The daemon writes its decision for the next start into the job's AdminComment
(``elastic-decision:gpus=..,nodes=..,batch=..,local_batch=..,accum=..,seq=..``, see
:mod:`slurm_elastic.spec`); the user's elastic spec is in the Comment. :func:`resolve_assignment`
checks the decision against the spec and against the step the job is actually running in (world size
from ``SLURM_NTASKS``, node count), and fails with :class:`AssignmentError` naming the job and the field
when they disagree. With no decision (a job submitted outside the daemon) the spec's requested batch is
split over the actual world size with :meth:`ElasticSpec.split_batch`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec import Decision, ElasticSpec, SpecError, is_elastic_comment, parse_decision, parse_spec


class AssignmentError(SpecError):
    """The decision, the spec and the running step disagree (or no batch can be chosen)."""


@dataclass(frozen=True)
class Assignment:
    """The batch plan of one start."""

    global_batch: int
    local_batch: int
    accum: int
    world_size: int
    source: str  # "decision", "spec" or "default"
    seq: int | None = None  # the decision's sequence number, when there is one
    spec: ElasticSpec | None = None

    @property
    def per_rank(self) -> int:
        return self.local_batch * self.accum


def resolve_assignment(
    *,
    job_id: str | int | None,
    world_size: int,
    num_nodes: int | None = None,
    comment: str | None = None,
    admin_comment: str | None = None,
    default_batch: int | None = None,
    max_local_batch: int | None = None,
) -> Assignment:
    """Choose this start's batch plan; see the module docstring for the rules.

    ``default_batch`` (and ``max_local_batch``) serve jobs without an elastic spec (plain runs); a job
    with a spec ignores them.
    """
    spec = parse_spec(comment, job_id) if is_elastic_comment(comment) else None
    decision: Decision | None = parse_decision(admin_comment, job_id)
    if decision is not None:
        if spec is None:
            raise AssignmentError(
                "the job carries a daemon decision but no elastic spec in its Comment", job_id=job_id, field="comment"
            )
        return _check_decision(decision, spec, job_id, world_size, num_nodes)
    if spec is not None:
        batch = spec.requested_batch
        split = spec.split_batch(world_size, batch)
        if split is None:
            raise AssignmentError(
                f"the requested batch {batch} cannot run on {world_size} tasks (SLURM_NTASKS) within "
                f"max_local_batch={spec.max_local_batch}, min_local_batch={spec.min_local_batch}, "
                f"max_accum={spec.max_accum}",
                job_id=job_id,
                field="batch",
            )
        if not spec.min_gpus <= world_size <= spec.max_gpus:
            raise AssignmentError(
                f"runs on {world_size} tasks, outside the spec's [{spec.min_gpus}, {spec.max_gpus}] GPUs",
                job_id=job_id,
                field="min_gpus" if world_size < spec.min_gpus else "max_gpus",
            )
        return Assignment(batch, split[0], split[1], world_size, "spec", None, spec)
    if default_batch is None:
        raise AssignmentError(
            "no elastic spec in the job's Comment and no default batch given", job_id=job_id, field="comment"
        )
    if default_batch % world_size:
        raise AssignmentError(
            f"the default batch {default_batch} does not divide over {world_size} tasks", job_id=job_id, field="batch"
        )
    share = default_batch // world_size
    limit = max_local_batch or share
    accum = -(-share // limit)
    while share % accum:
        accum += 1
    return Assignment(default_batch, share // accum, accum, world_size, "default", None, None)


def _check_decision(
    d: Decision, spec: ElasticSpec, job_id, world_size: int, num_nodes: int | None
) -> Assignment:
    def fail(msg: str, fld: str):
        raise AssignmentError(f"decision seq={d.seq}: {msg}", job_id=job_id, field=f"admin_comment.{fld}")

    if d.gpus != world_size:
        fail(f"gpus={d.gpus} but the step runs {world_size} tasks (SLURM_NTASKS)", "gpus")
    if num_nodes is not None and d.nodes != num_nodes:
        fail(f"nodes={d.nodes} but the job runs on {num_nodes} nodes", "nodes")
    if not spec.min_gpus <= d.gpus <= spec.max_gpus:
        fail(f"gpus={d.gpus} is outside the spec's [{spec.min_gpus}, {spec.max_gpus}]", "gpus")
    if not spec.min_batch <= d.batch <= spec.max_batch:
        fail(f"batch={d.batch} is outside the spec's [{spec.min_batch}, {spec.max_batch}]", "batch")
    if d.local_batch > spec.max_local_batch:
        fail(f"local_batch={d.local_batch} exceeds the spec's max_local_batch={spec.max_local_batch}", "local_batch")
    if d.local_batch < spec.min_local_batch:
        fail(f"local_batch={d.local_batch} is below the spec's min_local_batch={spec.min_local_batch}", "local_batch")
    if d.accum > spec.max_accum:
        fail(f"accum={d.accum} exceeds the spec's max_accum={spec.max_accum}", "accum")
    if d.gpus * d.local_batch * d.accum != d.batch:
        fail(f"batch={d.batch} != gpus x local_batch x accum", "batch")
    return Assignment(d.batch, d.local_batch, d.accum, world_size, "decision", d.seq, spec)
