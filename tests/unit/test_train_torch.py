"""In-process checks of the torch parts: the global-offset sampler and atomic checkpoints."""

from __future__ import annotations

import os
import random
from collections import Counter

import pytest

torch = pytest.importorskip("torch")

from slurm_elastic.train.checkpoint import (  # noqa: E402
    CheckpointError,
    check_weights_only_safe,
    load_checkpoint,
    save_checkpoint,
)
from slurm_elastic.train.dist import derived_port, master_address  # noqa: E402
from slurm_elastic.train.sampler import epoch_permutation, plan_step, rank_slice  # noqa: E402

pytestmark = pytest.mark.torch


def test_permutation_depends_on_seed_and_epoch_only():
    a = epoch_permutation(100, 3, 0)
    assert torch.equal(a, epoch_permutation(100, 3, 0))
    assert sorted(a.tolist()) == list(range(100))
    assert not torch.equal(a, epoch_permutation(100, 3, 1)) and not torch.equal(a, epoch_permutation(100, 4, 0))


@pytest.mark.parametrize("seed", range(20))
def test_random_resizes_cover_each_epoch_exactly_once(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 300)
    epoch, offset = 0, 0
    seen = Counter()
    while epoch < 2:
        world, accum = rng.randint(1, 7), rng.randint(1, 3)
        local = rng.randint(1, 9)
        batch = world * local * accum
        perm = epoch_permutation(n, seed, epoch)
        for _ in range(rng.randint(1, 6)):  # a start runs a few steps, then the job is resized
            if offset >= n:
                break
            plans = [plan_step(perm, epoch, offset, batch, r, world, local, accum) for r in range(world)]
            count = plans[0].count
            assert count == min(batch, n - offset)
            for p in plans:
                assert sum(len(mb) for mb in p.micro_batches) == p.rank_indices.numel()
                assert all(mb.indices.numel() <= local for mb in p.micro_batches)
                assert all(mb.scale == (0.0 if mb.dummy else world / count) for mb in p.micro_batches)
                assert len(p.micro_batches) >= 1  # every rank takes part in the all-reduce
                seen.update((epoch, int(i)) for i in p.rank_indices)
            offset += count
        if offset >= n:
            epoch, offset = epoch + 1, 0
    assert sorted(seen) == [(e, i) for e in range(2) for i in range(n)]
    assert set(seen.values()) == {1}


def test_tail_smaller_than_world_gives_weight_zero_placeholders():
    perm = epoch_permutation(10, 0, 0)
    plans = [plan_step(perm, 0, 8, 8, r, 4, 2, 1) for r in range(4)]  # 2 samples left for 4 ranks
    assert [p.rank_indices.numel() for p in plans] == [1, 1, 0, 0]
    assert [p.micro_batches[0].dummy for p in plans] == [False, False, True, True]
    assert plans[2].micro_batches[0].scale == 0.0 and plans[0].micro_batches[0].scale == 2.0
    assert rank_slice(10, 3, 4) == (8, 10) and rank_slice(10, 0, 4) == (0, 3)


def _state(step: int) -> dict:
    return {"format": 1, "step": step, "w": torch.full((3,), float(step)), "meta": {"history": [(1, 2.5)]}}


