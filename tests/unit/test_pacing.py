"""Pacing (emulated GPUs): the step time a profile gives, the spec key, and that the daemon gains nothing
from it. The in-job part runs a real single-process gloo job (torch) with the pace in its spec."""

import pytest

from slurm_elastic.profiles import load_profile
from slurm_elastic.spec import SpecError, parse_spec
from slurm_elastic.train.pacing import Pacer, make_pacer, paced_step_s

BASE = "elastic:min_gpus=1,max_gpus=4,min_batch=128,max_batch=1024,max_local_batch=256"


def test_paced_step_is_the_profile_step_with_accumulation():
    m = load_profile("cifar10")
    step, sync = m.step_time(4, 1, 128)
    assert paced_step_s(m, 4, 1, 128) == pytest.approx(step)
    assert paced_step_s(m, 4, 1, 128, accum=3) == pytest.approx(step + 2 * (step - sync))
    # the paced rate is the rate the daemon's measured model predicts for that placement
    assert 4 * 128 / paced_step_s(m, 4, 1, 128) == pytest.approx(m.samples_per_s(4, 1, 128))
    # two nodes of 4 T4s at a small per-GPU batch are slower per step than one node (the measured table)
    assert paced_step_s(m, 8, 2, 32) > paced_step_s(m, 4, 1, 32)


def test_pacer_sleeps_the_rest_of_the_step_and_counts_late_steps():
    slept = []
    p = Pacer("cifar10", 0.1, sleep=slept.append)
    assert p.wait(0.03) == pytest.approx(0.1)
    assert slept == [pytest.approx(0.07)]
    assert p.wait(0.25) == 0.25  # real work slower than the profile: not stretched, counted
    assert slept == [pytest.approx(0.07)] and p.late == 1 and p.steps == 2
    assert "1 late" in p.summary()


def test_make_pacer_off_without_pace_and_on_real_gpus():
    assert make_pacer(None, gpus=1, nodes=1, local_batch=32, accum=1) == (None, "")
    pacer, why = make_pacer("cifar10", gpus=2, nodes=1, local_batch=64, accum=1, device_type="cuda")
    assert pacer is None and "ignored" in why and "real GPUs" in why
    pacer, why = make_pacer("cifar10", gpus=2, nodes=1, local_batch=64, accum=1)
    assert pacer is not None and pacer.target_s == pytest.approx(load_profile("cifar10").step_time(2, 1, 64)[0])
    assert "paced" in why
    with pytest.raises(KeyError, match="unknown profile"):
        make_pacer("no-such-gpu", gpus=1, nodes=1, local_batch=32, accum=1)


def test_spec_pace_key_parses_round_trips_and_is_checked():
    spec = parse_spec(BASE + ",pace=cifar10")
    assert spec.pace == "cifar10" and spec.profile is None
    assert parse_spec(spec.to_comment()) == spec
    with pytest.raises(SpecError) as e:
        parse_spec(BASE + ",pace=$(id)")
    assert e.value.field == "pace"


def test_the_daemon_gains_nothing_from_pace(tmp_path):
    """Same model, same allocation with or without pace: it is no throughput claim. An unknown pace is
    the job's bad spec (site rules), naming the field."""
    from slurm_elastic.backends.base import JobRecord
    from slurm_elastic.daemon.models import ModelRegistry
    from slurm_elastic.daemon.siterules import SiteRules

    def job(comment):
        return JobRecord(job_id=7, name="j", user="u", partition="p", state="PENDING", comment=comment)

    reg = ModelRegistry()
    plain, paced = parse_spec(BASE), parse_spec(BASE + ",pace=cifar10")
    m1, m2 = reg(job(BASE), plain), ModelRegistry()(job(BASE + ",pace=cifar10"), paced)
    for k in (1, 2, 4):
        assert m1.samples_per_s(k, 1, 128) == m2.samples_per_s(k, 1, 128)
    assert m1.provenance == m2.provenance
    rules = SiteRules(10.0, str(tmp_path / "state"))
    rules.check(job(BASE + ",pace=cifar10"), paced)
    with pytest.raises(SpecError) as e:
        rules.check(job(BASE + ",pace=h100x"), parse_spec(BASE + ",pace=h100x"))
    assert e.value.field == "pace" and e.value.job_id == 7


def test_status_marks_a_paced_job():
    from slurm_elastic.backends.base import JobRecord
    from slurm_elastic.commands.status import format_table, job_row

    rows = [job_row(JobRecord(job_id=i, name="j", user="u", partition="p", state="RUNNING", comment=c))
            for i, c in ((1, BASE + ",pace=cifar10"), (2, BASE))]
    assert rows[0]["paced"] == "cifar10" and rows[1]["paced"] is None
    lines = format_table(rows).splitlines()
    assert ",paced" in lines[1] and ",paced" not in lines[2]


def test_elastic_job_paces_its_steps_to_the_profile(tmp_path):
    """One real process (gloo, outside Slurm) whose spec says pace=cifar10: each step of batch 128 on 1
    GPU takes what the T4 table says (103 ms), so the throughput it reports is the profile's, while
    the model still trains (its weights change)."""
    torch = pytest.importorskip("torch")
    import time

    from slurm_elastic.train import ElasticJob
    from slurm_elastic.train.slurm_env import JobRecordText

    rec = JobRecordText("local", BASE + ",batch=128,pace=cifar10", "", "scontrol")
    job = ElasticJob(tmp_path / "ck", env={"MASTER_ADDR": "127.0.0.1", "SLURM_ELASTIC_BACKEND": "gloo"},
                     job_record=rec, verbose=False, throughput_warmup_steps=1, noise_scale=False)
    job.setup()
    assert job.pacer is not None
    target = load_profile("cifar10").step_time(1, 1, 128)[0]
    assert job.pacer.target_s == pytest.approx(target)
    lin = torch.nn.Linear(4, 1)
    before = lin.weight.detach().clone()
    ddp = job.wrap(lin)
    job.register(model=lin, optimizer=torch.optim.SGD(lin.parameters(), lr=0.1))
    job.restore()
    x = torch.randn(1280, 4)
    t0 = time.perf_counter()
    for step in job.steps(dataset_size=1280, epochs=1):
        for mb in step.micro_batches():
            (ddp(x[mb.indices]).pow(2).sum() * mb.scale).backward()
        step.optimizer_step()
    wall = time.perf_counter() - t0
    assert job.optimizer_steps == 10 and job.pacer.steps == 10
    assert wall >= 10 * target * 0.95
    assert job.throughput() == pytest.approx(128 / target, rel=0.15 if job.pacer.late == 0 else 0.5)
    assert not torch.equal(before, lin.weight.detach())
    job._teardown()
