"""Exactness of the DP: against brute force (kernel and whole policy, incl. non-concave Gavel
profiles), against the plain-Python reference DP, and against scipy's MILP (HiGHS)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from slurm_elastic.policies import AllocationProblem, JobRequest, get_policy
from slurm_elastic.policies._mckp import dp_stats, mckp, mckp_reference
from slurm_elastic.profiles import load_profile
from slurm_elastic.profiles.measured import POLLUX_RANGES
from slurm_elastic.spec import ElasticSpec

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def mckp_instances(draw, max_jobs=5, max_choices=5, max_w=12, max_cap=40):
    n_jobs = draw(st.integers(0, max_jobs))
    offsets, weights, values = [0], [], []
    for _ in range(n_jobs):
        ws = sorted(draw(st.lists(st.integers(1, max_w), max_size=max_choices - 1)))
        weights += [0] + ws
        values += draw(st.lists(st.floats(0, 10, allow_nan=False), min_size=len(ws) + 1, max_size=len(ws) + 1))
        offsets.append(len(weights))
    return (np.array(offsets), np.array(weights, dtype=np.int64), np.array(values, dtype=np.float64),
            draw(st.integers(0, max_cap)))


def brute(offsets, weights, values, cap):
    best = 0.0 if len(offsets) == 1 else -np.inf
    ranges = [range(offsets[j], offsets[j + 1]) for j in range(len(offsets) - 1)]
    for combo in itertools.product(*ranges):
        if weights[list(combo)].sum() <= cap:
            best = max(best, values[list(combo)].sum())
    return best


@SETTINGS
@given(mckp_instances())
def test_kernel_equals_brute_force(inst):
    offsets, weights, values, cap = inst
    obj, chosen = mckp(offsets, weights, values, cap)
    assert obj == pytest.approx(brute(offsets, weights, values, cap), rel=1e-12, abs=1e-12)
    assert weights[chosen].sum() <= cap
    assert values[chosen].sum() == pytest.approx(obj, rel=1e-12, abs=1e-12)
    for j, c in enumerate(chosen):
        assert offsets[j] <= c < offsets[j + 1]
    ref_obj, ref_chosen = mckp_reference(offsets, weights, values, cap)
    assert ref_obj == pytest.approx(obj, rel=1e-12, abs=1e-12)


def test_kernel_uses_int32_table_when_a_job_has_many_choices():
    n = 40000
    offsets = np.array([0, n, 2 * n])
    weights = np.concatenate([np.arange(n), np.arange(n)])
    values = np.concatenate([np.sqrt(np.arange(n)), np.arange(n) * 0.001])
    stats = dp_stats(offsets, weights, values, 50000)
    assert stats["table_bytes"] == 4 * stats["table_cells"]
    obj, chosen = mckp(offsets, weights, values, 50000)
    # best split of 50000 between sqrt(x) and 0.001 y: take y as large as possible
    x = np.arange(0, n)
    y = np.minimum(50000 - x, n - 1)
    assert obj == pytest.approx(float((np.sqrt(x) + 0.001 * y).max()))


def test_kernel_rejects_bad_input():
    with pytest.raises(ValueError):
        mckp(np.array([0, 2]), np.array([1, 2]), np.array([1.0, 2.0]), 3)  # first choice not weight 0
    with pytest.raises(ValueError):
        mckp(np.array([0, 3]), np.array([0, 2, 1]), np.array([0.0, 1.0, 2.0]), 3)  # unsorted


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10_000), st.integers(10, 60), st.integers(5, 300))
def test_kernel_equals_milp_on_medium_instances(seed, n_jobs, cap):
    pytest.importorskip("scipy.optimize")
    from slurm_elastic.policies._milp import mckp_milp

    rng = np.random.default_rng(seed)
    offsets, weights, values = [0], [], []
    for _ in range(n_jobs):
        k = int(rng.integers(1, 12))
        w = np.concatenate([[0], np.sort(rng.choice(np.arange(1, 40), size=k - 1, replace=False))])
        v = np.cumsum(rng.random(k)) * rng.uniform(0.5, 2) + rng.normal(0, 0.3, k)  # not concave
        weights += w.tolist()
        values += v.tolist()
        offsets.append(len(weights))
    offsets, weights, values = np.array(offsets), np.array(weights), np.array(values)
    obj, chosen = mckp(offsets, weights, values, cap)
    m_obj, _ = mckp_milp(offsets, weights, values, cap, time_limit=30)
    assert m_obj is not None
    assert obj == pytest.approx(m_obj, rel=1e-7, abs=1e-7)


# ---- the whole policy against an independent brute force over (k, b) per job -------------------

POLLUX = ["cifar10", "bert", "deepspeech2", "imagenet", "yolov3"]
GAVEL = ["gavel.v100.lm", "gavel.v100.resnet18", "gavel.k80.transformer", "gavel.p100.resnet50"]
GAVEL_BATCH = {"lm": (5, 80), "resnet18": (16, 256), "transformer": (16, 256), "resnet50": (16, 128)}


@st.composite
def problems(draw, max_jobs=4):
    node_size = draw(st.sampled_from([2, 4]))
    total = draw(st.integers(1, 12))
    jobs = []
    for i in range(draw(st.integers(1, max_jobs))):
        prof = draw(st.sampled_from(POLLUX + GAVEL))
        if prof.startswith("gavel"):
            lo, hi = GAVEL_BATCH[prof.split(".")[2]]
            ranges = dict(min_batch=lo, max_batch=hi * 8, min_local_batch=lo, max_local_batch=hi)
            max_g = 8
        else:
            r = POLLUX_RANGES[prof]
            ranges = {k: r[k] for k in ("min_batch", "max_batch", "min_local_batch", "max_local_batch")}
            max_g = 16
        min_g = draw(st.integers(1, 4))
        max_g = draw(st.integers(min_g, max_g))
        accum = draw(st.sampled_from([1, 1, 2, 4]))
        gpn = draw(st.sampled_from([None, None, None, 1, 2]))
        if gpn is not None:
            max_g = max(max_g, gpn)
        spec = ElasticSpec(min_gpus=min_g, max_gpus=max_g, max_accum=accum, profile=prof, gpus_per_node=gpn,
                           weight=draw(st.sampled_from([1.0, 2.0, 0.5])), **ranges)
        running, rb = 0, None
        if draw(st.booleans()):
            counts = [k for k in spec.allowed_gpu_counts(node_size) if spec.feasible_batches(k)]
            if counts:
                running = draw(st.sampled_from(counts))
                rb = draw(st.sampled_from(spec.feasible_batches(running)[:50]))
        jobs.append(JobRequest(i, spec, load_profile(prof), running, rb,
                               restart_s=draw(st.sampled_from([0.0, 45.0, 600.0])),
                               wait_s=draw(st.sampled_from([0.0, 10_000.0]))))
    return AllocationProblem(total, node_size, tuple(jobs), horizon_s=3600.0,
                             allow_preemption=draw(st.booleans()))


def _options(req, node_size, cap):
    """{k: (best value, batch)} from the spec's own feasible_batches/split_batch (independent of the policy)."""
    m, spec = req.model, req.spec
    out = {}
    for k in spec.allowed_gpu_counts(node_size):
        if k > cap or (m.max_gpus is not None and k > m.max_gpus):
            continue
        n = spec.placement(k, node_size)[0]
        best = None
        for b in spec.feasible_batches(k):
            local, acc = spec.split_batch(k, b)
            v = m.samples_per_s(k, n, local, acc)
            if best is None or v > best[0]:
                best = (v, b)
        if best is not None:
            out[k] = best
    return out


