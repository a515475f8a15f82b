"""The DataLoader path in real multi-process DDP (gloo, the stand-in srun of test_train_ddp): a plain
loop ``loss = F.cross_entropy(ddp(x), y)`` (mean), ``loss.backward()``, ``opt.step()``, with
``num_workers=2``, stopped by a real SIGUSR2 on one rank and resumed at other world sizes and batches.

Checks: every sample exactly once (map-style and iterable datasets), AdamW's step count and the
sample-based lr schedule continue across starts, and at a fixed global batch the result equals an
uninterrupted ``job.steps()`` run with ``reduction="sum" * mb.scale`` (the mean-loss gradient scale
and the library-side accumulation are right).
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from test_train_ddp import Harness, max_param_diff, reference  # noqa: E402,F401 - the fixture is reused

from slurm_elastic.spec import Decision  # noqa: E402
from slurm_elastic.train.protocol import EXIT_CHECKPOINTED  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

LOADER_WORKER = textwrap.dedent(
    '''
    import argparse, os, signal
    from slurm_elastic.train import install_stop_handler
    install_stop_handler()
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, Dataset, IterableDataset
    from slurm_elastic.train import ElasticJob

    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--mode", default="map")
    p.add_argument("--opt", default="sgd")
    p.add_argument("--signal-after", type=int, default=-1)
    p.add_argument("--signal-rank", type=int, default=0)
    p.add_argument("--batch", type=int, default=None)  # without Slurm (torchrun): the global batch
    p.add_argument("--max-local-batch", type=int, default=None)
    p.add_argument("--attempt", type=int, default=int(os.environ.get("SLURM_RESTART_COUNT", "0")))
    a = p.parse_args()
    restart = a.attempt
    sched = (lambda s: 1.0 / (1.0 + s / 500.0)) if a.opt == "adamw" else None
    job = ElasticJob(a.ckpt_dir, seed=7, timeout_s=90, throughput_warmup_steps=1, default_batch=a.batch,
                     max_local_batch=a.max_local_batch,
                     lr_scaling="sqrt" if a.opt == "adamw" else "none", base_batch=24, lr_schedule=sched)
    rank = job.rank
    job.setup()
    g = torch.Generator().manual_seed(1234)
    X = torch.randn(a.n, 8, generator=g)
    Y = (X @ torch.randn(8, 3, generator=g)).argmax(1)

    class MapDS(Dataset):
        def __len__(self): return a.n
        def __getitem__(self, i): return X[i], Y[i], i

    class Stream(IterableDataset):
        def __len__(self): return a.n
        def __iter__(self):
            for i in range(a.n): yield X[i], Y[i], i

    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    ddp = job.wrap(model)
    if a.opt == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    job.register(model=model, optimizer=opt)
    job.restore()
    if a.mode == "map":
        loader = DataLoader(MapDS(), batch_sampler=job.batch_sampler(a.n, a.epochs), num_workers=2)
    else:
        loader = DataLoader(job.iterable(Stream(), a.epochs), batch_size=None, num_workers=2)
    seen = open(os.path.join(a.out_dir, f"seen.s{restart}.r{rank}.txt"), "a")
    n_this, step_idx, before = 0, [], job.optimizer_steps
    for x, y, i in job.batches(loader):
        if n_this == a.signal_after and rank == a.signal_rank:
            os.kill(os.getpid(), signal.SIGUSR2)
        epoch = job.epoch
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        step_idx += [int(k) for k in i]
        if job.optimizer_steps != before:  # the step's last micro-batch: the real optimizer step ran
            before = job.optimizer_steps
            n_this += 1
            st = opt.state[model[0].weight].get("step")
            st = int(st) if st is not None else -1
            seen.write(f"{epoch} {job.optimizer_steps} {job.lr_factor!r} {st} {','.join(map(str, step_idx))}\\n")
            seen.flush()
            step_idx = []
    job.finish()
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(a.out_dir, "final.pt"))
        print(f"world {job.world_size} launcher {job.senv.launcher} finished", flush=True)
    '''
)


class LoaderHarness(Harness):
    def __init__(self, root: Path):
        super().__init__(root)
        self.worker.write_text(LOADER_WORKER)


def read_rows(out: Path, restart: int, world: int):
    ranks = []
    for r in range(world):
        rows = []
        for line in (out / f"seen.s{restart}.r{r}.txt").read_text().splitlines():
            e, s, lr, st, idx = (line.split(" ", 4) + [""])[:5]
            rows.append((int(e), int(s), float(lr), int(st), [int(i) for i in idx.split(",") if i]))
        ranks.append(rows)
    return ranks


@pytest.mark.parametrize("mode", ["map", "iter"])
def test_dataloader_workers_exactly_once_across_resizes_with_batch_changes(tmp_path, mode):
    h = LoaderHarness(tmp_path)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    n, job = 206, 31
    common = ("--ckpt-dir", str(ckpt), "--out-dir", str(out), "--n", str(n), "--mode", mode, "--opt", "adamw")
    plan = [  # (world, decision, steps before the self-signal, signalling rank)
        (1, None, 3, 0),  # the spec's batch 24, 1 rank
        (2, Decision(gpus=2, nodes=1, batch=48, local_batch=12, accum=2, seq=1), 2, 1),  # accumulation
        (3, Decision(gpus=3, nodes=1, batch=36, local_batch=12, accum=1, seq=2), -1, 0),  # to the end
    ]
    for restart, (world, decision, after, sig_rank) in enumerate(plan):
        h.set_record(job, decision=decision)
        rcs = h.run(job, world, restart, *common, "--signal-after", str(after), "--signal-rank", str(sig_rank))
        last = restart == len(plan) - 1
        assert rcs == [0 if last else EXIT_CHECKPOINTED] * world, h.log(job, restart)
        steps = [len(rows) for rows in read_rows(out, restart, world)]
        assert len(set(steps)) == 1, steps
        if after >= 0:
            assert steps[0] == after + 1
    per_epoch: dict[int, Counter] = {0: Counter(), 1: Counter()}
    prev_step, batches = 0, []
    for restart, (world, *_r) in enumerate(plan):
        for rows in zip(*read_rows(out, restart, world), strict=True):
            assert len({(r[0], r[1], r[2], r[3]) for r in rows}) == 1  # ranks agree on the step and lr
            e, s, lr, adam_step, _ = rows[0]
            assert s == prev_step + 1  # no step replayed or skipped
            # AdamW's own step counter went on from the checkpoint (the optimizer state was restored).
            assert adam_step == s
            batch = sum(len(r[4]) for r in rows)
            samples = sum(b for _w, b in batches) + batch  # samples seen after this step
            # lr factor = sqrt(B / 24) x the sample-based schedule, continued across starts.
            want = math.sqrt({1: 24, 2: 48, 3: 36}[world] / 24) / (1 + samples / 500)
            assert lr == pytest.approx(want, rel=1e-9), (restart, s)
            prev_step = s
            per_epoch[e].update(i for r in rows for i in r[4])
            batches.append((world, batch))
    for e, counts in per_epoch.items():
        assert sorted(counts) == list(range(n)) and max(counts.values()) == 1, f"epoch {e}"
    assert {b for w, b in batches if w == 2} >= {48} and {b for w, b in batches if w == 3} >= {36}
    print(f"{mode}: {len(batches)} steps over worlds 1 -> 2 -> 3, batches {sorted({b for _w, b in batches})}")


def test_dataloader_mean_loss_matches_uninterrupted_sum_loss_run(tmp_path, reference):  # noqa: F811
    """At the reference's global batch 48: 2 ranks -> 3 ranks x 8 x 2 accum -> 1 rank x 24 x 2 accum."""
    h = LoaderHarness(tmp_path)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    job = 32
    common = ("--ckpt-dir", str(ckpt), "--out-dir", str(out))
    starts = [
        (2, Decision(gpus=2, nodes=1, batch=48, local_batch=24, accum=1, seq=1), 1, 1),
        (3, Decision(gpus=3, nodes=1, batch=48, local_batch=8, accum=2, seq=2), 2, 0),
        (1, Decision(gpus=1, nodes=1, batch=48, local_batch=24, accum=2, seq=3), -1, 0),
    ]
    for restart, (world, decision, after, sig_rank) in enumerate(starts):
        h.set_record(job, decision=decision)
        rcs = h.run(job, world, restart, *common, "--signal-after", str(after), "--signal-rank", str(sig_rank))
        assert rcs == [EXIT_CHECKPOINTED if after >= 0 else 0] * world, h.log(job, restart)
    diff = max_param_diff(torch.load(out / "final.pt"), reference["final"])
    moved = max_param_diff(reference["final"], reference["init"])
    print(f"DataLoader mean loss 2 -> 3 -> 1 ranks vs uninterrupted job.steps(): {diff:.2e} (moved {moved:.2f})")
    assert moved > 0.05
    assert diff <= 1e-5


