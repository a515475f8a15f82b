"""Issue 24, live: nothing a user writes sets the cost of a cycle. One unprivileged user submits two valid
specs at the widest ranges the plugin accepts (GPUs 1..2^20, batches 1..2^24 samples, 2^24 per GPU,
4096 accumulation steps) under max_gpus_per_user = 3; another user submits an ordinary job. Before the
fix the cap's cut listed every batch of the range (2^40 of them then): the cycle never ended and no
elastic job of anyone was placed. Uses only the cluster object's API (sbatch as a user, backend, bin,
env, script), so it runs on any Slurm version the fixture brings up.
"""

from __future__ import annotations

import threading
import time

import pytest
from faultlib import jobs_by_id, scancel, unix_users, wait_for

from slurm_elastic.daemon.config import config_from_dict
from slurm_elastic.daemon.loop import Daemon
from slurm_elastic.spec import MAX_ACCUM_LIMIT, MAX_BATCH_LIMIT, MAX_GPUS_LIMIT
from tests.chroot_paths import chroot_users

pytestmark = [pytest.mark.slurm]
USERS = ("h24_eve", "h24_ann")
WIDEST = (f"elastic:min_gpus=1,max_gpus={MAX_GPUS_LIMIT},min_batch=1,max_batch={MAX_BATCH_LIMIT},"
          f"max_local_batch={MAX_BATCH_LIMIT},max_accum={MAX_ACCUM_LIMIT}")
ORDINARY = "elastic:min_gpus=1,max_gpus=2,min_batch=32,max_batch=1024,max_local_batch=128,batch=64"
CYCLE_BOUND_S = 60.0  # a correctness guard (the old cycle never ended), not a speed figure


@pytest.fixture
def users(lua_cluster):
    with unix_users(USERS), chroot_users(lua_cluster, USERS):
        yield USERS


def submit(c, user, spec):
    return c.sbatch([f"--comment={spec}", "--requeue", "--gres=gpu:1", "-o", "/dev/null", "--partition=gpu",
                     str(c.script)], cwd=c.script.parent, user=user)


def test_widest_ranges_do_not_stall_the_cycle(lua_cluster, users, tmp_path, reliability):
    reliability("bad input", "two valid specs at the widest ranges the plugin accepts from one user, cap 3 GPUs",
                f"eve: 2 jobs with {WIDEST}; ann: one ordinary job; max_gpus_per_user = 3, policy dp",
                f"every cycle returns within {CYCLE_BOUND_S:.0f} s; ann's job is placed; eve's jobs hold <= 3 GPUs")
    c, (eve, ann) = lua_cluster, users
    ids = [submit(c, eve, WIDEST), submit(c, eve, WIDEST), submit(c, ann, ORDINARY)]
    cfg = config_from_dict({"state_dir": str(tmp_path / "state"), "metrics_address": "", "cooldown_s": 3600,
                            "partitions": ["gpu"], "poll_interval_s": 2, "max_gpus_per_user": 3,
                            "slurm_bin": str(c.config.bin)})
    d = None
    try:
        times = []

        def cycles():  # the daemon (and its SQLite handle) lives on this thread
            nonlocal d
            d = Daemon(cfg, backend=c.backend)
            d.open()
            for _ in range(3):
                t = time.monotonic()
                assert d.cycle() is not None, "the cycle did not run"
                times.append(time.monotonic() - t)
                time.sleep(1)
            d.close()

        errors = []

        def guarded():
            try:
                cycles()
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)

        th = threading.Thread(target=guarded, daemon=True)
        th.start()
        th.join(3 * CYCLE_BOUND_S + 30)
        assert not th.is_alive(), f"the daemon's cycles did not finish (cycle times so far: {times})"
        if errors:
            raise errors[0]
        assert len(times) == 3 and max(times) < CYCLE_BOUND_S, times
        reliability.figure("slowest cycle, s", round(max(times), 2))
        recs = wait_for(lambda: (r := jobs_by_id(c, ids)) and r[ids[2]].is_running and r, 60,
                        f"ann's job {ids[2]} to run")
        eve_gpus = sum(recs[j].gpus_total for j in ids[:2] if recs[j].is_running)
        assert eve_gpus <= 3, {j: (recs[j].state, recs[j].gpus_total) for j in ids[:2]}
        assert any(recs[j].is_running for j in ids[:2]), "eve's jobs were capped, not starved"
        reliability.jobs(lost=0)
    finally:
        scancel(c, ids)