def brute_policy(problem, starvation_s=3600.0, admission="priority", margin=None, round_trip=None):
    """The dp policy's objective by enumeration; ``margin``: the policy's restart margin (its default);
    ``round_trip``: a grow also loses the restart share of the job's value at its minimum (its default)."""
    from slurm_elastic.policies.dp import DPPolicy

    if margin is None:
        margin = DPPolicy().restart_margin
    if round_trip is None:
        round_trip = DPPolicy().round_trip
    cap, ns = problem.total_gpus, problem.node_size
    opts = [_options(r, ns, cap) for r in problem.jobs]
    refs = [o[min(o)][0] if o else 0.0 for o in opts]
    admitted, free, holder, optional = set(), cap, False, set()
    order = list(range(len(problem.jobs)))
    if not problem.allow_preemption:
        for j in order:
            r = problem.jobs[j]
            if r.is_running and opts[j] and min(opts[j]) <= free:
                admitted.add(j)
                free -= min(opts[j])
    for j in order:
        r = problem.jobs[j]
        if (r.is_running and not problem.allow_preemption) or not opts[j] or holder:
            continue
        if admission == "joint" and not r.is_running and r.wait_s < starvation_s:
            optional.add(j)
            continue
        if min(opts[j]) <= free:
            admitted.add(j)
            free -= min(opts[j])
        elif r.wait_s >= starvation_s:
            holder = True
    if holder:  # a starving job holds the line: optional jobs behind it wait (none ahead can exist)
        optional = {j for j in optional if j < min(j2 for j2 in range(len(order)) if j2 not in admitted
                                                     and problem.jobs[j2].wait_s >= starvation_s
                                                     and opts[j2])}
    adm = sorted(admitted | optional)
    best = 0.0 if not adm else -np.inf
    for ks in itertools.product(*[([0] if j in optional else []) + sorted(opts[j]) for j in adm]):
        if sum(ks) > cap:
            continue
        total = 0.0
        for j, k in zip(adm, ks, strict=True):
            r = problem.jobs[j]
            if k == 0:
                continue
            v = r.weight * opts[j][k][0] / refs[j]
            if r.is_running:
                # the default rule (realloc="life"): the restart over the job's expected life (no work
                # reported, nothing attained: the horizon), times the anti-thrash share, capped at 0.5
                # (held unknown: the horizon)
                life = problem.horizon_s
                f = (1 - r.restart_s / life if life > r.restart_s else 0.0) * \
                    (1 - min(0.5, margin * r.restart_s / problem.horizon_s))
                if k != r.running_gpus:
                    v *= f
                    if round_trip and k > r.running_gpus:  # and the way back to its minimum (speedup 1)
                        v = max(0.0, v - r.weight * (1 - f) * opts[j][min(opts[j])][0] / refs[j])
                else:  # at its running count it keeps its batch (the planner makes no batch-only change)
                    local, acc = r.spec.split_batch(k, r.running_batch)
                    keep = r.model.samples_per_s(k, r.spec.placement(k, ns)[0], local, acc)
                    v = r.weight * keep / refs[j]
            total += v
        best = max(best, total)
    return best, admitted


