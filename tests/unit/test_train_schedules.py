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


def run_starts(tmp_path, one_start, starts=STARTS):
    """Run ``starts`` (STARTS by default) through ``one_start(ckpt, batch, stop_after, log)``; log rows: (samples before, lr, idx, loss)."""
    log: list[tuple[int, float, list[int], float]] = []
    flag = global_stop_flag()
    for batch, stop_after in starts:
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


def check_curve(log, what, total=EPOCHS * N, starts=STARTS):
    ref_lrs = uninterrupted_lrs()
    seen = 0
    for s, lr, idx, _ in log:
        assert s == seen, (what, "a step replayed or skipped")
        assert lr == pytest.approx(0.1 * lam(s / BASE), rel=1e-9, abs=1e-12), (what, s, lr)
        if s in ref_lrs:
            assert lr == pytest.approx(ref_lrs[s], rel=1e-9, abs=1e-12), (what, s)
        seen += len(idx)
    assert seen == total, (what, seen, total)
    ref = reference([idx for _, _, idx, _ in log])
    got = [loss for *_, loss in log]
    diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(got, ref, strict=True))
    print(f"{what}: {len(log)} steps at batches {[b for b, _ in starts]}, lr on the batch-24 schedule in samples; "
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


# ------------------------------------------------------------------ Lightning


def _lightning_start(ckpt, batch, stop_after, log, counters, *, scheduler="lambda", kwargs=True, loader=True,
                     max_steps=None):
    import lightning as L
    from lightning.pytorch.callbacks import EarlyStopping

    from slurm_elastic.train.integrations.lightning import ElasticLightning

    elastic = ElasticLightning(ckpt, default_batch=batch, max_local_batch=12, env=ENV, verbose=False,
                               noise_scale=False)
    loop = elastic.loop

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net()
            self.rows, self.n_this = [], 0

        def on_train_batch_start(self, batch, batch_idx):
            if loop.micro == 0:
                self.rows = []
                self.s0, self.gs0 = elastic.job.samples_seen, self.trainer.global_step
                self.ep0 = (self.trainer.current_epoch, elastic.epoch)
                self.lr0 = self.trainer.optimizers[0].param_groups[0]["lr"]  # what LearningRateMonitor reads

        def training_step(self, batch, batch_idx):
            idx, x, y = batch
            loss = torch.nn.functional.cross_entropy(self.net(x), y)
            if loop.micro_batches(loop.plan)[loop.micro][1] > 0:
                self.rows.append((idx.tolist(), float(loss.detach()) * len(idx)))
            self.log("train_loss", loss)
            return loss

        def on_train_batch_end(self, outputs, batch, batch_idx):
            if loop.plan is None:  # the step ended
                ids = [i for r, _ in self.rows for i in r]
                log.append((self.s0, self.lr0, ids, sum(v for _, v in self.rows) / len(ids)))
                counters.append((self.gs0, self.trainer.global_step, *self.ep0))
                self.n_this += 1
                if stop_after is not None and self.n_this == stop_after:
                    elastic.job.flag.request()

        def configure_optimizers(self):
            opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            if scheduler == "lambda":
                return {"optimizer": opt, "lr_scheduler": {
                    "scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lam), "interval": "step"}}
            if scheduler == "plateau":
                return {"optimizer": opt, "lr_scheduler": {
                    "scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt), "monitor": "train_loss"}}
            return opt

    es = EarlyStopping(monitor="train_loss", patience=1000, check_on_train_epoch_end=True)
    tk = elastic.trainer_kwargs() if kwargs else {"accelerator": "cpu", "devices": 1}
    if kwargs:
        tk["callbacks"] = [*tk["callbacks"], es]
    length = {"max_epochs": EPOCHS} if max_steps is None else {"max_steps": max_steps}
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False, **length, **tk)
    dl = elastic.dataloader(DS()) if loader else torch.utils.data.DataLoader(DS(), batch_size=12)
    trainer.fit(Net(), train_dataloaders=dl)
    counters.append(("es", es.wait_count, float(es.best_score)))
    counters.append(("total", elastic.job.total_samples, elastic.job.samples_seen))


def test_lightning_step_scheduler_is_counted_in_samples_and_counters_continue(tmp_path):
    pytest.importorskip("lightning")
    counters: list = []
    log = run_starts(tmp_path, lambda c, b, s, lg: _lightning_start(c, b, s, lg, counters))
    check_curve(log, "Lightning")
    steps = [c for c in counters if c[0] not in ("es", "total")]
    assert [c[0] for c in steps] == list(range(len(steps))), steps  # global_step continues over starts
    assert all(c[1] == c[0] + 1 for c in steps)
    assert all(c[2] == c[3] for c in steps), steps  # current_epoch is the data epoch
    es = [c for c in counters if c[0] == "es"]
    assert len(es) == 1 and math.isfinite(es[0][2])  # EarlyStopping ran to the end with its restored state
    assert [c for c in counters if c[0] == "total"] == [("total", EPOCHS * N, EPOCHS * N)]  # reported, reached


def test_lightning_mistakes_fail_at_start(tmp_path):
    pytest.importorskip("lightning")
    flag = global_stop_flag()
    cases = {
        "plateau": ({"scheduler": "plateau"}, "cannot be counted in samples"),
        "no trainer kwargs": ({"kwargs": False}, "elastic.trainer_kwargs()"),
        "plain DataLoader": ({"loader": False}, "not slurm-elastic's"),
    }
    for i, (what, (kw, msg)) in enumerate(cases.items()):
        with pytest.raises((RuntimeError, ValueError)) as e:
            _lightning_start(tmp_path / f"ck{i}", 24, None, [], [], **kw)
        flag.uninstall()
        flag.clear()
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
        assert msg in str(e.value), (what, str(e.value))


# max_steps=7 at the submitted batch 24 is 168 samples (1.75 epochs). Resumed at batch 12 and then 48, the
# last batch-48 step is cut to the 24 samples left; an uninterrupted batch-24 run takes 7 steps to 168.
MAX_STEPS = 7
MS_STARTS = [(24, 2), (12, 3), (48, None)]


def _read_total(ckpt):
    from slurm_elastic.train import protocol

    p = protocol.throughput_path(ckpt)
    import json

    return json.loads(p.read_text()).get("total_samples") if p.is_file() else None


def test_lightning_max_steps_is_counted_in_samples_through_a_batch_change(tmp_path):
    pytest.importorskip("lightning")
    runs = {}
    for name, starts in (("uninterrupted", [(24, None)]), ("resumed", MS_STARTS)):
        counters: list = []
        log = run_starts(tmp_path / name, lambda c, b, s, lg, cs=counters: _lightning_start(
            c, b, s, lg, cs, max_steps=MAX_STEPS), starts=starts)
        check_curve(log, f"Lightning max_steps {name}", total=MAX_STEPS * BASE, starts=starts)
        totals = [c for c in counters if c[0] == "total"]
        assert totals == [("total", MAX_STEPS * BASE, MAX_STEPS * BASE)], totals  # reported, and reached
        # the progress report the daemon reads (a start of a few warm-up steps may not have written one)
        assert _read_total(tmp_path / name / "ck") in ((MAX_STEPS * BASE,) if name == "uninterrupted"
                                                       else (None, MAX_STEPS * BASE))
        runs[name] = log
    assert len(runs["uninterrupted"]) == MAX_STEPS
    assert [len(idx) for _, _, idx, _ in runs["resumed"]] == [24, 24, 12, 12, 12, 12, 48, 24], runs["resumed"]


# ------------------------------------------------------------------ Hugging Face Trainer


def _hf_start(ckpt, batch, stop_after, log, states, max_steps=None):
    from transformers import TrainerCallback, TrainingArguments

    from slurm_elastic.train.integrations.hf import ElasticTrainer, elastic_setup

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net()

        def forward(self, x, labels, idx=None):
            logits = self.net(x)
            return {"loss": torch.nn.functional.cross_entropy(logits, labels), "logits": logits}

    class HFDS(torch.utils.data.Dataset):
        def __init__(self):
            self.X, self.Y = data()

        def __len__(self):
            return N

        def __getitem__(self, i):
            return {"x": self.X[i], "labels": self.Y[i], "idx": i}

    job = elastic_setup(ckpt, default_batch=batch, max_local_batch=12, env=ENV, verbose=False, noise_scale=False)

    class T(ElasticTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            idx = inputs.pop("idx")
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            lp = self.elastic_loop
            if lp.micro == 0:
                self._rows = []
                self._s0 = lp.job.samples_seen
            if lp.micro_batches(lp.plan)[lp.micro][1] > 0:
                self._rows.append((idx.tolist(), float(loss.detach()) * lp.plan.count / len(idx) * len(idx)
                                   / lp.job.world_size / lp.accum))
            return loss

    class Rec(TrainerCallback):
        n_this = 0

        def on_step_end(self, args, state, control, **kw):
            rows = trainer._rows
            ids = [i for r, _ in rows for i in r]
            log.append((trainer._s0, None, ids, None))
            self.n_this += 1
            if stop_after is not None and self.n_this == stop_after:
                job.flag.request()

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "learning_rate" in logs:
                states.append((state.global_step, logs["learning_rate"], logs["loss"], state.epoch))

    args = TrainingArguments(output_dir=str(ckpt.parent / "hf"), num_train_epochs=EPOCHS, learning_rate=0.1,
                             lr_scheduler_type="linear", warmup_steps=2, optim="sgd", weight_decay=0.0,
                             max_grad_norm=0.0, report_to=[], save_strategy="no", logging_steps=1,
                             disable_tqdm=True, use_cpu=True, seed=3, remove_unused_columns=False,
                             max_steps=-1 if max_steps is None else max_steps)
    trainer = T(job=job, model=Model(), args=args, train_dataset=HFDS(), callbacks=[Rec()])
    trainer.train()
    states.append(("total", job.total_samples, job.samples_seen))


def test_hf_schedule_is_counted_in_samples_and_trainer_state_continues(tmp_path):
    pytest.importorskip("transformers")
    from transformers import get_scheduler

    states: list = []
    log = run_starts(tmp_path, lambda c, b, s, lg: _hf_start(c, b, s, lg, states))
    assert states.pop() == ("total", EPOCHS * N, EPOCHS * N)
    dummy = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    ref = get_scheduler("linear", optimizer=dummy, num_warmup_steps=2, num_training_steps=TOTAL_STEPS)
    fn = ref.lr_lambdas[0]
    seen = 0
    assert [st[0] for st in states] == list(range(1, len(log) + 1)), states  # global_step continues
    for (s0, _, ids, _), (_, lr, _, epoch) in zip(log, states, strict=True):
        assert s0 == seen
        assert lr == pytest.approx(0.1 * fn(s0 / BASE), rel=1e-9, abs=1e-12), (s0, lr)  # the logged lr = applied
        seen += len(ids)
        assert epoch == pytest.approx(seen / N)  # the data epoch over all starts
    assert seen == EPOCHS * N
    print(f"HF: {len(log)} steps at batches {[b for b, _ in STARTS]}; logged lr = linear warm-up/decay "
          f"schedule of batch 24 at samples/24; global_step 1..{states[-1][0]}, epoch {states[-1][3]}")


def test_hf_max_steps_is_counted_in_samples_through_a_batch_change(tmp_path):
    pytest.importorskip("transformers")
    from transformers import get_scheduler

    dummy = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    fn = get_scheduler("linear", optimizer=dummy, num_warmup_steps=2, num_training_steps=MAX_STEPS).lr_lambdas[0]
    sizes = {}
    for name, starts in (("uninterrupted", [(24, None)]), ("resumed", MS_STARTS)):
        states: list = []
        log = run_starts(tmp_path / name, lambda c, b, s, lg, st=states: _hf_start(c, b, s, lg, st, MAX_STEPS),
                         starts=starts)
        assert states.pop() == ("total", MAX_STEPS * BASE, MAX_STEPS * BASE), name  # reported, and reached
        # the progress report the daemon reads (a start of a few warm-up steps may not have written one)
        assert _read_total(tmp_path / name / "ck") in ((MAX_STEPS * BASE,) if name == "uninterrupted"
                                                       else (None, MAX_STEPS * BASE))
        assert [st[0] for st in states] == list(range(1, len(log) + 1)), states  # global_step continues
        seen = 0
        for (s0, _, ids, _), (_, lr, _, _) in zip(log, states, strict=True):
            assert s0 == seen
            assert lr == pytest.approx(0.1 * fn(s0 / BASE), rel=1e-9, abs=1e-12), (name, s0, lr)
            seen += len(ids)
        assert seen == MAX_STEPS * BASE, (name, seen)
        sizes[name] = [len(ids) for _, _, ids, _ in log]
    assert sizes == {"uninterrupted": [24] * MAX_STEPS, "resumed": [24, 24, 12, 12, 12, 12, 48, 24]}, sizes


def test_resume_must_refuses_a_missing_directory_or_checkpoint(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ElasticJob(tmp_path / "typo", resume="must", env=ENV, verbose=False)
    (tmp_path / "empty").mkdir()
    job = ElasticJob(tmp_path / "empty", resume="must", default_batch=8, env=ENV, verbose=False, noise_scale=False)
    job.setup()
    m = net()
    try:
        with pytest.raises(FileNotFoundError, match="no checkpoint"):
            job.prepare(m, torch.optim.SGD(m.parameters(), lr=0.1))
    finally:
        job._teardown()
        global_stop_flag().uninstall()


def test_unconvertible_or_unregistered_schedulers_fail_before_training_goes_wrong(tmp_path):
    m = net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    job = ElasticJob(tmp_path / "a", default_batch=24, env=ENV, verbose=False, noise_scale=False)
    with pytest.raises(ScheduleError, match="lr_schedule=lambda samples"):
        job.register(model=m, optimizer=opt, scheduler=torch.optim.lr_scheduler.OneCycleLR(opt, 0.1, total_steps=9))
    global_stop_flag().uninstall()
    # A scheduler the library does not know about, stepped per optimizer step: refused at the next step.
    job = ElasticJob(tmp_path / "b", default_batch=24, env=ENV, verbose=False, noise_scale=False)
    job.setup()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    ddp = job.prepare(m, opt)
    X, Y = data()
    try:
        with pytest.raises(RuntimeError, match="changed outside slurm-elastic"):
            for step in job.steps(N, 1):
                for mb in step.micro_batches():
                    torch.nn.functional.cross_entropy(ddp(X[mb.indices]), Y[mb.indices]).backward()
                step.optimizer_step()
                sched.step()
    finally:
        job._teardown()
        global_stop_flag().uninstall()


@pytest.mark.parametrize("make", [
    lambda o: torch.optim.lr_scheduler.StepLR(o, 3, gamma=0.5),
    lambda o: torch.optim.lr_scheduler.MultiStepLR(o, [2, 5], gamma=0.3),
    lambda o: torch.optim.lr_scheduler.ConstantLR(o, factor=0.5, total_iters=4),
    lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.1, total_iters=5),
    lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.9),
    lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=8, eta_min=0.01),
    lambda o: torch.optim.lr_scheduler.PolynomialLR(o, total_iters=8, power=2.0),
    lambda o: torch.optim.lr_scheduler.LambdaLR(o, [lambda s: 0.9 ** s, lambda s: 1 / (1 + s)]),
])
def test_converted_schedulers_give_torchs_lr_at_every_step_for_every_param_group(make):
    from slurm_elastic.train.schedule import SampleSchedule

    def opt():
        return torch.optim.SGD([{"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.2},
                                {"params": [torch.nn.Parameter(torch.zeros(1))], "lr": 0.05}], lr=0.1)

    ref_opt = opt()
    ref = make(ref_opt)
    conv = SampleSchedule(make(opt()))
    for k in range(10):
        want = [g["lr"] for g in ref_opt.param_groups]
        got = [b * f for b, f in zip(conv.base_lrs, conv.factors(float(k)), strict=True)]
        assert got == pytest.approx(want, rel=1e-12), (k, got, want)
        ref_opt.step()
        ref.step()


def test_hf_plain_trainer_after_elastic_setup_fails_at_the_first_step(tmp_path):
    pytest.importorskip("transformers")
    import torch.distributed as dist
    from transformers import Trainer, TrainingArguments

    from slurm_elastic.train.integrations.hf import elastic_setup

    X, Y = data()
    ds = [{"x": X[i], "labels": Y[i]} for i in range(N)]

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net()

        def forward(self, x, labels):
            return {"loss": torch.nn.functional.cross_entropy(self.net(x), labels)}

    job = elastic_setup(tmp_path / "ck", default_batch=24, env=ENV, verbose=False, noise_scale=False)
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), num_train_epochs=1, report_to=[], save_strategy="no",
                             disable_tqdm=True, use_cpu=True, remove_unused_columns=False)
    try:
        with pytest.raises(RuntimeError, match="ElasticTrainer"):
            Trainer(model=Model(), args=args, train_dataset=ds).train()
    finally:
        global_stop_flag().uninstall()
        if dist.is_initialized():
            dist.destroy_process_group()
        job._teardown()