def test_atomic_save_keeps_previous_and_loads_weights_only(tmp_path):
    save_checkpoint(tmp_path, _state(1))
    save_checkpoint(tmp_path, _state(2))
    state, path = load_checkpoint(tmp_path)
    assert path.name == "checkpoint.pt" and state["step"] == 2
    prev = torch.load(tmp_path / "checkpoint.prev.pt", weights_only=True)
    assert prev["step"] == 1 and prev["meta"]["history"] == [(1, 2.5)]
    # A truncated current checkpoint (e.g. copied half-way) falls back to the previous one.
    data = (tmp_path / "checkpoint.pt").read_bytes()
    (tmp_path / "checkpoint.pt").write_bytes(data[: len(data) // 2])
    state, path = load_checkpoint(tmp_path)
    assert path.name == "checkpoint.prev.pt" and state["step"] == 1
    (tmp_path / "checkpoint.prev.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="no readable checkpoint"):
        load_checkpoint(tmp_path)
    assert load_checkpoint(tmp_path / "empty") is None


def test_interrupted_save_leaves_the_old_checkpoint(tmp_path):
    save_checkpoint(tmp_path, _state(1))

    def boom(nbytes):
        if nbytes > 0:
            raise KeyboardInterrupt  # stands in for any interruption during the write

    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, _state(2), on_progress=boom)
    assert load_checkpoint(tmp_path)[0]["step"] == 1
    assert sorted(os.listdir(tmp_path)) == ["checkpoint.pt"]


def test_unsafe_state_is_refused_at_save_time(tmp_path):
    np = pytest.importorskip("numpy")
    with pytest.raises(CheckpointError, match="numpy"):
        check_weights_only_safe({"a": {"b": np.zeros(2)}})
    with pytest.raises(CheckpointError):
        save_checkpoint(tmp_path, {"format": 1, "rng": np.random.get_state()})
    assert not (tmp_path / "checkpoint.pt").exists()


def test_master_address_and_derived_port():
    from slurm_elastic.train.slurm_env import SlurmEnv

    senv = SlurmEnv.from_environ({"SLURM_JOB_ID": "9", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "localhost,nodeX",
                                  "SLURMD_NODENAME": "no-such-host.invalid"})
    assert master_address(senv, {}) == "localhost"  # the first node
    assert master_address(senv, {}, own_node=True) == "localhost"  # own name does not resolve: fall back
    assert master_address(senv, {"MASTER_ADDR": "10.1.2.3"}) == "10.1.2.3"
    unresolvable = SlurmEnv.from_environ({"SLURM_JOB_NODELIST": "no-such-host[1-2].invalid"})
    import socket

    assert master_address(unresolvable, {}) in (socket.gethostname(), "127.0.0.1")
    ports = {derived_port("9", r, "0") for r in range(50)}
    assert all(20000 <= p < 60000 for p in ports) and len(ports) > 40  # restarts get other ports
    assert derived_port("9", 1, "0") == derived_port("9", 1, "0")


def test_leaving_the_group_lets_other_threads_take_the_gil_before_the_task_may_exit(tmp_path, monkeypatch):
    """A gloo worker that frees its last collective needs the GIL: leave_process_group must release it
    (a sleep) after destroying the group, or the exiting task can abort in finalization (exit 134)."""
    import datetime
    import threading

    import torch.distributed as dist

    import slurm_elastic.train.dist as tdist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1, timeout=datetime.timedelta(seconds=30))
    dist.barrier()
    ran_during = []
    waiting, returned = threading.Event(), threading.Event()

    def other():  # stands in for the gloo worker: it runs once the exiting thread lets go of the GIL
        waiting.wait()
        ran_during.append((dist.is_initialized(), returned.is_set()))

    t = threading.Thread(target=other)
    t.start()
    sleeps = []
    real_sleep = tdist.time.sleep

    def sleep(s):
        sleeps.append((s, dist.is_initialized()))
        waiting.set()
        real_sleep(s)

    monkeypatch.setattr(tdist.time, "sleep", sleep)
    try:
        tdist.leave_process_group()
        left = not dist.is_initialized()
    finally:
        returned.set()
        waiting.set()
        monkeypatch.undo()
        t.join(timeout=10)
        if dist.is_initialized():
            dist.destroy_process_group()
    assert left
    assert sleeps == [(tdist.LEAVE_SETTLE_S, False)] and tdist.LEAVE_SETTLE_S > 0  # the pause, after the destroy
    assert ran_during == [(False, False)]  # the other thread ran after the destroy, before the return
