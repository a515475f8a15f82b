"""Step-based lr schedulers survive batch changes on every path (plain PyTorch, Lightning, HF Trainer), and
mistakes fail at start (one process, gloo, real torch/lightning/transformers, no Slurm).

Each test resumes one checkpoint through starts at global batch 24 -> 12 -> 48 -> 24 (the stop taken
through the library's stop flag, exactly as a daemon's USR2 would be) with a user's scheduler written
for steps at the submitted batch 24. Checked: the lr applied at every step equals the scheduler's value
at step ``samples_seen / 24`` (so at every multiple of 24 samples it is the lr an uninterrupted batch-24
run applies there, and the schedule ends where that run's does); every step's loss and the final loss
equal a plain loop over the same global batches with that lr; counters continue across starts.
"""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from slurm_elastic.train import ElasticJob  # noqa: E402
from slurm_elastic.train.schedule import ScheduleError  # noqa: E402
from slurm_elastic.train.signals import global_stop_flag  # noqa: E402

N, EPOCHS, BASE = 96, 2, 24
STARTS = [(24, 2), (12, 3), (48, 2), (24, None)]  # (global batch, steps before the stop; None: to the end)
ENV = {"MASTER_ADDR": "127.0.0.1", "SLURM_ELASTIC_BACKEND": "gloo"}
TOTAL_STEPS = EPOCHS * N // BASE  # what the user wrote the schedule for


def lam(step):
    return max(0.0, 1.0 - step / TOTAL_STEPS) * (0.5 if step >= 3 else 1.0)


def data():
    g = torch.Generator().manual_seed(11)
    X = torch.randn(N, 6, generator=g)
    return X, (X @ torch.randn(6, 3, generator=g)).argmax(1)


class DS(torch.utils.data.Dataset):
    def __init__(self):
        self.X, self.Y = data()

    def __len__(self):
        return N

    def __getitem__(self, i):
        return i, self.X[i], self.Y[i]


def net():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def reference(steps):
    """A plain loop over the same global batches, lr = 0.1 x lam(samples before the step / 24)."""
    X, Y = data()
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    seen, losses = 0, []
    for idx in steps:
        opt.param_groups[0]["lr"] = 0.1 * lam(seen / BASE)
        loss = torch.nn.functional.cross_entropy(m(X[idx]), Y[idx])
        loss.backward()
        opt.step()
        opt.zero_grad()
        seen += len(idx)
        losses.append(float(loss))
    return losses


def uninterrupted_lrs():
    """What torch's LambdaLR gives an uninterrupted batch-24 run: samples before step k -> lr."""
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    s = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    out = {}
    for k in range(TOTAL_STEPS):
        out[k * BASE] = opt.param_groups[0]["lr"]
        opt.step()
        s.step()
    return out


def run_starts(tmp_path, one_start):
    """Run STARTS through ``one_start(ckpt, batch, stop_after, log)``; log rows: (samples before, lr, idx, loss)."""
    log: list[tuple[int, float, list[int], float]] = []
    flag = global_stop_flag()
    for batch, stop_after in STARTS:
        flag.clear()
        try:
            one_start(tmp_path / "ck", batch, stop_after, log)
            assert stop_after is None, "the start did not stop"
        except SystemExit as e:
            assert e.code == 75 and stop_after is not None
        finally:
            flag.uninstall()
            flag.clear()
    return log


def check_curve(log, what):
    ref_lrs = uninterrupted_lrs()
    seen = 0
    for s, lr, idx, _ in log:
        assert s == seen, (what, "a step replayed or skipped")
        assert lr == pytest.approx(0.1 * lam(s / BASE), rel=1e-9, abs=1e-12), (what, s, lr)
        if s in ref_lrs:
            assert lr == pytest.approx(ref_lrs[s], rel=1e-9, abs=1e-12), (what, s)
        seen += len(idx)
    assert seen == EPOCHS * N
    ref = reference([idx for _, _, idx, _ in log])
    got = [loss for *_, loss in log]
    diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, ref, strict=True))
    print(f"{what}: {len(log)} steps at batches {[b for b, _ in STARTS]}, lr on the batch-24 schedule in samples; "
          f"max relative step-loss diff vs plain loop {diff:.1e}, final loss {got[-1]:.6f} vs {ref[-1]:.6f}")
    assert diff < 1e-4, what


# ------------------------------------------------------------------ plain PyTorch


def test_plain_pytorch_step_scheduler_is_counted_in_samples(tmp_path):
    def one_start(ckpt, batch, stop_after, log):
        job = ElasticJob(ckpt, default_batch=batch, max_local_batch=12, env=ENV, verbose=False, noise_scale=False)
        job.setup()
        m = net()
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
        ddp = job.prepare(m, opt, scheduler=sched)
        assert job.lr.base_batch == BASE  # kept from the checkpoint whatever this start's batch
        loader = job.loader(DS())
        rows, n_this = [], 0
        for _ in job.epochs(EPOCHS):
            for idx, x, y in loader:
                before, s0 = job.optimizer_steps, job.samples_seen
                loss = torch.nn.functional.cross_entropy(ddp(x), y)
                loss.backward()
                rows.append((idx.tolist(), float(loss.detach()) * len(idx)))
                lr = opt.param_groups[0]["lr"]  # what a logger reads before the step
                opt.step()
                sched.step()  # the user's per-step call: the library counts the schedule in samples instead
                opt.zero_grad()
                if job.optimizer_steps != before:
                    ids = [i for r, _ in rows for i in r]
                    log.append((s0, lr, ids, sum(v for _, v in rows) / len(ids)))
                    rows, n_this = [], n_this + 1
                    if stop_after is not None and n_this == stop_after:
                        job.flag.request()
        job.finish()

    log = run_starts(tmp_path, one_start)
    check_curve(log, "plain PyTorch")
