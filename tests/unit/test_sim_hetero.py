"""Issue 23 in the simulator: several GPU types, true per-type speed, moves, the first start charge,
the held-at-a-wrong-size count, the sia and gavel peers, and the harness's document section."""

from __future__ import annotations

from dataclasses import replace

import pytest
from sim_helpers import LinearModel, Requested, toy_job, toy_spec

from slurm_elastic.backends.simulated import SimulatedSlurm
from slurm_elastic.policies import get_policy
from slurm_elastic.policies.base import AllocationProblem, JobRequest, Pool
from slurm_elastic.sim.engine import SimConfig, Simulation, held_short
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
    from slurm_elastic.profiles.measured import pollux_model
    from slurm_elastic.profiles.pertype import SIA_CLUSTER, sia_model, sia_model_on_type

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


def test_a_job_kept_small_while_gpus_of_its_type_sit_idle_is_held_short():
    b = SimulatedSlurm(groups=TWO, checkpoint_s=0.0, restart_s=10.0)
    jid = b.submit(name="j", gpus_per_node=1, comment=toy_spec().to_comment(), total_samples=1e7,
                   model=SLOW, type_models=_types(None, None))
    _start(b, jid, gpus=1, gpu_type="slow")
    held: dict = {}
    cfg = SimConfig(held_bound_s=60.0)
    for t in (1.0, 100.0, 200.0):
        b.advance_to(t)
        held_short(b, held, cfg)
    assert held[jid][0] == 1.0  # wrong since the first look: 3 idle GPUs would save hours for a 10 s restart
    # a job about to finish is not: its remaining time cannot repay the restart
    b2 = SimulatedSlurm(groups=TWO, checkpoint_s=0.0, restart_s=10.0)
    j2 = b2.submit(name="k", gpus_per_node=1, comment=toy_spec().to_comment(), total_samples=1_200.0,
                   model=SLOW, type_models=_types(None, None))
    _start(b2, j2, gpus=1, gpu_type="slow")
    held2: dict = {}
    b2.advance_to(1.0)
    held_short(b2, held2, cfg)
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


def test_policy_specs_with_options_split_as_written():
    from slurm_elastic.sim.evaluate_hetero import split_specs
    from slurm_elastic.sim.hetero import parse_policy

    assert split_specs("dp,sia,dp:profiled,backoff=0,tenure=0,gavel") == ["dp", "sia", "dp:profiled,backoff=0,tenure=0",
                                                                          "gavel"]
    assert split_specs("dp:a=1,b=2,dp:a=1") == ["dp:a=1,b=2", "dp:a=1"]
    assert parse_policy("dp:profiled,backoff=0")[1] == "profiled" and parse_policy("dp")[1] == "job"
    assert parse_policy("sia")[1] == "profiled" and parse_policy("sia:blind")[1] == "job"


def _sim_job(jid, model, nodes=(), phase="", gpus=1):
    from types import SimpleNamespace

    return SimpleNamespace(job_id=jid, model=model, nodes=list(nodes), phase=phase, rate=1.0 if phase else 0.0,
                           gpus=gpus, num_nodes=1, local_batch=128, accum=1, first_start=None, startup_s=50.0)


