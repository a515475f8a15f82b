"""The trust rule (slurm_elastic.claims): a job's own numbers cannot buy it GPUs or a place in the queue.

An honest job and a forging twin (same spec, same speed, same history as Slurm shows it) get the same
GPUs and the same start order in the cycle that reads the forgery, for each forged field."""

import json
import os
from dataclasses import replace

import pytest

from slurm_elastic.backends.base import JobRecord, NodeRecord
from slurm_elastic.claims import ClaimBook, Evidence
from slurm_elastic.daemon.models import ModelRegistry
from slurm_elastic.policies import get_policy
from slurm_elastic.problem import build_problem
from slurm_elastic.spec import parse_spec

SPEC = "elastic:min_gpus=1,max_gpus=8,min_batch=64,max_batch=4096,max_local_batch=512,batch=128"
POINTS = [{"gpus": 2, "batch": 128, "samples_per_s": 200.0}, {"gpus": 1, "batch": 128, "samples_per_s": 110.0}]


def test_noise_scale_is_clipped_to_what_the_batch_range_can_use_and_dropped_for_a_user_who_lied():
    book = ClaimBook()
    kw = dict(max_batch=4096)
    assert book.update(1, "u", Evidence(running_s=100.0), noise_scale=300.0, **kw).noise_scale == 300.0
    assert book.update(1, "u", Evidence(running_s=130.0), noise_scale=1e12, **kw).noise_scale == 40960.0
    for bad in (float("nan"), float("inf"), -1.0, "1e9", True):  # kept at the last good one
        assert book.update(1, "u", Evidence(running_s=200.0), noise_scale=bad, **kw).noise_scale == 40960.0
    # the user's other job lies about its progress (a jump its verified throughput cannot make) ...
    ev = Evidence(running_s=500.0, gpus=2, rate=100.0, best_rate=100.0)
    book.update(2, "u", ev, seen=10, total=1e6, **kw)
    t = book.update(2, "u", replace(ev, running_s=510.0), seen=999_000, total=1e6, **kw)
    assert t.remaining_samples is None and book.strikes == {"u": 1}
    # ... so none of the user's noise scales is used any more (conservative efficiency)
    assert book.update(1, "u", Evidence(running_s=600.0), noise_scale=300.0, **kw).noise_scale is None
    assert book.update(3, "v", Evidence(running_s=600.0), noise_scale=300.0, **kw).noise_scale == 300.0


def test_the_book_survives_a_daemon_restart_and_malformed_state_starts_cold():
    book = ClaimBook()
    book.update(3, "u", Evidence(running_s=500.0, gpus=2, rate=100.0, best_rate=100.0), seen=10, total=1e6,
                max_batch=512)
    book.strikes["w"] = 2
    back = ClaimBook.from_json(json.loads(json.dumps(book.to_json())))
    assert back.jobs[3].total == 1e6 and back.jobs[3].seen == 10 and back.strikes == {"w": 2}
    for junk in (None, [], {"jobs": {"x": {}}}, {"jobs": {"4": {"evil": 1}}}, {"strikes": {"u": -1, "v": "9"}}):
        assert ClaimBook.from_json(junk).jobs == {} and ClaimBook.from_json(junk).strikes == {}


# ----- twins through the daemon's registry, the problem builder and the default policy ----------------


def _twin(tmp_path, jid, state="RUNNING", gpus=2, submit=0.0):
    d = tmp_path / str(jid)
    d.mkdir()
    s = parse_spec(f"{SPEC},ckpt_dir={d}")
    rec = JobRecord(job_id=jid, name="t", user=f"user{jid}", partition="gpu", state=state, comment=s.to_comment(),
                    gpus_per_node=gpus, gpus_total=gpus, node_count=1 if gpus else 0,
                    nodes=(f"n{jid}",) if state == "RUNNING" else (), restart_count=0, user_id=os.getuid(),
                    start_time=1000.0 if state == "RUNNING" else None, submit_time=submit)
    return rec, d


def _write(d, **fields):
    (d / "throughput.json").write_text(json.dumps({"format": 1, **fields}))


def _allocate(reg, recs, nodes, now):
    snap = build_problem(recs, nodes, model_for=reg, now=now, job_info=lambda r: reg.progress.get(r.job_id))
    alloc = get_policy("dp").allocate(snap.problem)
    return {j: (a.gpus, a.batch) for j, a in alloc.jobs.items()}, snap


def _nodes(free):
    return [NodeRecord("n1", "MIXED", (), 8, 8 - free, 8, ("gpu",)), NodeRecord("n2", "MIXED", (), 8, 4, 8, ("gpu",)),
            NodeRecord("n3", "MIXED", (), 8, 4, 8, ("gpu",))]


