"""Worker scripts for the framework-integration tests (Lightning, HF Trainer) and their harness.

Each worker trains a tiny model on synthetic data through the integration and logs, per rank and per
optimizer step: the data epoch, the step index, the real sample indices of the step (placeholders
left out), the lr factor in effect and the step's loss on this rank. The harness is the one of
test_train_ddp.py (a stand-in srun that forks one process per rank with SLURM_* variables and a
stand-in scontrol serving the job record), with the framework imported once before the fork.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

from test_train_ddp import LAUNCHER, Harness

# Shared by the workers (pasted into each): with --hold-after K, a start trains K steps and then waits,
# after the step (outside the library's step timing, so the throughput it reports stays true), for the
# daemon's stop request (at most 120 s), which is then taken at the next step boundary; every start of
# a daemon-driven test so trains a few steps whatever the daemon's reaction time. The file "fast" in
# the output directory lifts the wait (the test's last phase).
HOLD_FN = """
    def hold(job, n_this):
        import time
        if a.hold_after < 0 or n_this < a.hold_after:
            return
        deadline = time.monotonic() + 120
        while (time.monotonic() < deadline and not job.flag.is_set()
               and not os.path.exists(os.path.join(a.out_dir, "fast"))):
            time.sleep(0.2)
"""

LIGHTNING_WORKER = textwrap.dedent(
    '''
    import argparse, os, signal, sys
    from slurm_elastic.train import install_stop_handler
    install_stop_handler()
    import torch
    import torch.nn.functional as F
    import lightning as L
    from slurm_elastic.train.integrations.lightning import ElasticLightning

    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--signal-after", type=int, default=-1)
    p.add_argument("--signal-rank", type=int, default=0)
    p.add_argument("--lr-scaling", default="none")
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--hold-after", type=int, default=-1)
    p.add_argument("--step-schedule", type=int, default=0, help="a LambdaLR over this many steps (interval=step)")
    a = p.parse_args()
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    HOLD = HOLD_SRC

    class DS(torch.utils.data.Dataset):
        def __init__(self, n):
            g = torch.Generator().manual_seed(1234)
            self.X = torch.randn(n, 8, generator=g)
            self.Y = (self.X @ torch.randn(8, 3, generator=g)).argmax(1)
        def __len__(self):
            return len(self.X)
        def __getitem__(self, i):
            return i, self.X[i], self.Y[i]

    elastic = ElasticLightning(a.ckpt_dir, seed=7, lr_scaling=a.lr_scaling, timeout_s=90, throughput_warmup_steps=1,
                               default_batch=24, base_batch=24, report_every_s=0.0)
    loop = elastic.loop
    seen = open(os.path.join(a.out_dir, f"seen.s{restart}.r{rank}.txt"), "a")

    class Net(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(7)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
            self.rows = {}
            self.n_this = 0
        def training_step(self, batch, batch_idx):
            idx, x, y = batch
            k = loop.micro
            if k == 0:
                if self.n_this == a.signal_after and rank == a.signal_rank:
                    os.kill(os.getpid(), signal.SIGUSR2)  # one rank, in the middle of a step
                self.n_this += 1
                self.rows = {"idx": [], "loss": 0.0}
            loss = F.cross_entropy(self.net(x), y)  # an ordinary mean loss
            if loop.micro_batches(loop.plan)[k][1] > 0:
                self.rows["idx"] += [int(i) for i in idx]
                self.rows["loss"] += float(loss.detach()) * len(idx)
            if a.step_delay:
                import time; time.sleep(a.step_delay)
            return loss
        def on_train_batch_end(self, outputs, batch, batch_idx):
            if loop.plan is None:  # the step just ended (ElasticCallback ran first)
                job = elastic.job
                seen.write(f"{job.epoch if job.offset else job.epoch - 1} {job.optimizer_steps - 1} "
                           f"{','.join(map(str, self.rows['idx']))} {self.last_factor} {self.rows['loss']}\\n")
                seen.flush()
                if rank == 0:  # Lightning's counters, continued across starts
                    with open(os.path.join(a.out_dir, "plstate.txt"), "a") as f:
                        f.write(f"{self.trainer.global_step} {self.trainer.current_epoch}\\n")
                hold(job, self.n_this)
        def on_before_optimizer_step(self, optimizer):
            self.last_factor = elastic.job.lr_factor
        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=0.02, weight_decay=0.01)
            if not a.step_schedule:
                return opt
            total = a.step_schedule
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: max(0.1, 1.0 - step / total))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    model = Net()
    trainer = L.Trainer(max_epochs=a.epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        **elastic.trainer_kwargs())
    trainer.fit(model, train_dataloaders=elastic.dataloader(DS(a.n), num_workers=a.num_workers))
    if rank == 0:
        torch.save(model.net.state_dict(), os.path.join(a.out_dir, "final.pt"))
    '''
).replace("HOLD = HOLD_SRC\n", textwrap.dedent(HOLD_FN))

# The plain-PyTorch path of docs/ELASTIC-SCRIPT.md (ElasticJob.create / prepare / loader / epochs, an
# ordinary mean loss, a DataLoader with workers), the same network, data and optimizer as the Lightning
# worker plus gradient clipping by the library; run under srun (one task per GPU) or torchrun.
LOADER_WORKER = textwrap.dedent(
    '''
    import argparse, os
    from slurm_elastic.train import ElasticJob
    import torch
    import torch.nn.functional as F

    p = argparse.ArgumentParser()
    p.add_argument("--out-dir", required=True)
    p.add_argument("--n", type=int, default=144)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--hold-after", type=int, default=-1)
    a = p.parse_args()
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    HOLD = HOLD_SRC

    class DS(torch.utils.data.Dataset):
        def __init__(self, n):
            g = torch.Generator().manual_seed(1234)
            self.X = torch.randn(n, 8, generator=g)
            self.Y = (self.X @ torch.randn(8, 3, generator=g)).argmax(1)
        def __len__(self):
            return len(self.X)
        def __getitem__(self, i):
            return i, self.X[i], self.Y[i]

    job = ElasticJob.create(seed=7, lr_scaling="sqrt", base_batch=24, default_batch=24, clip_grad_norm=1.0, timeout_s=120,
                            throughput_warmup_steps=1, report_every_s=0.0)
    torch.manual_seed(7)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.01)
    ddp = job.prepare(model, opt)
    loader = job.loader(DS(a.n), num_workers=a.num_workers)
    seen = open(os.path.join(a.out_dir, f"seen.s{restart}.r{job.rank}.txt"), "a")
    print(f"worker rank {job.rank} of {job.world_size} via {job.senv.launcher}, {a.num_workers} loader workers",
          flush=True)
    n_this, idx_step, loss_step = 0, [], 0.0
    for epoch in job.epochs(a.epochs):
        for idx, x, y in loader:
            tag = job.micro_tag
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            if tag.samples:
                idx_step += idx.tolist()
                loss_step += float(loss.detach()) * len(idx)
            factor, before = job.lr_factor, job.optimizer_steps
            opt.step()
            if job.optimizer_steps != before:
                seen.write(f"{tag.epoch} {before} {','.join(map(str, idx_step))} {factor} {loss_step}\\n")
                seen.flush()
                n_this, idx_step, loss_step = n_this + 1, [], 0.0
                hold(job, n_this)
    job.finish()
    if job.rank == 0:
        torch.save(model.state_dict(), os.path.join(a.out_dir, "final.pt"))
    '''
).replace("HOLD = HOLD_SRC\n", textwrap.dedent(HOLD_FN))

HF_WORKER = textwrap.dedent(
    '''
    import argparse, os, signal, sys
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    from slurm_elastic.train import install_stop_handler
    install_stop_handler()
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments
    from slurm_elastic.train.integrations.hf import ElasticTrainer, elastic_setup

    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--n", type=int, default=96)
    p.add_argument("--base-batch", type=int, default=None)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--signal-after", type=int, default=-1)
    p.add_argument("--signal-rank", type=int, default=0)
    p.add_argument("--lr-scaling", default="none")
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--step-delay", type=float, default=0.0)
    p.add_argument("--hold-after", type=int, default=-1)
    p.add_argument("--lr-scheduler-type", default="constant")
    p.add_argument("--warmup-steps", type=int, default=0)
    a = p.parse_args()
    rank = int(os.environ.get("SLURM_PROCID", "0"))
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    HOLD = HOLD_SRC

    class DS(torch.utils.data.Dataset):
        def __init__(self, n):
            g = torch.Generator().manual_seed(1234)
            self.ids = torch.randint(0, 64, (n, 12), generator=g)
        def __len__(self):
            return len(self.ids)
        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i], "idx": torch.tensor(i)}

    job = elastic_setup(a.ckpt_dir, seed=7, lr_scaling=a.lr_scaling, timeout_s=90, throughput_warmup_steps=1,
                        default_batch=16, base_batch=a.base_batch, report_every_s=0.0)
    torch.manual_seed(7)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    seen = open(os.path.join(a.out_dir, f"seen.s{restart}.r{rank}.txt"), "a")

    class Record(TrainerCallback):
        n_this = 0
        def on_pre_optimizer_step(self, args, state, control, **kw):
            if self.n_this == a.signal_after and rank == a.signal_rank:
                os.kill(os.getpid(), signal.SIGUSR2)  # one rank, in the middle of a step
            self.n_this += 1
            self.factor = job.lr_factor
            if a.step_delay:
                import time; time.sleep(a.step_delay)

    rec = Record()

    class T(ElasticTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            idx = inputs.pop("idx")
            loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            w = self.elastic_loop.micro_batches(self.elastic_loop.plan)[self.elastic_loop.micro][1]
            if w > 0:  # HF's loss here is (token-loss sum / global tokens) x world: rescale to "mean x count"
                lp = self.elastic_loop
                self._rows.append((idx.tolist(), float(loss.detach()) * lp.plan.count / lp.job.world_size))
            return loss
        def training_step(self, model, inputs, num_items_in_batch=None):
            if self.elastic_loop.plan is None:  # the first micro-batch of a step
                self._rows = []
            return super().training_step(model, inputs, num_items_in_batch)

    class Log(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            j = trainer.elastic_loop.job
            idx = [i for rows, _ in trainer._rows for i in rows]
            loss = sum(l for _, l in trainer._rows)
            seen.write(f"{j.epoch if j.offset else j.epoch - 1} {j.optimizer_steps - 1} {','.join(map(str, idx))} "
                       f"{rec.factor} {loss}\\n")
            if rank == 0:  # the Trainer's counters, continued across starts
                with open(os.path.join(a.out_dir, "hfstate.txt"), "a") as f:
                    f.write(f"{state.global_step} {state.epoch}\\n")
            seen.flush()
            hold(j, rec.n_this)

    args = TrainingArguments(output_dir=os.path.join(a.out_dir, "hf"), num_train_epochs=a.epochs, learning_rate=0.01,
                             lr_scheduler_type=a.lr_scheduler_type, warmup_steps=a.warmup_steps, max_grad_norm=1.0, report_to=[], save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, use_cpu=True, seed=7,
                             remove_unused_columns=False, dataloader_num_workers=a.num_workers,
                             ddp_find_unused_parameters=False)
    trainer = T(job=job, model=model, args=args, train_dataset=DS(a.n), callbacks=[rec])
    trainer.add_callback(Log())
    trainer.train()
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(a.out_dir, "final.pt"))
    '''
).replace("HOLD = HOLD_SRC\n", textwrap.dedent(HOLD_FN))


class FrameworkHarness(Harness):
    """test_train_ddp's harness with another worker script and ``preimport`` loaded before the fork."""

    def __init__(self, root: Path, worker: str, preimport: str):
        super().__init__(root)
        self.worker.write_text(worker)
        self.launcher.write_text(LAUNCHER.replace("import slurm_elastic.train.job",
                                                  f"import slurm_elastic.train.job, {preimport}"))


def read_steps(out: Path, restart: int, world: int) -> list[list[tuple[int, int, list[int], float, float]]]:
    """Per rank: [(epoch, step, indices, lr factor, loss sum)] of one start."""
    ranks = []
    for r in range(world):
        rows = []
        for line in (out / f"seen.s{restart}.r{r}.txt").read_text().splitlines():
            e, s, idx, f, loss = line.split(" ")
            rows.append((int(e), int(s), [int(i) for i in idx.split(",") if i], float(f), float(loss)))
        ranks.append(rows)
    return ranks
