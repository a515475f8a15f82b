"""Throughput models: Pollux and Gavel tables, the NNLS parametric fit, the registry."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_elastic.profiles import load_profile, model_for_spec, model_from_points, profile_names
from slurm_elastic.profiles._nnls import nnls
from slurm_elastic.profiles.gavel import gavel_model
from slurm_elastic.profiles.measured import POLLUX_APPS, POLLUX_RANGES, pollux_model, pollux_observations
from slurm_elastic.profiles.parametric import Observation, ParametricModel, fit_error
from slurm_elastic.spec import ElasticSpec, SpecError, ThroughputPoint

PKG_DATA = Path(__file__).resolve().parents[2] / "slurm_elastic" / "data"
SHARED = Path(__file__).resolve().parents[3] / "shared" / "data"


def test_packaged_data_is_a_byte_copy_with_provenance():
    prov = (PKG_DATA / "PROVENANCE.md").read_text()
    assert "c793c7089bd307462686339d29707925c461f9a9" in prov and "Apache-2.0" in prov
    assert "c4fa40097339e9608ab71fd64c8bdea96a5e4a4c" in prov and "MIT" in prov
    if not SHARED.exists():
        pytest.skip("../shared/data not present")
    for app in POLLUX_APPS:
        for name in ("placements.csv", "scalability.csv"):
            assert (PKG_DATA / "pollux" / app / name).read_bytes() == (SHARED / "pollux" / "traces" / app / name).read_bytes()
    assert (PKG_DATA / "gavel" / "simulation_throughputs.json").read_bytes() == (
        SHARED / "gavel" / "simulation_throughputs.json").read_bytes()


@pytest.mark.parametrize("app", POLLUX_APPS)
def test_pollux_reproduces_uniform_measured_rows(app):
    m = pollux_model(app)
    rows = list(csv.DictReader((PKG_DATA / "pollux" / app / "placements.csv").open()))
    checked = 0
    for r in rows:
        p = r["placement"]
        if len(set(p)) != 1:  # non-uniform placements are averaged/replaced by the uniform one
            continue
        k, n = sum(int(c) for c in p), len(p)
        step, sync = m.step_time(k, n, int(r["local_bsz"]))
        assert step == pytest.approx(float(r["step_time"]), rel=1e-12)
        assert sync == pytest.approx(float(r["sync_time"]), rel=1e-12)
        checked += 1
    assert checked >= 10 * 5  # 1-4 nodes x 1-4 GPUs uniform, several batches each


def test_pollux_interpolates_between_and_extends_past_measured_batches():
    m = pollux_model("cifar10")
    lo, hi = m.step_time(1, 1, 32)[0], m.step_time(1, 1, 45)[0]
    mid = m.step_time(1, 1, 38)[0]
    assert lo < mid < hi
    assert mid == pytest.approx(lo + (hi - lo) * (38 - 32) / (45 - 32))
    assert m.step_time(1, 1, 2048)[0] > m.step_time(1, 1, 1024)[0]  # extended, still growing
    arr, _ = m.step_times(4, 1, np.array([32.0, 38.0, 45.0]))
    assert arr.tolist() == pytest.approx([m.step_time(4, 1, b)[0] for b in (32, 38, 45)])


def test_pollux_unmeasured_placement_uses_the_fitted_model():
    m = pollux_model("cifar10")
    assert not m.measured(8, 1)  # T4 nodes had 4 GPUs
    assert m.step_time(8, 1, 128) == m.fallback.step_time(8, 1, 128)
    assert m.measured(64, 16) and m.samples_per_s(64, 16, 128) > m.samples_per_s(4, 1, 128)


def test_samples_per_s_accumulation_rule():
    m = pollux_model("bert")
    step, sync = m.step_time(4, 1, 8)
    assert m.samples_per_s(4, 1, 8, accum=3) == pytest.approx(4 * 8 * 3 / (step + 2 * (step - sync)))
    v = m.samples_per_s_array(4, 1, np.array([8.0, 8.0]), np.array([1.0, 3.0]))
    assert v.tolist() == pytest.approx([m.samples_per_s(4, 1, 8), m.samples_per_s(4, 1, 8, 3)])


def test_gavel_is_non_monotone_and_bounded():
    m = gavel_model("v100", "lm")
    assert m.max_gpus == 8
    sps = [m.samples_per_s(k, 1, 20) for k in (1, 2, 4, 8)]
    assert sps[1] > sps[2] < sps[3]  # 2 GPUs beat 4 GPUs: not concave, not even monotone
    assert m.samples_per_s(1, 1, 20) == pytest.approx(64.74245099960703 * 20)  # rate x batch
    with pytest.raises(ValueError):
        m.step_time(16, 2, 20)
    single = gavel_model("k80", "a3c")
    assert single.max_gpus == 1


def test_registry():
    names = profile_names()
    assert "cifar10" in names and "gavel.v100.resnet18" in names
    assert load_profile("pollux.cifar10") is load_profile("cifar10")
    with pytest.raises(KeyError, match="unknown profile"):
        load_profile("nope")
    spec = ElasticSpec(1, 4, 32, 512, 128, profile="nope")
    with pytest.raises(SpecError) as e:
        model_for_spec(spec, 4, job_id=7)
    assert e.value.field == "profile" and e.value.job_id == 7
    with pytest.raises(SpecError, match="profile.*points|points"):
        model_for_spec(ElasticSpec(1, 4, 32, 512, 128), 4)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 8), st.integers(1, 5), st.integers(0, 10_000))
def test_nnls_matches_scipy(n, extra, seed):
    scipy_nnls = pytest.importorskip("scipy.optimize").nnls
    rng = np.random.default_rng(seed)
    A = rng.normal(size=(n + extra, n))
    b = rng.normal(size=n + extra)
    x, r = nnls(A, b)
    xs, rs = scipy_nnls(A, b)
    assert (x >= 0).all()
    assert r == pytest.approx(rs, rel=1e-6, abs=1e-9)


def test_parametric_fit_recovers_its_own_coefficients():
    truth = ParametricModel([0.02, 0.0005, 0.01, 0.002, 0.05, 0.001])
    obs = []
    for k, n in [(1, 1), (2, 1), (4, 1), (8, 2), (16, 4)]:
        for lb, a in [(32, 1), (128, 1), (64, 3)]:
            obs.append(Observation(k, n, lb, a, truth.samples_per_s(k, n, lb, a)))
    fit = ParametricModel.fit(obs)
    assert fit.coeffs.tolist() == pytest.approx(truth.coeffs.tolist(), rel=1e-6, abs=1e-9)
    assert fit_error(fit, obs)["max"] < 1e-9


@pytest.mark.parametrize("app", POLLUX_APPS)
def test_parametric_fit_error_against_pollux_tables(app):
    """The figures in docs/ALGORITHM.md: fit on the whole table, and on 8 points a job would report."""
    rows = pollux_observations(app)
    full = fit_error(ParametricModel.fit(rows), rows)
    uniform = [r for r in rows if r.gpus % r.nodes == 0]
    assert full["median"] < 0.12 and fit_error(ParametricModel.fit(rows), uniform)["median"] < 0.12
    rng = np.random.default_rng(0)
    few = [rows[i] for i in rng.choice(len(rows), 8, replace=False)]
    assert fit_error(ParametricModel.fit(few), rows)["median"] < 0.35


def test_points_model_through_the_spec():
    spec = ElasticSpec(1, 8, 64, 2048, 256, points=(ThroughputPoint(1, 128, 1000.0), ThroughputPoint(2, 256, 1800.0),
                                                   ThroughputPoint(4, 512, 3000.0)))
    m = model_for_spec(spec, 4)
    for p in spec.points:
        assert m.samples_per_s(p.gpus, 1, p.batch // p.gpus) == pytest.approx(p.samples_per_s, rel=1e-6)
    one = model_from_points([ThroughputPoint(2, 256, 1800.0)], spec, 4)
    assert one.samples_per_s(2, 1, 128) == pytest.approx(1800.0, rel=1e-6)


def test_pollux_ranges_match_the_tables():
    for app, r in POLLUX_RANGES.items():
        lbs = {o.local_batch for o in pollux_observations(app)}
        assert min(lbs) == r["min_local_batch"]
        assert max(lbs) >= r["max_local_batch"]  # the allowed range is measured (yolov3 measured up to 16)


def test_goodput_efficiency_from_validation_tables():
    from slurm_elastic.profiles.goodput import pollux_efficiency, pollux_efficiency_table

    b, e = pollux_efficiency_table("cifar10")
    assert b[0] == 128 and e[0] == pytest.approx(1.0, abs=1e-3)
    assert (np.diff(e) < 0).all() and 0.5 < e[-1] < 0.7  # 4096 is worth ~0.61 of a 128-batch sample
    f = pollux_efficiency("cifar10")
    assert f(np.array([128.0, 4096.0, 8192.0])).tolist() == pytest.approx([e[0], e[-1], e[-1]])
    assert e[1] > f(np.array([362.0]))[0] > e[2]  # log-interpolated between 256 and 512


def test_goodput_objective_picks_a_smaller_batch():
    from slurm_elastic.policies import AllocationProblem, JobRequest, get_policy

    spec = ElasticSpec(1, 4, 128, 4096, 1024, min_local_batch=32, profile="cifar10")
    prob = AllocationProblem(4, 4, (JobRequest(0, spec, load_profile("cifar10")),))
    thr = get_policy("dp", objective="throughput").allocate(prob).jobs[0]
    good = get_policy("dp", objective="goodput").allocate(prob).jobs[0]
    assert good.batch < thr.batch and good.samples_per_s <= thr.samples_per_s


def test_every_gavel_profile_gives_finite_positive_throughput():
    # Gavel's table has 0.0 for configurations it did not measure (k80 resnet50, batch 128 on 2-8 GPUs);
    # read as a measurement, it made the step time infinite and samples/s NaN.
    import numpy as np

    from slurm_elastic.profiles.gavel import GavelModel, gavel_profile_names

    lbs = np.array([1.0, 8.0, 16.0, 64.0, 100.0, 128.0, 256.0, 512.0])
    for name in gavel_profile_names():
        _, gpu, model = name.split(".", 2)
        g = GavelModel(gpu, model)
        for k in range(1, g.max_gpus + 1):
            for nodes in (1, 2):
                for accum in (1, 3):
                    v = g.samples_per_s_array(k, nodes, lbs, accum)
                    assert np.isfinite(v).all() and (v > 0).all(), (name, k, nodes, accum, v)
