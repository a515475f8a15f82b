"""Issue 12, policy side: statistical efficiency, the goodput/completion objectives, placement, peers."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from slurm_elastic.policies import AllocationProblem, get_policy
from slurm_elastic.policies._candidates import make_candidates
from slurm_elastic.policies._placement import place_check
from slurm_elastic.profiles.efficiency import efficiency, noise_scale_from_stats
from slurm_elastic.profiles.goodput import efficiency_for_request, pollux_grad_trace
from tests.unit.test_policies import job, spec


def test_efficiency_closed_form():
    # (ns + b0) / (ns + b): 1 at the reference batch, 1/2 at b = 2*b0 + ns, -> b0/b with no noise
    assert efficiency(128, 500.0, 128)[()] == pytest.approx(1.0)
    assert efficiency(2 * 128 + 500, 500.0, 128)[()] == pytest.approx(0.5)
    assert efficiency([256, 1024], 0.0, 128) == pytest.approx([0.5, 0.125])
    e = efficiency(np.array([128, 256, 512, 4096]), 1000.0, 128)
    assert np.all(np.diff(e) < 0)
    # Pollux's gain form with var at b0 and sqr: gain/scale == (ns + b0) / (ns + b), ns = b0 * var / sqr
    sqr, var, b0, b = 2.0, 3.0, 128.0, 1024.0
    scale = b / b0
    gain = (var + sqr) / (var / scale + sqr)
    ns = noise_scale_from_stats(sqr, var, b0)
    assert ns == pytest.approx(192.0)
    assert gain / scale == pytest.approx(efficiency(b, ns, b0)[()])
    assert noise_scale_from_stats(0.0, 1.0, 128) is None


def test_trace_efficiency_rises_with_progress_and_matches_reported_noise_scale():
    tr = pollux_grad_trace("cifar10")
    total = tr.bounds[-1]
    early, late = tr.efficiency(1024, 0.0), tr.efficiency(1024, 0.9 * total)
    assert early < 0.5 < late <= 1.0
    x = 0.5 * total
    ns = tr.noise_scale(1024, x)
    assert tr.efficiency(1024, x) == pytest.approx(efficiency(1024, ns, tr.b0)[()])
    assert tr.next_change(x) > x


def test_efficiency_source_order():
    r = job(0, spec(batch=64))
    fn, key = efficiency_for_request(r)  # no noise scale, no app: conservative above the requested batch
    assert key[0] == "conservative" and fn(np.array([64.0, 128.0])) == pytest.approx([1.0, 0.5])
    r2 = job(0, spec(batch=64), noise_scale=1000.0, base_batch=32)
    fn, key = efficiency_for_request(r2)
    assert key[0] == "noise-scale" and fn(np.array([32.0]))[0] == pytest.approx(1.0, rel=0.03)


def test_goodput_default_does_not_inflate_batch_without_evidence():
    s = spec(max_gpus=1, min_batch=32, max_batch=1024, max_local=256, max_accum=4, batch=64)
    a = get_policy("dp").allocate(AllocationProblem(1, 4, (job(0, s),)))
    t = get_policy("dp", objective="throughput").allocate(AllocationProblem(1, 4, (job(0, s),)))
    assert a.jobs[0].batch == 64 < t.jobs[0].batch


def test_completion_objective_favours_the_job_with_less_left():
    s = spec(batch=1024)
    jobs = (job(0, s, remaining_samples=1e7), job(1, s, remaining_samples=1e4))
    a = get_policy("dp").allocate(AllocationProblem(10, 4, jobs))
    assert a.jobs[1].gpus > a.jobs[0].gpus >= 1  # the long job keeps its minimum: not starved


def test_frozen_job_keeps_its_count():
    jobs = (job(0, running=2, batch=256, frozen=True), job(1))
    a = get_policy("dp").allocate(AllocationProblem(8, 4, jobs))
    assert a.jobs[0].gpus == 2


def test_allocation_places_on_fragmented_nodes():
    # 2 nodes x 4 GPUs; a 1-GPU job on each node: 6 GPUs free in the pool but no whole node, so a
    # pending job that may take 1-8 GPUs must not be given 8 or 4 (needs whole nodes / one node's 4).
    nodes = (("n1", 4), ("n2", 4))
    s_small = spec(min_gpus=1, max_gpus=1)
    jobs = (job(0, s_small, running=1, batch=32, nodes=("n1",), gpus_per_node=1, frozen=True),
            job(1, s_small, running=1, batch=32, nodes=("n2",), gpus_per_node=1, frozen=True),
            job(2, spec(min_gpus=1, max_gpus=8)))
    problem = AllocationProblem(8, 4, jobs, node_capacity=nodes)
    a = get_policy("dp").allocate(problem)
    assert 1 <= a.jobs[2].gpus <= 3
    no_place = get_policy("dp", placement=False).allocate(problem)
    assert no_place.jobs[2].gpus > 3  # the pool alone would plan an unplaceable count
    cand = make_candidates(problem)
    chosen = np.array([cand.offsets[p] for p in range(cand.dp_jobs.size)])
    assert place_check(cand, chosen) == {}


def test_pollux_dp_spreads_more_evenly_than_sum_of_speedups():
    jobs = tuple(job(i) for i in range(3))
    p = get_policy("pollux-dp").allocate(AllocationProblem(12, 4, jobs))
    ks = sorted(a.gpus for a in p.jobs.values())
    assert sum(ks) <= 12 and ks[0] >= 1 and ks[-1] - ks[0] <= 2


def test_tiresias_least_attained_first_and_rigid():
    s = spec(gpus=4, batch=256)
    jobs = (job(0, s, running=4, batch=256, attained_gpu_s=20000.0), job(1, s, attained_gpu_s=0.0))
    a = get_policy("tiresias").allocate(AllocationProblem(4, 4, jobs))
    assert a.jobs[1].gpus == 4 and a.jobs[0].gpus == 0 and a.jobs[0].reason.startswith("preempted")
    b = get_policy("tiresias").allocate(AllocationProblem(8, 4, jobs))
    assert b.jobs[0].gpus == 4 and b.jobs[1].gpus == 4 and b.jobs[0].batch == 256


def test_completion_values_each_job_by_its_srpt_rank():
    # remaining 1e6 > 1e5 > 1e4 samples: ranks 1, 2, 3 (jobs that finish no earlier, itself included);
    # at its minimum (speedup 1) a job is worth weight x rank
    s = spec(batch=64)
    jobs = (job(0, s, remaining_samples=1e6), job(1, s, remaining_samples=1e4), job(2, s, remaining_samples=1e5))
    cand = make_candidates(AllocationProblem(16, 4, jobs), efficiency=efficiency_for_request, objective="completion")
    at_min = [float(cand.values[cand.offsets[p]]) for p in range(3)]
    assert at_min == pytest.approx([1.0, 3.0, 2.0])
    a = get_policy("dp").allocate(AllocationProblem(6, 4, jobs))
    assert a.jobs[1].gpus >= a.jobs[2].gpus >= a.jobs[0].gpus >= 1


def _grow_case(**kw):
    """A job running at 1 GPU, the only job, with 3 more GPUs free: does dp grow it?"""
    s = spec(max_gpus=4, batch=64, restart_s=30.0)
    r = job(0, s, running=1, batch=64, remaining_samples=1e6, **kw)
    return AllocationProblem(4, 4, (r,))


def test_restart_margin_keeps_a_job_whose_gain_does_not_pay_for_the_restart():
    # 30 s restart, 120 s of life: 1 - 30/120 = 0.75 of the gain kept (grows); with margin 8: nothing
    # kept, never worth it (the job stays and the reason says why). One way only: with the round trip the
    # grow also pays 0.25 of its value at 1 GPU for the way back, which this gain does not cover
    grow = get_policy("dp", restart_margin=1.0, round_trip=False).allocate(_grow_case(held_s=120.0))
    assert grow.jobs[0].gpus > 1
    assert get_policy("dp", restart_margin=1.0, round_trip=True).allocate(_grow_case(held_s=120.0)).jobs[0].gpus == 1
    kept = get_policy("dp", restart_margin=8.0).allocate(_grow_case(held_s=120.0))
    assert kept.jobs[0].gpus == 1 and kept.jobs[0].reason.startswith("kept: gain below restart cost ("), kept.jobs[0].reason


def test_tenure_a_job_just_resized_needs_a_larger_gain():
    pol = get_policy("dp", restart_margin=8.0)
    assert pol.allocate(_grow_case(held_s=200.0)).jobs[0].gpus == 1  # 8 x 30 s > 200 s: no
    assert pol.allocate(_grow_case(held_s=3000.0)).jobs[0].gpus > 1  # has held its size long: yes
    no_tenure = get_policy("dp", restart_margin=8.0, tenure=False)
    assert no_tenure.allocate(_grow_case(held_s=200.0)).jobs[0].gpus > 1  # the horizon (1 h) instead
    assert pol.allocate(_grow_case()).jobs[0].gpus > 1  # held_s unknown: the horizon


def test_restart_share_is_margin_times_restart_over_the_least_life():
    from slurm_elastic.policies._candidates import _restart_share

    s = spec(restart_s=30.0)
    prob = AllocationProblem(4, 4, (), horizon_s=3600.0)
    r = job(0, s, running=1, batch=64, remaining_samples=6000.0, held_s=900.0)
    assert _restart_share(r, prob, 10.0) == pytest.approx(30.0 / 600.0)  # 600 s left at 10 samples/s
    assert _restart_share(r, prob, 10.0, 2.0, tenure=True) == pytest.approx(60.0 / 600.0)
    assert _restart_share(r, prob, 1.0, 2.0, tenure=True) == pytest.approx(60.0 / 900.0)  # held 900 < 6000
    assert _restart_share(r, prob, 0.001, 200.0) == 1.0  # clipped: never pays
    with pytest.raises(ValueError, match="restart_margin"):
        get_policy("dp", restart_margin=-1)


def test_backoff_each_rescale_raises_the_bar_for_the_next():
    from slurm_elastic.policies._candidates import _restart_share

    s = spec(restart_s=30.0)
    prob = AllocationProblem(4, 4, (), horizon_s=3600.0)
    fresh = job(0, s, running=1, batch=64, held_s=1200.0)
    churned = job(0, s, running=1, batch=64, held_s=1200.0, rescales=4)
    assert _restart_share(fresh, prob, None, 8.0, True, 0.5) == pytest.approx(8 * 30 / 1200)
    assert _restart_share(churned, prob, None, 8.0, True, 0.5) == pytest.approx(3 * 8 * 30 / 1200)
    # a gain that pays for a first rescale does not pay for the tenth (the anti-thrash share, at most 0.5:
    # this +61% is below the 2x that always pays)
    pol = get_policy("dp", restart_margin=8.0, backoff=0.5)
    assert pol.allocate(_grow_case(held_s=3000.0)).jobs[0].gpus > 1
    assert pol.allocate(_grow_case(held_s=3000.0, rescales=10)).jobs[0].gpus == 1
    with pytest.raises(ValueError, match="backoff"):
        get_policy("dp", backoff=-0.1)


def test_auto_admission_is_priority_while_pending_minimums_fit_and_joint_when_they_do_not():
    from slurm_elastic.policies._candidates import ADMITTED, OPTIONAL

    s2 = spec(min_gpus=2, max_gpus=4, batch=64)
    a = job(0, spec(batch=64), running=8, batch=64, held_s=10.0)
    fits = AllocationProblem(8, 4, (a, job(1, s2), job(2, s2)))
    cand = make_candidates(fits, admission="auto")
    assert cand.status == [ADMITTED, ADMITTED, ADMITTED]  # 1 + 2 + 2 <= 8: everyone starts
    alloc = get_policy("dp", admission="auto").allocate(fits)
    assert alloc.jobs[1].gpus >= 2 and alloc.jobs[2].gpus >= 2 and alloc.jobs[0].gpus <= 4
    full = AllocationProblem(4, 4, (job(0, spec(batch=64), running=4, batch=64), job(1, s2), job(2, s2)))
    assert make_candidates(full, admission="auto").status == [ADMITTED, OPTIONAL, OPTIONAL]
    with pytest.raises(ValueError, match="admission"):
        make_candidates(full, admission="fifo")


def test_round_trip_a_grow_pays_the_restart_back_to_its_minimum():
    problem = _grow_case(held_s=900.0)
    plain = get_policy("dp", round_trip=False).candidates(problem)
    trip = get_policy("dp", round_trip=True).candidates(problem)
    share = 1.0 - float(plain.factor[0])  # what a rescale of this job loses (_rescale_factor)
    lo, hi = int(plain.offsets[0]), int(plain.offsets[1])
    ks = plain.cols[0, lo:hi]
    at_min = float(plain.tables[0].value[0]) / float(plain.refs[0])  # speedup at its minimum: 1
    grows = ks > 1
    # the grow's value loses the restart share of the value at the minimum (completion: rank 1, weight 1)
    assert np.allclose(trip.values[lo:hi][grows], plain.values[lo:hi][grows] - share * at_min)
    assert np.allclose(trip.values[lo:hi][~grows], plain.values[lo:hi][~grows])  # keeping costs nothing
    # never grows where the one-way charge would not, and some gains pay one restart but not two
    differ = 0
    for held in range(300, 3001, 100):
        g_plain = get_policy("dp", round_trip=False).allocate(_grow_case(held_s=float(held))).jobs[0].gpus
        g_trip = get_policy("dp", round_trip=True).allocate(_grow_case(held_s=float(held))).jobs[0].gpus
        assert g_trip <= g_plain
        differ += g_trip < g_plain
    assert differ > 0
    with pytest.raises(ValueError, match="round_trip"):
        get_policy("dp", round_trip="maybe")


def test_pollux_dp_uses_pollux_reallocation_factor():
    # Pollux (OSDI'21 4.2): a changed allocation keeps (T - S d) / (T + d) of its speedup, T the job's age,
    # S its re-allocations so far, d its restart time (30 s here)
    from slurm_elastic.policies._candidates import _pollux_factor

    for age, n, want in [(60.0, 0, 60 / 90), (3600.0, 2, (3600 - 60) / 3630), (50.0, 2, 0.0)]:
        problem = _grow_case(age_s=age, rescales=n)
        assert _pollux_factor(problem.jobs[0]) == pytest.approx(want)
        cand = make_candidates(problem, efficiency=efficiency_for_request, objective="pnorm", fair_ref=True,
                               realloc="pollux")
        assert cand.factor[0] == pytest.approx(want)
    # young and often re-allocated: the grow is not worth it; old: it is
    assert get_policy("pollux-dp").allocate(_grow_case(age_s=50.0, rescales=2)).jobs[0].gpus == 1
    assert get_policy("pollux-dp").allocate(_grow_case(age_s=36000.0, rescales=0)).jobs[0].gpus == 4
    # no age known (e.g. a problem file): the share rule, as before
    plain = make_candidates(_grow_case(), efficiency=efficiency_for_request, objective="pnorm", fair_ref=True)
    assert make_candidates(_grow_case(), efficiency=efficiency_for_request, objective="pnorm", fair_ref=True,
                           realloc="pollux").factor[0] == pytest.approx(plain.factor[0])
    with pytest.raises(ValueError, match="realloc"):
        make_candidates(_grow_case(), realloc="genetic")


def test_pollux_dp_a_job_at_an_off_table_batch_still_grows():
    # A running job whose batch is not its table's best at its count (it was sized under another noise
    # scale) has a "keep as it runs" value. That value must be Pollux's p-norm term (p = -1), as every
    # other choice's: computed at p = 0 it was 0, the best any choice can be, and such a job never grew
    # (seen: an imagenet job alone on 64 GPUs held 2 GPUs for 75 simulated hours).
    s = spec(max_gpus=4, batch=64, restart_s=30.0)
    for batch in (40, 64, 100):
        r = job(0, s, running=1, batch=batch, remaining_samples=1e6, age_s=36000.0)
        problem = AllocationProblem(4, 4, (r,))
        cand = make_candidates(problem, efficiency=efficiency_for_request, objective="pnorm", fair_ref=True,
                               realloc="pollux")
        assert cand.values.max() <= 0.0 and cand.values[cand.offsets[0]] < 0.0  # 1 - s^-1 with s <= 1
        assert get_policy("pollux-dp").allocate(problem).jobs[0].gpus == 4, batch


def test_rebatching_in_place_pays_the_restart_for_negative_pnorm_values_too():
    # re-batching on the same count keeps the factor's share of the speedup; for p-norm's negative values
    # that makes the value lower, not higher (scaling the value itself rewarded the restart). The job runs
    # a batch outside its range now, so it cannot keep it: its only choice on 1 GPU is a re-batch
    s = spec(max_gpus=1, batch=64, restart_s=30.0)
    r = job(0, s, running=1, batch=2048, remaining_samples=1e6, age_s=300.0, rescales=3)
    problem = AllocationProblem(1, 4, (r,))
    for objective in ("pnorm", "completion"):
        cand = make_candidates(problem, efficiency=efficiency_for_request, objective=objective,
                               fair_ref=objective == "pnorm", realloc="pollux")
        assert 0.0 < cand.factor[0] < 1.0 and not cand.keep[0]
        assert cand.values[0] < cand.gross[0], objective


def test_completion_needs_ranks_and_falls_back_to_pnorm_when_most_jobs_report_no_remaining_work():
    # SRPT ranks need the work jobs have left; when fewer than half report it (and fewer than 3/4 have a
    # reported or inferred one: test_inferred_remaining), the values are the p-norm of speedups over each
    # job's minimum (measured: 0.69 against 0.74 h with attained-service ranks)
    s = spec(batch=64)
    known = (job(0, s, remaining_samples=1e6), job(1, s, remaining_samples=1e4), job(2, s), job(3, s))
    unknown = (job(0, s, remaining_samples=1e6), job(1, s, remaining_samples=1e4), job(2, s), job(3, s), job(4, s))
    dp = get_policy("dp")
    assert dp.objective_for(AllocationProblem(16, 4, known)) == "completion"  # 2 of 4 report: ranks
    assert dp.objective_for(AllocationProblem(16, 4, unknown)) == "pnorm"  # 2 of 5: mostly guesses
    assert get_policy("dp", ranked="0.4").objective_for(AllocationProblem(16, 4, unknown)) == "completion"
    for bad in ("1.5", "-0.1", "nan"):
        with pytest.raises(ValueError, match="ranked"):
            get_policy("dp", ranked=bad)
    assert get_policy("dp", unranked="las").objective_for(AllocationProblem(16, 4, unknown)) == "completion"
    assert get_policy("dp", objective="goodput").objective_for(AllocationProblem(16, 4, unknown)) == "goodput"
    # p-norm values: 1 - s^-1, s the speedup over the minimum: 0 at the minimum, below 1 above it, and
    # "0 GPUs" -1e6; completion values: weight x rank x s, so rank >= 1 at a job's minimum
    fallback = dp.candidates(AllocationProblem(16, 4, unknown))
    runs = fallback.cols[0] > 0
    assert fallback.values[runs].max() < 1.0 and fallback.values[runs].min() == 0.0
    assert (fallback.values[~runs] == -1e6).all()
    ranked = dp.candidates(AllocationProblem(16, 4, known))
    assert ranked.values[ranked.cols[0] > 0].min() >= 1.0
    a = dp.allocate(AllocationProblem(16, 4, unknown))
    assert sum(x.gpus for x in a.jobs.values()) <= 16 and all(x.gpus >= 1 for x in a.jobs.values())
    with pytest.raises(ValueError, match="unranked"):
        get_policy("dp", unranked="fifo")


def test_a_bad_dp_option_from_a_spec_string_names_the_option():
    # options come as strings from "dp:key=value" specs (simulate --compare, evaluate)
    for key, bad in (("age_credit", "x"), ("ranked", "abc"), ("starvation_s", None), ("restart_margin", "4s")):
        with pytest.raises(ValueError, match=f"^{key} must be a (finite )?number.*, not "):
            get_policy("dp", **{key: bad})
    for bad in ("2.5", -1, "inf", "nan", "y"):
        with pytest.raises(ValueError, match="^fills must be a"):
            get_policy("dp", fills=bad)
    assert get_policy("dp", fills="2", age_credit="8").fills == 2


def test_every_policy_checks_its_options_by_name_and_range():
    """Options from "policy:key=value" specs are strings: each policy names a bad one and its range
    (not Python's 'could not convert string to float'), takes the string form of a good one, and an
    option it does not have is refused with the ones it has (a misspelt option must not run defaults)."""
    bad = [("pollux-dp", "p", "1", "p must be a finite number < 0, not '1'"),
           ("pollux-dp", "starvation_s", "soon", "starvation_s must be a number >= 0, not 'soon'"),
           ("sia", "starvation_s", "-3", "starvation_s must be a number >= 0, not '-3'"),
           ("fixed-batch", "starvation_s", "nan", "starvation_s must be a number >= 0, not 'nan'"),
           ("gavel", "round_s", "0", "round_s must be a finite number > 0, not '0'"),
           ("tiresias", "thresholds_gpu_s", "3600/x", "thresholds_gpu_s must be a finite number > 0, not 'x'"),
           ("dp", "thrash_cap", "1", "thrash_cap must be a finite number >= 0 and < 1, not '1'"),
           ("dp", "tenure", "maybe", "tenure must be a boolean (0/1, true/false, yes/no), not 'maybe'"),
           ("dp", "placement", "off", "placement must be a boolean (0/1, true/false, yes/no), not 'off'"),
           ("dp", "infer", "x", "infer must be a boolean or 'pooled', not 'x'")]
    for name, key, value, message in bad:
        with pytest.raises(ValueError) as e:
            get_policy(name, **{key: value})
        assert str(e.value) == message, (name, key)
    assert get_policy("pollux-dp", p="-2", starvation_s="inf").p == -2.0
    assert get_policy("gavel", round_s="60").round_s == 60.0
    assert get_policy("tiresias", thresholds_gpu_s="36000/3600").thresholds == (3600.0, 36000.0)
    assert get_policy("dp", placement="0").placement is False and get_policy("dp", rank_cap="inf").rank_cap == math.inf
    with pytest.raises(ValueError, match=r"^policy 'dp' has no option 'age_credt' \(its options: admission, .*age_credit"):
        get_policy("dp", age_credt="8")
    with pytest.raises(ValueError, match=r"^policy 'static' has no option 'p' \(its options: none\)$"):
        get_policy("static", p="-1")


def test_one_user_with_many_jobs_does_not_switch_how_everyone_is_valued():
    """dp values jobs by their work left while half of them report it (else Pollux's p-norm). Counted
    per job, one user's 10 reporting jobs switch the cluster to ranks over two other users who report
    nothing, and her 10 silent ones switch it off for two who report; each user counts once."""
    s = spec(batch=64)
    flood = tuple(job(i, s, remaining_samples=1e4 * (i + 1), user="mallory") for i in range(10))
    others = (job(10, s, user="alice"), job(11, s, user="bob"))
    dp = get_policy("dp")
    assert dp.objective_for(AllocationProblem(8, 4, flood + others)) == "pnorm"  # 1/3 of users' shares
    a = dp.allocate(AllocationProblem(8, 4, flood + others))
    waiting = [x.reason for x in a.jobs.values() if x.gpus == 0]
    assert waiting and all(r.endswith(
        "; jobs valued by speedup, not work left: 10 of 12 report it, 0 inferred; by user, 33% of a user's jobs "
        "report it, 33% with the inferred (ranks need 50% or 75%; each of the 3 users counts once)") for r in waiting)
    silent = tuple(job(i, s, user="mallory") for i in range(10))
    reporting = (job(10, s, remaining_samples=1e4, user="alice"), job(11, s, remaining_samples=1e5, user="bob"))
    assert dp.objective_for(AllocationProblem(8, 4, silent + reporting)) == "completion"  # 2/3 of users
    # one user (or none named): the plain shares of jobs, as before
    same = tuple(replace(r, user="") for r in flood + others)
    assert dp.objective_for(AllocationProblem(8, 4, same)) == "completion"  # 10 of 12 jobs


def test_a_waiting_job_is_told_how_jobs_were_valued_ranks_or_the_fallback_and_why():
    s = spec(batch=64)
    known = (job(0, s, remaining_samples=1e4), job(1, s, remaining_samples=1e5), job(2, s, remaining_samples=1e6),
             job(3, s))
    a = get_policy("dp").allocate(AllocationProblem(2, 4, known))  # 2 GPUs, four 1-GPU minimums
    assert [a.jobs[i].gpus for i in range(3)] == [1, 1, 0]  # the two shortest run
    assert a.jobs[2].reason.endswith("; shorter jobs first: 2 of 4 rank ahead of it by work left")
    unknown = (job(0, s, remaining_samples=1e4), job(1, s), job(2, s), job(3, s))
    b = get_policy("dp").allocate(AllocationProblem(2, 4, unknown))
    waiting = [x.reason for x in b.jobs.values() if x.gpus == 0]
    assert len(waiting) == 2 and all(r.endswith(
        "; jobs valued by speedup, not work left: 1 of 4 report it, 0 inferred (ranks need 2 reported or 3 in all)")
        for r in waiting)
    assert "rank ahead" not in " ".join(waiting)
    c = get_policy("dp", objective="pnorm").allocate(AllocationProblem(2, 4, unknown))  # chosen, not a fallback
    assert not any("valued by" in x.reason or "rank ahead" in x.reason for x in c.jobs.values())


def test_the_pnorm_fallback_is_not_used_across_pools_where_it_cannot_see_a_faster_gpu_type():
    from slurm_elastic.policies.base import Pool

    s = spec(batch=64)
    pools = (Pool("a", "", ("p",), (("n1", 8),)), Pool("b", "", ("p",), (("n2", 8),)))
    problem = AllocationProblem(16, 4, (job(0, s), job(1, s)), pools=pools)
    assert get_policy("dp").objective_for(problem) == "completion"
    assert get_policy("dp").objective_for(AllocationProblem(16, 4, (job(0, s), job(1, s)))) == "pnorm"


def test_a_goodput_decision_gives_its_goodput_gain_first():
    # running at 1 GPU on a batch far above its noise scale: the goodput policy grows it to a smaller batch
    # per GPU, and the reason names the goodput gain the policy chose by, then the samples/s change
    s = spec(max_gpus=4, min_batch=32, max_batch=1024, max_local=256, max_accum=4, batch=1024, restart_s=0.0)
    r = job(0, s, running=1, batch=1024, noise_scale=50.0, base_batch=32)
    a = get_policy("dp").allocate(AllocationProblem(4, 4, (r,)))
    got = a.jobs[0]
    assert got.gpus > 1 and got.batch < 1024, got
    assert got.reason.startswith(f"grown 1->{got.gpus}: +") and "% goodput (" in got.reason, got.reason
    t = get_policy("dp", objective="throughput").allocate(AllocationProblem(4, 4, (r,)))
    assert "goodput" not in t.jobs[0].reason and "samples/s" in t.jobs[0].reason, t.jobs[0].reason
