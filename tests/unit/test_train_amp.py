"""AMP with the DataLoader path: ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`` in
an ordinary loop body, with gradient accumulation done by the library (one process, gloo).

Why it needs care: with accumulation, a ``scaler.step`` per micro-batch would unscale a partial
gradient and mix scaled and unscaled parts. The library makes ``scaler.step``/``update`` wait for the
step's last micro-batch, unscales once, clips, steps and updates; the scaler's state (scale, growth
tracker) is in the checkpoint. Checked: the weights after a stop and resume equal an uninterrupted
single-batch run without a scaler (fp32: scaling by powers of two is exact), and under
``torch.autocast("cpu", float16)`` the losses follow that fp32 run within fp16 tolerance.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from slurm_elastic.train import ElasticJob  # noqa: E402
from slurm_elastic.train.sampler import epoch_permutation  # noqa: E402

N, B, LOCAL = 256, 32, 8  # global batch 32 = 1 rank x 8 x 4 accumulation
ENV = {"MASTER_ADDR": "127.0.0.1", "SLURM_ELASTIC_BACKEND": "gloo"}


def data():
    g = torch.Generator().manual_seed(3)
    X = torch.randn(N, 12, generator=g)
    return X, (X @ torch.randn(12, 4, generator=g)).argmax(1)


def net():
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def reference(epochs=2):
    """Uninterrupted, one batch of 32 per step, mean loss, no scaler, no autocast."""
    X, Y = data()
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    losses = []
    for e in range(epochs):
        perm = epoch_permutation(N, 0, e)
        for s in range(0, N, B):
            idx = perm[s:s + B]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(m(X[idx]), Y[idx])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            opt.step()
            losses.append(float(loss.detach()))
    return m, losses


def elastic_run(ckpt, *, autocast: bool, stop_after: int | None, epochs=2):
    X, Y = data()
    job = ElasticJob(ckpt, default_batch=B, max_local_batch=LOCAL, env=ENV, verbose=False, clip_grad_norm=0.5,
                     noise_scale=False)
    job.setup()
    assert (job.assignment.local_batch, job.assignment.accum) == (LOCAL, 4)
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=3)
    ddp = job.prepare(m, opt, scaler=scaler)
    loader = job.loader(torch.utils.data.TensorDataset(X, Y))
    losses, micro = [], []
    stopped = False
    for _epoch in job.epochs(epochs):
        for x, y in loader:
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
                loss = torch.nn.functional.cross_entropy(ddp(x), y)
            scaler.scale(loss).backward()
            micro.append(float(loss.detach()) * len(x))
            scaler.step(opt)
            scaler.update()
            if len(micro) == 4:
                losses.append(sum(micro) / B)
                micro = []
            if stop_after is not None and job.optimizer_steps == stop_after:
                stopped = True
                break
        if stopped:
            break
    state = scaler.state_dict()
    if stopped:
        job.checkpoint()
        job._teardown()
    else:
        job.finish()
    return m, losses, state


def test_scaler_with_accumulation_matches_an_uninterrupted_run_and_survives_a_checkpoint(tmp_path):
    ref, ref_losses = reference()
    _, first, state1 = elastic_run(tmp_path / "ck", autocast=False, stop_after=5)
    assert state1["scale"] > 2.0 ** 10, state1  # it grew (every 3 finite steps): a state worth keeping
    m, second, _ = elastic_run(tmp_path / "ck", autocast=False, stop_after=None)
    ck = torch.load(tmp_path / "ck" / "checkpoint.pt", weights_only=True)
    assert ck["optimizer_steps"] == len(ref_losses) == len(first) + len(second)
    losses = first + second
    diff = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    wdiff = max(float((a - b).abs().max()) for a, b in zip(m.parameters(), ref.parameters(), strict=True))
    print(f"scaler + accum 4, stop/resume at step 5 vs uninterrupted batch-32 run: {len(losses)} steps, "
          f"max loss diff {diff:.2e}, max weight diff {wdiff:.2e}")
    assert diff < 1e-5 and wdiff < 1e-5


def test_scaler_state_is_restored_exactly(tmp_path):
    _, _, state1 = elastic_run(tmp_path / "ck", autocast=False, stop_after=4)
    job = ElasticJob(tmp_path / "ck", default_batch=B, max_local_batch=LOCAL, env=ENV, verbose=False,
                     noise_scale=False)
    job.setup()
    m = net()
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0, growth_interval=1000)
    job.prepare(m, opt, scaler=scaler)
    assert scaler.state_dict() == state1
    job._teardown()


def test_autocast_float16_with_scaler_and_accumulation_follows_the_fp32_run(tmp_path):
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            torch.nn.Linear(2, 2)(torch.ones(1, 2))
    except RuntimeError as e:  # pragma: no cover - depends on the torch build
        pytest.skip(f"CPU autocast float16 unsupported here: {e}")
    _, ref_losses = reference()
    _, losses, _ = elastic_run(tmp_path / "ck", autocast=True, stop_after=None)
    diff = max(abs(a - b) for a, b in zip(losses, ref_losses, strict=True))
    print(f"autocast fp16 + scaler + accum 4 vs fp32 batch-32 run: max loss diff {diff:.2e} over {len(losses)} steps")
    assert len(losses) == len(ref_losses) and diff < 2e-2
