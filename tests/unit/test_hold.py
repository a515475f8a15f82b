"""How long a grow keeps its GPUs (policies/_hold.py) and what the ``dp`` policy does with it."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from slurm_elastic.policies import AllocationProblem, get_policy
from slurm_elastic.policies._hold import GrowHold
from slurm_elastic.policies.base import JobRequest
from slurm_elastic.profiles import load_profile
from slurm_elastic.spec import ElasticSpec

IMAGENET = load_profile("imagenet")
SPEC = ElasticSpec(min_gpus=1, max_gpus=64, min_batch=200, max_batch=12800, max_local_batch=200,
                   min_local_batch=20, profile="imagenet", restart_s=250.0)


def _job(i, gpus, age, **kw):
    return JobRequest(i, SPEC, IMAGENET, gpus, 200 if gpus else None, restart_s=250.0, age_s=age, **kw)


def _bounced(hold: GrowHold, times: int = 3, grown_for: int = 2, start_age: float = 1000.0) -> float:
    """Job 0 grown 1 -> 8 and shrunk back ``times`` times, ``grown_for`` 60 s cycles at 8 each time (with a
    cycle pending in between, as a requeue shows it); job 1 runs on beside it. Returns the last age."""
    age = start_age
    sizes = []
    for _ in range(times):
        sizes += [1, 0] + [8] * grown_for + [0]
    sizes.append(1)
    for k in sizes:
        hold.observe([_job(0, k, age), _job(1, 2, age)])
        hold.note_ranks({0: 1.0, 1: 0.0})
        age += 60.0
    return age


def test_grows_undone_soon_make_a_short_hold_for_that_job_and_a_prior_for_the_outranked():
    h = GrowHold()
    assert h.hazard() == 0.0 and h.hold_s(0, 1.0) == math.inf  # nothing seen: no cap, nothing changes
    _bounced(h)
    assert h.undos == pytest.approx(3.0, rel=0.1)  # three grows undone (decayed over 1 h)
    # grown for about two cycles each time (the exposure starts when the grow is seen)
    assert 60.0 <= h.hold_s(0, 1.0) <= 240.0
    assert h.hold_s(0, 0.0) > h.hold_s(0, 1.0) - 1e-9  # its own record alone without the prior
    # never grown: the cluster's hazard at its outranked share (job 0's record is all the cluster's here)
    assert h.hold_s(1, 1.0) == pytest.approx(h.hold_s(0, 1.0))
    assert h.hold_s(1, 0.5) == pytest.approx(2 * h.hold_s(0, 1.0))
    assert h.hold_s(1, 0.0) == math.inf  # nobody outranks it: nothing will take the GPUs it grows onto


def test_the_record_fades_and_leaves_with_the_job():
    h = GrowHold()
    age = _bounced(h)
    short = h.hold_s(0, 1.0)
    for _ in range(180):  # three quiet hours at its minimum
        h.observe([_job(0, 1, age), _job(1, 2, age)])
        age += 60.0
    assert h.undos < 0.2 and h.hold_s(0, 1.0) > short
    h.observe([_job(1, 2, age)])  # job 0 ended: its record goes
    assert 0 not in h._own and 0 not in h._size


def test_hostile_ages_do_not_move_the_clock():
    h = GrowHold()
    h.observe([_job(0, 1, 100.0)])
    h.observe([_job(0, 8, float("nan")), _job(1, 1, float("inf"))])  # not finite: ignored
    h.observe([_job(0, 1, 160.0)])
    assert math.isfinite(h.exposure) and math.isfinite(h.undos)


def _alone(remaining=1e8, held_s=120.0):
    """imagenet allowed 1-4 GPUs, on 1 of an idle node for ``held_s`` (a 250 s restart; it reports its work
    left): growing to 4 gains about 3.5x. (A 35x gain pays even a grow undone within a minute: 35 x 60 s >
    310 s.)"""
    r = _job(0, 1, 36000.0, held_s=held_s, rescales=6, remaining_samples=remaining, attained_gpu_s=3600.0)
    r = replace(r, spec=replace(SPEC, max_gpus=4))
    return AllocationProblem(4, 4, (r,), horizon_s=3600.0)


def test_dp_does_not_pay_a_restart_for_a_grow_its_record_says_will_be_undone_first():
    fresh = get_policy("dp").allocate(_alone()).jobs[0]
    assert fresh.gpus == 4 and fresh.reason.startswith("grown 1->")  # no record: the grow pays
    pol = get_policy("dp")
    age = _bounced(pol.hold, times=4, grown_for=1)  # its last four grows lasted about a cycle each
    problem = _alone()
    problem = replace(problem, jobs=(replace(problem.jobs[0], age_s=age),))
    kept = pol.allocate(problem).jobs[0]
    assert kept.gpus == 1, kept.reason
    assert kept.reason.startswith("kept: gain below restart cost") and "a grow would keep its GPUs about" in kept.reason
    off = get_policy("dp", hold=0)
    assert off.hold is None and off.allocate(problem).jobs[0].gpus == 4  # hold=0: the rule before


def test_a_size_that_has_lasted_is_evidence_a_new_one_will():
    # the same record of undone grows, but its 1 GPU has now lasted two hours: the grow pays over that
    pol = get_policy("dp")
    age = _bounced(pol.hold, times=4, grown_for=1)
    problem = _alone(held_s=7200.0)
    problem = replace(problem, jobs=(replace(problem.jobs[0], age_s=age),))
    assert pol.allocate(problem).jobs[0].gpus == 4


def test_a_job_whose_grows_last_keeps_growing():
    pol = get_policy("dp")
    age = _bounced(pol.hold, times=1, grown_for=60)  # grown for an hour before it was shrunk
    problem = _alone()
    problem = replace(problem, jobs=(replace(problem.jobs[0], age_s=age),))
    assert pol.allocate(problem).jobs[0].gpus == 4
