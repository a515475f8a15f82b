"""The simulated Slurm backend: placement, the job lifecycle, checkpoint/requeue semantics."""

from __future__ import annotations

import pytest
from sim_helpers import LinearModel, toy_spec

from slurm_elastic.backends.base import JobNotRequeueable, SlurmError
from slurm_elastic.backends.simulated import SimulatedSlurm
from slurm_elastic.spec import Decision

M = LinearModel(100.0)
COMMENT = toy_spec(max_gpus=8).to_comment()


def elastic(b, gpn=2, nodes=1, total=100_000.0, **kw):
    return b.submit(name="e", gpus_per_node=gpn, num_nodes=nodes, comment=COMMENT, total_samples=total, model=M, **kw)


def test_elastic_jobs_are_held_static_jobs_start_and_backfill():
    b = SimulatedSlurm(2, 4)
    e = elastic(b)
    s1 = b.submit(name="s1", gpus_per_node=4, num_nodes=2, duration_s=100.0)
    assert b.get_job(e).held and b.get_job(e).state == "PENDING"
    assert b.get_job(s1).state == "RUNNING" and b.in_use == 8
    s2 = b.submit(name="s2", gpus_per_node=4, num_nodes=2, duration_s=50.0)
    s3 = b.submit(name="s3", gpus_per_node=1, duration_s=50.0)
    assert b.get_job(s2).state == "PENDING" and b.get_job(s3).state == "PENDING"
    b.advance_to(100.0)
    assert b.get_job(s1) is None and b.get_job(s2).state == "RUNNING"
    b.advance_to(150.0)
    assert b.get_job(s3).state == "RUNNING"  # waited for s2: no node had a free GPU
    assert b.peak_in_use == 8


def test_best_fit_placement_keeps_whole_nodes_free():
    b = SimulatedSlurm(3, 4)
    a = b.submit(name="a", gpus_per_node=3, duration_s=10.0)
    c = b.submit(name="c", gpus_per_node=1, duration_s=10.0)
    assert b.get_job(a).nodes == b.get_job(c).nodes  # c fills a's node
    big = b.submit(name="big", gpus_per_node=4, num_nodes=2, duration_s=10.0)
    assert b.get_job(big).state == "RUNNING"
    nodes = b.list_nodes()
    assert [n.gpus_used for n in nodes] == [4, 4, 4] and {n.state for n in nodes} == {"ALLOCATED"}


def test_progress_checkpoint_ack_requeue_release_restart():
    b = SimulatedSlurm(2, 4, checkpoint_s=10.0, restart_s=35.0, startup_s=5.0)
    e = elastic(b, total=100_000.0)
    d = Decision(gpus=2, nodes=1, batch=8, local_batch=4, seq=1)
    b.update_job(e, gpus_per_node=2, num_nodes=1, admin_comment=d.to_admin_comment())
    b.release(e)
    j = b.jobs[e]
    assert j.phase == "starting"
    b.advance_to(105.0)  # trains from 5 at 200/s
    b.signal(e, "USR2")
    assert j.processed == pytest.approx(20_000.0) and not b.checkpoint_acked(e)
    b.advance_to(114.0)
    assert not b.checkpoint_acked(e)
    b.advance_to(115.0)
    assert b.checkpoint_acked(e) and b.get_job(e).state == "RUNNING"
    b.requeue_hold(e)
    r = b.get_job(e)
    assert (r.state, r.held, r.restart_count) == ("PENDING", True, 1) and b.in_use == 0
    with pytest.raises(SlurmError):
        b.signal(e)
    d2 = Decision(gpus=8, nodes=2, batch=8, local_batch=1, seq=2)
    b.update_job(e, gpus_per_node=4, num_nodes=2, admin_comment=d2.to_admin_comment())
    b.release(e)
    assert b.get_job(e).gpus_total == 8
    b.advance_to(150.0)  # restart 35 s: trains from 150 at 800/s
    assert j.phase == "training" and j.rate == pytest.approx(800.0)
    assert b.next_event_time() == pytest.approx(150.0 + 80_000 / 800)
    b.advance_to(1000.0)
    assert j.end_time == pytest.approx(250.0) and j.processed == pytest.approx(100_000.0)
    assert j.lost_gpu_s == pytest.approx(10 * 2 + 35 * 8) and j.startup_gpu_s == pytest.approx(5 * 2)
    assert b.busy_gpu_s == pytest.approx(2 * 115 + 8 * (250 - 115))  # GPUs are held while restarting


def test_requeue_without_ack_loses_work_since_last_checkpoint():
    b = SimulatedSlurm(1, 4)
    e = elastic(b, gpn=4)
    b.release(e)
    b.advance_to(100.0)
    b.requeue_hold(e)
    assert b.jobs[e].processed == 0.0
    assert b.jobs[e].lost_gpu_s == 0.0


def test_refusals():
    b = SimulatedSlurm(1, 4)
    e = elastic(b, requeueable=False)
    with pytest.raises(SlurmError):
        b.update_job(e, gpus_per_node=8)
    with pytest.raises(SlurmError):
        b.requeue_hold(e)  # pending
    b.release(e)
    with pytest.raises(SlurmError):
        b.update_job(e, num_nodes=1)  # running
    with pytest.raises(JobNotRequeueable):
        b.requeue_hold(e)
    with pytest.raises(SlurmError):
        b.release(999)
    with pytest.raises(ValueError):
        b.advance_to(-1.0)