def _running_twins(tmp_path):
    reg = ModelRegistry(node_size=8)
    (a, da), (b, db) = _twin(tmp_path, 1), _twin(tmp_path, 2)
    a, b = replace(a, nodes=("n2",)), replace(b, nodes=("n3",))
    for rec in (a, b):  # Slurm showed each 1 h on 1 GPU, then 1 h on 2 (both verified points)
        reg.evidence.observe(rec.job_id, 0, 1, 1000.0, 4600.0)
        reg.evidence.observe(rec.job_id, 1, 2, 4700.0, 8300.0)
    honest = dict(points=POINTS, samples_seen=700_000, total_samples=5_000_000, noise_scale=300.0, base_batch=64)
    _write(da, **honest)
    _write(db, **honest)
    return reg, a, b, da, db, honest


@pytest.mark.parametrize("forged", ["samples_seen", "points"])
def test_a_forging_running_twin_gets_no_more_than_the_honest_one(tmp_path, forged):
    reg, a, b, da, db, honest = _running_twins(tmp_path)
    nodes = [NodeRecord("n1", "IDLE", (), 8, 0, 8, ("gpu",)), NodeRecord("n2", "MIXED", (), 8, 2, 8, ("gpu",)),
             NodeRecord("n3", "MIXED", (), 8, 2, 8, ("gpu",))]
    before, _ = _allocate(reg, [a, b], nodes, now=9000.0)
    assert before[1] == before[2]
    forgery = {"samples_seen": dict(samples_seen=4_999_990),  # a jump to just below the total
               "points": dict(points=POINTS + [{"gpus": 8, "batch": 512, "samples_per_s": 5000.0}])}[forged]
    _write(db, **{**honest, **forgery})
    reg.evidence.observe(1, 1, 2, 4700.0, 8330.0)  # the next cycle, 30 s later
    reg.evidence.observe(2, 1, 2, 4700.0, 8330.0)
    after, snap = _allocate(reg, [a, b], nodes, now=9030.0)
    reqs = {r.job_id: r for r in snap.problem.jobs}
    if forged == "points":  # unverified points are ignored: the twins are the same job
        assert after[2] == after[1] and reqs[2].remaining_samples == reqs[1].remaining_samples, after
    else:  # the jump is caught in this cycle: no claim left (so no rank), and its user's noise scale goes too
        assert after[2][0] == after[1][0], after
        assert reqs[2].remaining_samples is None and reqs[1].remaining_samples is not None
        assert reqs[2].noise_scale is None and reqs[1].noise_scale == 300.0


def test_a_forged_noise_scale_buys_no_more_than_ten_times_the_job_s_largest_batch(tmp_path):
    """A noise scale cannot be checked against what Slurm shows: 1e12 is planned exactly as a claim of
    10 x max_batch is, the most that can change the efficiency over the job's own batch range."""
    reg, a, b, da, db, honest = _running_twins(tmp_path)
    nodes = [NodeRecord("n2", "MIXED", (), 8, 2, 8, ("gpu",)), NodeRecord("n3", "MIXED", (), 8, 2, 8, ("gpu",))]
    _write(db, **{**honest, "noise_scale": 1e12})
    forged, snap = _allocate(reg, [a, b], nodes, now=9000.0)
    assert {r.job_id: r.noise_scale for r in snap.problem.jobs} == {1: 300.0, 2: 40960.0}
    _write(db, **{**honest, "noise_scale": 40960.0})
    assert _allocate(reg, [a, b], nodes, now=9000.0)[0] == forged


def test_a_pending_twin_that_claims_100_samples_left_does_not_start_first(tmp_path):
    reg = ModelRegistry(node_size=8)
    (h, _), (f, df) = _twin(tmp_path, 1, "PENDING", 0, submit=100.0), _twin(tmp_path, 2, "PENDING", 0, submit=200.0)
    _write(df, points=POINTS, samples_seen=4_999_900, total_samples=5_000_000)
    # Room for one at its minimum only: one GPU
    nodes = [NodeRecord("n1", "IDLE", (), 1, 0, 8, ("gpu",))]
    alloc, snap = _allocate(reg, [h, f], nodes, now=1000.0)
    assert [r.job_id for r in snap.problem.jobs] == [1, 2]
    assert alloc[1][0] >= 1 and alloc[2][0] == 0, alloc  # the honest, earlier job starts; the claim buys nothing
    assert all(r.remaining_samples is None for r in snap.problem.jobs)