def _torchrun(h: LoaderHarness, nproc: int, start: int, *args: str, timeout: float = 240):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MASTER_", "TORCHELASTIC_")) and k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    torchrun = Path(sys.executable).with_name("torchrun")
    return subprocess.run([str(torchrun), "--standalone", f"--nproc-per-node={nproc}", str(h.worker),
                           f"--attempt={start}", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, check=False)


def test_torchrun_launch_resized_matches_uninterrupted_run(tmp_path, reference):  # noqa: F811
    """torchrun --nproc_per_node 2 -> 3 -> 1 at global batch 48, stopped by a USR2 on one worker each time:
    one world per start (not N copies of rank 0 of 1), exactly once, equal to the uninterrupted run."""
    h = LoaderHarness(tmp_path)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    common = ("--ckpt-dir", str(ckpt), "--out-dir", str(out), "--batch", "48", "--max-local-batch", "8")
    starts = [(2, 1, 1), (3, 2, 2), (1, -1, 0)]  # (processes, steps before the signal, signalling rank)
    for start, (nproc, after, sig_rank) in enumerate(starts):
        r = _torchrun(h, nproc, start, *common, "--signal-after", str(after), "--signal-rank", str(sig_rank))
        if after >= 0:
            # The workers exit 75 (checkpointed); torchrun reports that as a failed worker group.
            assert r.returncode != 0 and "exitcode  : 75" in r.stdout + r.stderr, r.stdout + r.stderr
            assert f"world size {nproc} on" in r.stdout, r.stdout + r.stderr
        else:
            assert r.returncode == 0, r.stdout + r.stderr
            assert "world 1 launcher torchrun finished" in r.stdout
        steps = {len(rows) for rows in read_rows(out, start, nproc)}
        assert len(steps) == 1
    per_epoch: dict[int, Counter] = {0: Counter(), 1: Counter()}
    for start, (nproc, *_r) in enumerate(starts):
        for rows in zip(*read_rows(out, start, nproc), strict=True):
            per_epoch[rows[0][0]].update(i for row in rows for i in row[4])
            assert sum(len(row[4]) for row in rows) in (48, 200 - 4 * 48)
    for e, counts in per_epoch.items():
        assert sorted(counts) == list(range(200)) and max(counts.values()) == 1, f"epoch {e}"
    diff = max_param_diff(torch.load(out / "final.pt"), reference["final"])
    print(f"torchrun 2 -> 3 -> 1 processes vs uninterrupted: {diff:.2e}")
    assert diff <= 1e-5


def test_two_rank0_processes_on_one_checkpoint_dir_fail_loudly(tmp_path):
    """What `torchrun --nproc_per_node 2` did before: two processes, each 'rank 0 of 1', one checkpoint dir."""
    h = LoaderHarness(tmp_path)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    args = [sys.executable, str(h.worker), "--ckpt-dir", str(ckpt), "--out-dir", str(out), "--batch", "24",
            "--epochs", "200", "--n", "2000"]
    first = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 120
        while not (out / "seen.s0.r0.txt").exists():
            assert time.time() < deadline and first.poll() is None, first.communicate()[0]
            time.sleep(0.2)
        second = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120, check=False)
    finally:
        first.send_signal(signal.SIGTERM)  # outside Slurm SIGTERM is a stop request: checkpoint, exit 75
        text = first.communicate(timeout=120)[0]
    assert second.returncode != 0
    assert "another process is already rank 0 for this checkpoint directory" in second.stderr, second.stderr
    assert first.returncode == EXIT_CHECKPOINTED, text
    assert "checkpointing after the current step" in text and "Run the same command again" in text


def test_the_documented_example_runs_under_torchrun(tmp_path):
    """examples/ddp_elastic.py (the "after" of the docs' diff) as a user runs it: torchrun with 2
    processes in a fresh directory (checkpoints in ./elastic-ckpt), all 5 epochs."""
    example = Path(__file__).resolve().parents[2] / "examples" / "ddp_elastic.py"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "MASTER_", "TORCHELASTIC_", "ELASTIC_")) and k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    torchrun = Path(sys.executable).with_name("torchrun")
    r = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node=2", str(example)], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    done = json.loads((tmp_path / "elastic-ckpt" / "done.local.json").read_text())
    assert (done["epochs_done"], done["samples_seen"], done["optimizer_steps"]) == (5, 5 * 4096, 5 * 4096 // 128)
    rep = json.loads((tmp_path / "elastic-ckpt" / "throughput.json").read_text())
    assert rep["noise_scale"] is not None and rep["noise_scale"] > 0  # measured on the DataLoader path
    # its progress, for the daemon's ranking by remaining work: 5 epochs x 4096 samples planned
    assert rep["total_samples"] == 5 * 4096 and 0 < rep["samples_seen"] <= 5 * 4096, rep