def check_feasible(problem, alloc, admitted=None):
    ns = problem.node_size
    assert alloc.gpus_used() <= problem.total_gpus
    assert list(alloc.jobs) == [r.job_id for r in problem.jobs]
    for r in problem.jobs:
        a = alloc.jobs[r.job_id]
        assert a.reason
        if a.gpus == 0:
            assert admitted is None or r.job_id not in admitted
            continue
        spec = r.spec
        assert a.gpus in spec.allowed_gpu_counts(ns)
        assert spec.min_batch <= a.batch <= spec.max_batch
        assert spec.split_batch(a.gpus, a.batch) == (a.local_batch, a.accum)
        assert a.gpus * a.local_batch * a.accum == a.batch
        assert a.local_batch <= spec.max_local_batch and a.accum <= spec.max_accum
        assert (a.nodes, a.gpus // a.nodes) == spec.placement(a.gpus, ns)
        assert a.samples_per_s == pytest.approx(r.model.samples_per_s(a.gpus, a.nodes, a.local_batch, a.accum),
                                                rel=1e-9)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_dp_policy_equals_brute_force(problem):
    best, admitted = brute_policy(problem)
    alloc = get_policy("dp", objective="throughput", admission="priority").allocate(problem)
    assert alloc.objective == pytest.approx(best, rel=1e-9, abs=1e-12)
    check_feasible(problem, alloc, {problem.jobs[j].job_id for j in admitted})
    for j in admitted:  # every admitted job gets at least its minimum
        assert alloc.jobs[problem.jobs[j].job_id].gpus >= 1


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_dp_joint_admission_equals_brute_force(problem):
    best, _ = brute_policy(problem, admission="joint")
    alloc = get_policy("dp", admission="joint", objective="throughput").allocate(problem)
    assert alloc.objective == pytest.approx(best, rel=1e-9, abs=1e-12)
    check_feasible(problem, alloc)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_jobs=5))
def test_baselines_are_feasible_and_not_better_than_dp(problem):
    # fixed-batch weighs a restart as dp did before issue 23 (realloc="share") with restart_margin 1: compare
    # like with like (dp's default charge, realloc="life", values a forced shrink differently)
    dp = get_policy("dp", objective="throughput", restart_margin=1.0, admission="priority",
                    realloc="share").allocate(problem)
    for name in ("fixed-batch", "static"):
        alloc = get_policy(name).allocate(problem)
        check_feasible(problem, alloc)
        if name == "fixed-batch":
            # where admission is the same (same jobs, same minimum counts), fixed-batch's choices are a
            # subset of dp's with the same values: the exact optimum is at least as good
            from slurm_elastic.policies._candidates import make_candidates

            a, b = make_candidates(problem), make_candidates(problem, fixed_batch=True)
            same = a.status == b.status and all(
                len(a.tables[j]) == 0 or len(b.tables[j]) == 0 or a.tables[j].counts[0] == b.tables[j].counts[0]
                for j in a.dp_jobs)
            if same:
                assert alloc.objective <= dp.objective + 1e-9