def test_a_user_whose_claims_were_borne_out_may_order_the_queue_until_one_proves_false():
    book = ClaimBook()
    kw = dict(max_batch=512)
    pending = Evidence(running_s=0.0)
    assert book.update(1, "u", pending, seen=0, total=1e6, **kw).remaining_samples is None  # no history yet
    ev = Evidence(running_s=100.0, gpus=2, rate=1000.0, best_rate=1000.0)
    assert book.update(1, "u", ev, seen=1000, total=1e6, **kw).remaining_samples == 1e6 - 1000
    book.update(1, "u", replace(ev, running_s=1100.0), seen=950_000, total=1e6, **kw)
    book.forget(set())  # job 1 ended, 95% seen, its claim never false: a credit
    assert book.credits == {"u": 1} and book.trusted_user("u")
    assert book.update(2, "u", pending, seen=0, total=5e5, **kw).remaining_samples == 5e5  # waiting: counts
    book.update(3, "v", pending, seen=0, total=10, **kw)
    book.forget({2, 3})  # a job that leaves early, or never verified, earns nothing
    assert book.credits == {"u": 1}
    # one false claim and the user's waiting jobs lose that standing again
    book.update(2, "u", ev, seen=10, total=5e5, **kw)
    book.update(2, "u", replace(ev, running_s=101.0), seen=499_999, total=5e5, **kw)
    assert book.strikes == {"u": 1} and not book.trusted_user("u")
    assert book.update(4, "u", pending, seen=0, total=100, **kw).remaining_samples is None


# ----- the restart cost: measured beats claimed, and a claim is bounded until measured -----------------


def _two_users(claim, a_gpus, b_left):
    """Two users' jobs that have shared 16 GPUs for 10 h, each restart measured at 30 s; user a's spec
    claims ``claim`` seconds."""
    from slurm_elastic.policies import AllocationProblem, JobRequest
    from tests.unit.test_policies import MODEL, spec

    def req(jid, s, k, left, user):
        return JobRequest(jid, s, MODEL, k, 64 * k, restart_s=30.0, held_s=36000.0, attained_gpu_s=k * 36000.0,
                          remaining_samples=left, user=user, age_s=36000.0)

    jobs = (req(1, spec(max_gpus=16, restart_s=claim), a_gpus, 1e9, "a"), req(2, spec(max_gpus=16), 16 - a_gpus,
                                                                             b_left, "b"))
    plan = get_policy("dp").allocate(AllocationProblem(16, 16, jobs, horizon_s=3600.0))
    return {j: x.gpus for j, x in plan.jobs.items()}


@pytest.mark.parametrize("a_gpus,b_left", [(15, 1e10), (12, 1e10), (15, 1e9), (8, 1e8)])
def test_a_claimed_restart_cost_does_not_outweigh_the_measured_one(a_gpus, b_left):
    # The spec's restart_s won over the measured 30 s: a claim of 116 days made every rescale of the job
    # unpayable, so at 15 GPUs it kept all 15 while the other user's job, worth 8, ran on 1 (and where the
    # other's gain was larger, the claimant fell to its minimum). Now it is planned as its honest twin.
    honest = _two_users(None, a_gpus, b_left)
    assert _two_users(1e7, a_gpus, b_left) == honest
    assert honest[2] >= 5  # a real rescale: the other user's job gains GPUs


