"""problem.build_problem: capacity, classification, priority order, bad specs."""

from __future__ import annotations

from sim_helpers import LinearModel, toy_spec

from slurm_elastic.backends.base import JobRecord, NodeRecord
from slurm_elastic.planner import IN_FLIGHT, PENDING, RUNNING, STARTING
from slurm_elastic.problem import build_problem
from slurm_elastic.spec import Decision

MODEL = LinearModel()
SPEC = toy_spec(max_gpus=8)
COMMENT = SPEC.to_comment()


def node(name, gpus=4, used=0, state="IDLE", flags=(), parts=("gpu",)):
    return NodeRecord(name, state, flags, gpus, used, 8, parts)


def job(i, state="PENDING", gpus=0, nodes=(), comment=COMMENT, held=True, admin="", submit=None, part="gpu"):
    gpn = gpus // max(1, len(nodes)) if nodes else gpus
    return JobRecord(job_id=i, name=f"j{i}", user="u", partition=part, state=state, gpus_per_node=gpn,
                     gpus_total=gpus, node_count=max(1, len(nodes)), nodes=tuple(nodes), comment=comment,
                     admin_comment=admin, held=held, priority=0 if held else None,
                     submit_time=submit if submit is not None else i)


def build(jobs, nodes, **kw):
    return build_problem(jobs, nodes, model_for=lambda r, s: MODEL, now=100.0, **kw)


def test_capacity_excludes_non_elastic_and_unusable_nodes():
    nodes = [node("n1"), node("n2", used=4), node("n3", state="DOWN"), node("n4", flags=("DRAIN",)),
             node("n5", parts=("cpu",))]
    jobs = [job(1, "RUNNING", 4, ["n2"], comment="", held=False),  # non-elastic on a managed node
            job(2, "RUNNING", 2, ["n5"], comment="", held=False, part="cpu"),  # outside the managed nodes
            job(3)]
    snap = build(jobs, nodes, partitions=["gpu"])
    assert snap.managed_gpus == 8 and snap.non_elastic_gpus == 4 and snap.capacity == 4
    assert snap.problem.total_gpus == 4 and snap.node_size == 4
    assert [j.job_id for j in snap.problem.jobs] == [3]
    assert snap.problem.free_gpus_per_node == (4, 0)


def test_statuses_and_running_batch_from_decision():
    d = Decision(gpus=4, nodes=1, batch=8, local_batch=2, seq=2)
    jobs = [
        job(1, "RUNNING", 4, ["n1"], held=False, admin=d.to_admin_comment()),
        job(2, "PENDING", 2, held=False, admin=Decision(gpus=2, nodes=1, batch=8, local_batch=4).to_admin_comment()),
        job(3),
        job(4, "RUNNING", 4, ["n2"], held=False),
    ]
    snap = build(jobs, [node("n1", used=4), node("n2", used=4), node("n3")], in_flight={4: 2})
    st = {v.job_id: (v.status, v.gpus, v.batch) for v in snap.views}
    assert st == {1: (RUNNING, 4, 8), 2: (STARTING, 2, 8), 3: (PENDING, 0, None), 4: (IN_FLIGHT, 2, 8)}
    req = {r.job_id: r for r in snap.problem.jobs}
    assert req[1].running_gpus == 4 and req[1].running_batch == 8
    assert req[2].running_gpus == 2  # a starting job keeps its GPUs in the policy's eyes
    assert req[3].wait_s == 97.0 and req[1].wait_s == 0.0
    assert snap.views[0].samples_per_s == 400.0
    assert snap.capacity == 12


def test_bad_specs_are_reported_and_never_offered_to_the_policy():
    jobs = [job(1, comment="elastic:min_gpus=2"), job(2, "RUNNING", 4, ["n1"], held=False,
                                                       comment="elastic:min_gpus=x,max_gpus=1"), job(3)]
    snap = build(jobs, [node("n1", used=4), node("n2")])
    assert set(snap.errors) == {1, 2}
    assert snap.errors[1].field == "max_gpus" and snap.errors[2].field == "min_gpus"
    assert [r.job_id for r in snap.problem.jobs] == [3]
    assert snap.capacity == 4  # the running job with the bad spec keeps its 4 GPUs


def test_priority_order_fifo_by_submit_then_id():
    jobs = [job(5, submit=30), job(2, submit=10), job(9, submit=10), job(1, submit=20)]
    snap = build(jobs, [node("n1")])
    assert [r.job_id for r in snap.problem.jobs] == [2, 9, 1, 5]


def test_spec_that_cannot_be_placed_on_the_node_size_is_an_error():
    s = toy_spec(max_gpus=8, gpus_per_node=8)
    snap = build([job(1, comment=s.to_comment())], [node("n1")])
    assert snap.errors[1].field == "gpus_per_node" and not snap.problem.jobs