def test_the_simulated_dp_learns_per_type_from_its_jobs_as_the_daemon_does():
    """Issue 23: dp is not handed the tables the jobs run at. A job knows its own model (the T4 table)
    and the prior until it trains on a type; then its table there, shared with its family; a job that
    trained on two types gives the cluster's ratios (same family first)."""
    from types import SimpleNamespace

    from slurm_elastic.profiles.measured import pollux_model
    from slurm_elastic.profiles.types import TYPE_SPEED
    from slurm_elastic.sim.hetero import Learner, true_model

    prior = pollux_model("cifar10")
    backend = SimpleNamespace(node_type=["aws", "dgx-ext"], jobs={})
    rec = SimpleNamespace
    lr = Learner()
    backend.jobs[1] = _sim_job(1, prior)
    assert lr.model_now(rec(job_id=1), prior, backend) is prior  # pending, nothing measured: its own model
    spec = SimpleNamespace(profile="cifar10")
    m = lr.model_for_type(rec(job_id=1), spec, prior, "dgx-ext")
    assert m.provenance == "type prior"  # data-sheet prior, not Sia's tables
    assert m.samples_per_s(1, 1, 128, 1) == pytest.approx(prior.samples_per_s(1, 1, 128, 1) * TYPE_SPEED["a100"])
    # it trains on the A100: its model there is its measured table (Sia's, slowed as the jobs run)
    backend.jobs[1] = _sim_job(1, prior, nodes=[1], phase="training")
    on = lr.model_now(rec(job_id=1), prior, backend)
    assert on.gpu_type == "dgx-ext" and on.samples_per_s(1, 1, 128, 1) == pytest.approx(
        true_model("cifar10", "dgx-ext").samples_per_s(1, 1, 128, 1))
    # another cifar10 job, pending, knows its family's A100 table
    backend.jobs[2] = _sim_job(2, prior)
    other = lr.model_now(rec(job_id=2), prior, backend)
    assert other.on_type("dgx-ext") is true_model("cifar10", "dgx-ext")
    assert lr.ratios.ratio("aws", "dgx-ext", "cifar10")[1] == "type prior"
    # job 1 then trains on the T4: the cluster learns the cifar10 ratio from both tables
    backend.jobs[1] = _sim_job(1, prior, nodes=[0], phase="training")
    lr.model_now(rec(job_id=1), prior, backend)
    r, why = lr.ratios.ratio("aws", "dgx-ext", "cifar10")
    true_r = true_model("cifar10", "dgx-ext").samples_per_s(1, 1, 128, 1) / true_model("cifar10", "aws").samples_per_s(
        1, 1, 128, 1)
    assert why.startswith("type ratio from 1 cifar10 job") and min(true_r, TYPE_SPEED["a100"]) < r < max(
        true_r, TYPE_SPEED["a100"])


def test_the_bootstrap_profiles_a_family_once_and_charges_it():
    from types import SimpleNamespace

    from slurm_elastic.profiles.measured import pollux_model
    from slurm_elastic.sim.hetero import PROFILE_S, Learner

    prior = pollux_model("bert")
    backend = SimpleNamespace(node_type=["aws"], jobs={1: _sim_job(1, prior), 2: _sim_job(2, prior)})
    lr = Learner(bootstrap=True)
    lr.model_now(SimpleNamespace(job_id=1), prior, backend)
    lr.model_now(SimpleNamespace(job_id=2), prior, backend)
    assert backend.jobs[1].startup_s == pytest.approx(50.0 + 50.0 + PROFILE_S)  # its first start waits
    assert backend.jobs[2].startup_s == 50.0  # the family is profiled once
    assert lr.profile_gpu_s == pytest.approx(3 * (50.0 + PROFILE_S))  # one GPU of each of 3 types
    r, why = lr.ratios.ratio("aws", "dgx-ext", "bert")
    assert why.startswith("type ratio from 1 bert job") and r > 3.0  # bert: an A100 is ~4.5x a T4


def test_restart_settings_and_sia_slowdowns():
    from slurm_elastic.profiles.pertype import sia_model
    from slurm_elastic.sim.hetero import flat_restart_s, read_sia_workload, true_model

    assert flat_restart_s("sia") is None and flat_restart_s("flat") == 30.0 and flat_restart_s("600") == 600.0
    for bad in ("0", "-5", "nan", "x"):
        with pytest.raises(ValueError, match="restart"):
            flat_restart_s(bad)
    assert {w.spec.restart_s for w in read_sia_workload(1, restart="600")} == {600.0}
    for app, slow in (("cifar10", 1.8), ("ncf", 1.5), ("bert", 1.2)):
        assert true_model(app, "rtx").samples_per_s(1, 1, 64, 1) == pytest.approx(
            sia_model(app, "rtx").samples_per_s(1, 1, 64, 1) / slow)