def test_an_unmeasured_restart_claim_counts_for_at_most_ten_minutes(tmp_path):
    from slurm_elastic.claims import RESTART_CLAIM_MAX_S, restart_claim

    assert RESTART_CLAIM_MAX_S == 600.0
    assert [restart_claim(v) for v in (None, 12.5, 1e7, float("inf"), float("nan"), -5.0)] == \
        [None, 12.5, 600.0, None, None, None]
    reg = ModelRegistry(node_size=8)
    recs = []
    for jid, claim in ((1, None), (2, 90.0), (3, 1e7)):
        d = tmp_path / str(jid)
        d.mkdir()
        s = parse_spec(f"{SPEC},ckpt_dir={d}" + (f",restart_s={claim:g}" if claim else ""))
        recs.append(JobRecord(job_id=jid, name="t", user="u", partition="gpu", state="PENDING",
                              comment=s.to_comment(), user_id=os.getuid(), submit_time=0.0))
    snap = build_problem(recs, _nodes(8), model_for=reg, now=100.0, default_restart_s=20.0)
    assert {r.job_id: r.restart_s for r in snap.problem.jobs} == {1: 20.0, 2: 90.0, 3: 600.0}
    assert {v.job_id: v.restart_s for v in snap.views} == {1: 20.0, 2: 90.0, 3: 600.0}  # the stability guard's
    assert {v.job_id: v.restart_from for v in snap.views} == {1: "default", 2: "spec", 3: "spec,capped"}  # status
    # a measured cost replaces the claim, and is bounded too: it ends at a first step the job reports
    from sim_helpers import LinearModel

    class Measured(LinearModel):
        def __init__(self, restart_s):
            super().__init__(100.0)
            self.restart_s = restart_s

    for measured, planned in ((35.0, 35.0), (5000.0, 600.0)):
        snap = build_problem(recs, _nodes(8), model_for=lambda r, s, m=measured: Measured(m), now=100.0,
                             default_restart_s=20.0)
        assert {r.restart_s for r in snap.problem.jobs} == {planned}
        assert {v.restart_from for v in snap.views} == {"measured" if measured < 600 else "measured,capped"}
    # a site whose honest restarts take longer raises the bound (daemon config restart_claim_max_s)
    snap = build_problem(recs, _nodes(8), model_for=reg, now=100.0, default_restart_s=20.0, restart_claim_max_s=3600.0)
    assert {r.job_id: r.restart_s for r in snap.problem.jobs} == {1: 20.0, 2: 90.0, 3: 3600.0}
    snap = build_problem(recs, _nodes(8), model_for=lambda r, s: Measured(5000.0), now=100.0,
                         restart_claim_max_s=3600.0)
    assert {r.restart_s for r in snap.problem.jobs} == {3600.0}


# ----- the weight: a user may only lower a job's standing; more is the site's grant --------------------


def _weighted(w, grants=None, running=0, account=""):
    """Users a and b, one job each on 16 GPUs, a's spec asking weight ``w``; the GPUs each gets."""
    from slurm_elastic.daemon.caps import CappedPolicy
    from slurm_elastic.policies import AllocationProblem, JobRequest
    from tests.unit.test_policies import MODEL, spec

    def req(jid, s, user):
        return JobRequest(jid, s, MODEL, running, 64 * running if running else None, restart_s=30.0,
                          held_s=3600.0 if running else None, remaining_samples=1e9, user=user, age_s=3600.0)

    capped = CappedPolicy(get_policy("dp"), user_of={1: "a", 2: "b"}, weight_grants=grants,
                          account_of={1: account, 2: ""})
    plan = capped.allocate(AllocationProblem(16, 16, (req(1, spec(max_gpus=16, weight=w), "a"),
                                                      req(2, spec(max_gpus=16), "b")), horizon_s=3600.0))
    return {j: x.gpus for j, x in plan.jobs.items()}, capped.weight_notes


@pytest.mark.parametrize("running", [0, 8])
def test_a_spec_weight_buys_no_gpus_from_another_user_beyond_the_site_s_grant(running):
    # Before: any user could write weight=10 (the site's max_weight) and outrank every other user's job
    # tenfold: measured {1: 11, 2: 5} against the honest twin's {1: 8, 2: 8} pending ({1: 5, 2: 11} running).
    honest, notes = _weighted(1.0, running=running)
    assert notes == {} and honest[1] <= 8
    for w in (2.0, 10.0):
        got, notes = _weighted(w, running=running)
        assert got == honest, (w, got)
        assert notes == {1: f"weight {w:g} counts as 1 (the site's grant to a)"}
    # An admin's grant to the user (or to every user, "*") is what lets a weight count for more
    for grants in ({"a": 10.0}, {"*": 10.0}):
        got, notes = _weighted(10.0, grants, running=running)
        assert got[1] > honest[1] and notes == {}, got
    assert _weighted(10.0, {"b": 10.0}, running=running)[0] == honest  # a grant to b is not a's
    # a grant to the job's Slurm account; the user's own grant first, then the account's, then "*"
    got, notes = _weighted(10.0, {"account:lab": 10.0}, running=running, account="lab")
    assert got[1] > honest[1] and notes == {}, got
    got, notes = _weighted(10.0, {"account:lab": 2.0, "*": 10.0}, running=running, account="lab")
    assert notes == {1: "weight 10 counts as 2 (the site's grant to account lab)"}
    got, notes = _weighted(10.0, {"account:lab": 10.0, "a": 1.0}, running=running, account="lab")
    assert got == honest and notes == {1: "weight 10 counts as 1 (the site's grant to a)"}
    assert _weighted(10.0, {"account:lab": 10.0}, running=running, account="other")[0] == honest
    # Lowering is the user's own choice: job a yields to b
    low, notes = _weighted(0.1, running=running)
    assert low[1] <= honest[1] and low[1] < 8 and notes == {}, low
