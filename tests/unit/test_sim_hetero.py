"""Issue 23 in the simulator: several GPU types, true per-type speed, moves, the first start charge,
the held-at-a-wrong-size count, the sia and gavel peers, and the harness's document section."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sim_helpers import LinearModel, Requested, toy_job, toy_spec

from slurm_elastic.backends.simulated import SimulatedSlurm
from slurm_elastic.policies import get_policy
from slurm_elastic.policies.base import AllocationProblem, JobRequest, Pool
from slurm_elastic.sim.engine import SimConfig, Simulation, held_wrong
from slurm_elastic.spec import Decision

SLOW, FAST = LinearModel(100.0), LinearModel(400.0)  # type "fast" runs the job 4x faster
TWO = ((1, 4, "gpu", "fast"), (1, 4, "gpu", "slow"))


def _types(w, model):
    return {"fast": FAST, "slow": SLOW}


def _start(b, jid, gpus=4, gpu_type=None):
    d = Decision(gpus=gpus, nodes=1, batch=8, local_batch=8 // gpus, seq=1)
    b.update_job(jid, gpus_per_node=gpus, num_nodes=1, admin_comment=d.to_admin_comment(), gpu_type=gpu_type)
    b.release(jid)


def test_the_sia_tables_load_per_type_and_the_a100_is_faster_than_the_t4():
    from slurm_elastic.profiles.pertype import SIA_CLUSTER, sia_model, sia_model_on_type
    from slurm_elastic.profiles.measured import pollux_model

    t4, a100 = sia_model("bert", "aws"), sia_model("bert", "dgx-ext")
    assert a100.samples_per_s(1, 1, 8) > 3 * t4.samples_per_s(1, 1, 8)
    assert sia_model_on_type(pollux_model("bert"), "rtx") is sia_model("bert", "rtx")
    assert sia_model_on_type(SLOW, "rtx") is None and sia_model_on_type(pollux_model("bert"), "k80") is None
    assert sum(n * g for n, g, _ in SIA_CLUSTER) == 64


@pytest.mark.parametrize("gpu_type, seconds", [("fast", 25.0), ("slow", 100.0)])
def test_a_job_runs_at_its_true_speed_on_the_type_it_starts_on(gpu_type, seconds):
    b = SimulatedSlurm(groups=TWO, checkpoint_s=0.0, restart_s=10.0)
    jid = b.submit(name="j", gpus_per_node=4, comment=toy_spec().to_comment(), total_samples=40_000.0,
                   model=SLOW, type_models=_types(None, None))
    _start(b, jid, gpu_type=gpu_type)
    b.advance_to(1000.0)
    j = b.jobs[jid]
    assert j.end_time == pytest.approx(seconds)  # 40,000 samples at 4 GPUs x 100 (x4 on fast)
    assert set(j.gpu_s_by_type) == {gpu_type} and j.gpu_s_by_type[gpu_type] == pytest.approx(4 * seconds)


def test_a_move_between_types_is_counted_and_costs_its_restart():
    b = SimulatedSlurm(groups=TWO, checkpoint_s=2.0, restart_s=10.0)
    jid = b.submit(name="j", gpus_per_node=4, comment=toy_spec().to_comment(), total_samples=80_000.0,
                   model=SLOW, type_models=_types(None, None))
    _start(b, jid, gpu_type="slow")
    b.advance_to(50.0)  # 20,000 samples on slow
    b.signal(jid)
    b.advance_to(52.0)  # checkpoint written and acknowledged
    b.requeue_hold(jid)
    _start(b, jid, gpu_type="fast")
    b.advance_to(1000.0)
    j = b.jobs[jid]
    assert j.moves == 1 and j.rescales == 1
    # 60,000 left at 1,600/s = 37.5 s, after a 10 s restart on the fast type
    assert j.end_time == pytest.approx(52.0 + 10.0 + 37.5)
    assert j.lost_gpu_s == pytest.approx(4 * 2.0 + 4 * 10.0)
    assert j.gpu_s_by_type["slow"] == pytest.approx(4 * 52.0)


def test_the_first_start_pays_the_restart_when_charged():
    wl = [toy_job("a", 0.0, 40_000.0, gpus=4, restart_s=30.0)]
    ends = []
    for charge in (False, True):
        cfg = SimConfig(nodes=1, gpus_per_node=4, interval_s=10.0, first_start_charge=charge)
        res = Simulation(wl, Requested(), cfg, model_for_job=lambda w: SLOW).run()
        ends.append(res.jobs[0].end_s)
    assert ends[1] - ends[0] == pytest.approx(30.0)


def test_a_job_kept_small_while_gpus_of_its_type_sit_idle_is_held_wrong():
    b = SimulatedSlurm(groups=TWO, checkpoint_s=0.0, restart_s=10.0)
    jid = b.submit(name="j", gpus_per_node=1, comment=toy_spec().to_comment(), total_samples=1e7,
                   model=SLOW, type_models=_types(None, None))
    _start(b, jid, gpus=1, gpu_type="slow")
    held: dict = {}
    cfg = SimConfig(held_bound_s=60.0)
    for t in (1.0, 100.0, 200.0):
        b.advance_to(t)
        held_wrong(b, held, cfg)
    assert held[jid][0] == 1.0  # wrong since the first look: 3 idle GPUs would save hours for a 10 s restart
    # a job about to finish is not: its remaining time cannot repay the restart
    b2 = SimulatedSlurm(groups=TWO, checkpoint_s=0.0, restart_s=10.0)
    j2 = b2.submit(name="k", gpus_per_node=1, comment=toy_spec().to_comment(), total_samples=1_200.0,
                   model=SLOW, type_models=_types(None, None))
    _start(b2, j2, gpus=1, gpu_type="slow")
    held2: dict = {}
    b2.advance_to(1.0)
    held_wrong(b2, held2, cfg)
    assert held2[j2][0] < 0


def _req(jid, gpus=4, pools=("fast", "slow"), fast=FAST, slow=SLOW, **kw):
    spec = toy_spec(max_gpus=4, gpus=gpus)
    return JobRequest(jid, spec, slow, pools=pools, pool_models=(("fast", fast), ("slow", slow)), age_s=0.0, **kw)


def _two_pool_problem(jobs):
    pools = (Pool("fast", "fast", ("gpu",), (("f0", 4),), 4), Pool("slow", "slow", ("gpu",), (("s0", 4),), 4))
    return AllocationProblem(total_gpus=8, node_size=4, jobs=tuple(jobs), pools=pools,
                             node_capacity=(("f0", 4), ("s0", 4)))


def test_sia_starts_a_job_on_the_type_where_it_is_faster():
    a = get_policy("sia").allocate(_two_pool_problem([_req(1)]))
    assert a.jobs[1].gpus > 0 and a.jobs[1].pool == "fast"


def test_gavel_gives_the_fast_type_to_the_job_it_speeds_up_most():
    # job 1 gains 4x on "fast", job 2 nothing: max-min puts 1 on fast and 2 on slow
    p = _two_pool_problem([_req(2, fast=SLOW), _req(1)])
    a = get_policy("gavel").allocate(p)
    assert (a.jobs[1].pool, a.jobs[1].gpus) == ("fast", 4) and (a.jobs[2].pool, a.jobs[2].gpus) == ("slow", 4)


def test_gavel_keeps_sizes_rigid_and_preempts_at_its_round():
    g = get_policy("gavel", round_s=100.0)
    running = replace(_req(1, pools=("slow",)), running_gpus=4, running_batch=8, pool="slow", nodes=("s0",),
                      gpus_per_node=4, age_s=0.0)
    a = g.allocate(_two_pool_problem([running]))
    assert a.jobs[1].gpus == 4 and a.jobs[1].pool == "slow"
    # a round later a new job has received nothing: its priority is infinite, the old job's is finite
    newer = _req(2, pools=("slow",), fast=SLOW)
    a = g.allocate(_two_pool_problem([replace(running, age_s=200.0), replace(newer, age_s=0.0)]))
    assert a.jobs[2].gpus == 4 and a.jobs[1].gpus == 0


def test_the_harness_rewrites_only_its_section(tmp_path):
    from slurm_elastic.sim.evaluate_hetero import BEGIN, END, write_section

    doc = tmp_path / "EVALUATION.md"
    doc.write_text("# Evaluation\n\nbefore\n")
    write_section(doc, "one")
    write_section(doc, "two")
    text = doc.read_text()
    assert text.startswith("# Evaluation\n\nbefore\n") and text.count(BEGIN) == 1 and "two" in text
    assert "one" not in text and text.rstrip().endswith(END)
