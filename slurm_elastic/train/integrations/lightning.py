"""PyTorch Lightning under the slurm-elastic daemon: a DDP strategy, a cluster environment and a callback.

Usage (see docs/INTEGRATIONS.md)::

    from slurm_elastic.train import install_stop_handler
    install_stop_handler()
    import lightning as L
    from slurm_elastic.train.integrations.lightning import ElasticLightning

    elastic = ElasticLightning(seed=0, lr_scaling="sqrt")          # process group + this start's batch
    trainer = L.Trainer(max_epochs=3, **elastic.trainer_kwargs())
    trainer.fit(model, train_dataloaders=elastic.dataloader(train_set, num_workers=2))

Why a strategy: Lightning's own SLURM environment derives the master port from the job id (collides on
shared hosts, see train/dist.py) and its DistributedSampler keeps per-rank positions that break when the
world size changes. :class:`ElasticDDPStrategy` reuses the process group :class:`ElasticJob` set up and
scales each micro-batch's loss in ``backward`` (exactly 1.0 unless an epoch's tail splits unevenly).
:class:`ElasticCallback` restores the checkpoint once Lightning has built the optimizer
(``on_fit_start``, before the DataLoader iterator exists), checks the stop request at every step
boundary (``on_train_batch_start`` of the first micro-batch), and advances the global sample offset
after every optimizer step. The Trainer's ``max_epochs`` is the number of data epochs; its ``max_steps``
is counted in samples (``max_steps x`` the submitted batch), like a step schedule. Lightning's own
counters (``global_step``, ``current_epoch``, the logger's step) and the callbacks' states
(EarlyStopping, ModelCheckpoint, ...) are in the library's checkpoint and continue on the next start;
the scheduler of ``configure_optimizers`` is counted in samples (see ..schedule). Lightning's own
checkpoints are not used for resuming.
"""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.environments import ClusterEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer import call

from ..job import ElasticJob
from .loop import ExternalLoop, FrameworkBatchSampler


class ElasticEnvironment(ClusterEnvironment):
    """Ranks from the Slurm environment as ElasticJob read them; one process per "node" for Lightning."""

    def __init__(self, job: ElasticJob):
        super().__init__()
        self.job = job

    @property
    def creates_processes_externally(self) -> bool:
        return True  # srun started every task

    @property
    def main_address(self) -> str:
        return self.job.ctx.master_addr

    @property
    def main_port(self) -> int:
        return int(self.job.ctx.master_port)

    @staticmethod
    def detect() -> bool:
        return True

    def world_size(self) -> int:
        return self.job.world_size

    def set_world_size(self, size: int) -> None:
        if size != self.job.world_size:
            raise RuntimeError(f"Lightning computed world size {size}, the job runs {self.job.world_size} tasks; "
                               "pass **elastic.trainer_kwargs() to the Trainer")

    def global_rank(self) -> int:
        return self.job.rank

    def set_global_rank(self, rank: int) -> None:
        if rank != self.job.rank:
            raise RuntimeError(f"Lightning computed rank {rank}, the task is rank {self.job.rank}")

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return self.job.rank


class ElasticDDPStrategy(DDPStrategy):
    """DDP on the process group ElasticJob created; per-micro-batch loss factor for exact global means."""

    def __init__(self, elastic: ElasticLightning, **kwargs):
        super().__init__(cluster_environment=ElasticEnvironment(elastic.job),
                         process_group_backend=elastic.job.ctx.backend, **kwargs)
        self.elastic = elastic

    @property
    def root_device(self) -> torch.device:
        return self.elastic.job.device

    def backward(self, closure_loss, optimizer, *args: Any, **kwargs: Any):
        loop = self.elastic.loop
        if loop.plan is None or not self.lightning_module.automatic_optimization:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        f = loop.loss_factor(loop.micro)
        if f != 1.0:
            closure_loss = closure_loss * f
        loop.noise_begin()
        out = super().backward(closure_loss, optimizer, *args, **kwargs)
        scaler = getattr(self.precision_plugin, "scaler", None)
        loop.noise_end(float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0)
        return out


class ElasticCallback(Callback):
    def __init__(self, elastic: ElasticLightning):
        self.elastic = elastic

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Not on_train_start: the fit loop creates the DataLoader iterator before that hook, and with
        # num_workers > 0 the iterator reads the batch sampler (the position) at once.
        if len(trainer.optimizers) != 1:
            raise RuntimeError("slurm-elastic supports one optimizer per LightningModule")
        if trainer.accumulate_grad_batches != self.elastic.loop.accum:
            raise RuntimeError(f"accumulate_grad_batches is {trainer.accumulate_grad_batches}, this start's "
                               f"assignment needs {self.elastic.loop.accum}: use **elastic.trainer_kwargs()")
        # max_steps counts optimizer steps, whose size the daemon changes: the library converts it to
        # samples (max_steps x the LR base batch) and stops the run there itself, so Lightning's own count
        # (global_step continues from the checkpoint) must not stop it early or late.
        max_steps = trainer.max_steps if trainer.max_steps is not None and trainer.max_steps >= 0 else None
        trainer.fit_loop.epoch_loop.max_steps = -1
        epochs = trainer.max_epochs if trainer.max_epochs is not None and trainer.max_epochs >= 0 else None
        if epochs is None and max_steps is None:
            raise ValueError("give the Trainer max_epochs (data epochs) or max_steps: the daemon ranks jobs by the "
                             "work left")
        job = self.elastic.job
        cfgs = trainer.lr_scheduler_configs
        if len(cfgs) > 1:
            raise ValueError("slurm-elastic counts one lr scheduler in samples; configure_optimizers returned "
                             f"{len(cfgs)}")
        sched = cfgs[0].scheduler if cfgs else None
        if cfgs:
            job.schedule_every = "epoch" if cfgs[0].interval == "epoch" else "step"
            job.schedule_frequency = max(1, int(cfgs[0].frequency or 1))
        self.elastic.loop.restore(model=pl_module, optimizer=trainer.optimizers[0], scheduler=sched,
                                  epochs=epochs, max_steps=max_steps, lightning=_LightningState(trainer))
        _continue_counters(trainer, job.optimizer_steps, job.epoch)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        loop = self.elastic.loop
        if loop.plan is None:
            loop.step_begin()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        loop = self.elastic.loop
        loop.micro += 1
        if loop.micro == loop.accum:
            loop.step_end()

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        if self.elastic.loop.finished:
            trainer.should_stop = True

    def on_train_end(self, trainer, pl_module) -> None:
        if self.elastic.loop.finished:
            self.elastic.loop.finish()


class _LightningState:
    """The callbacks' states (EarlyStopping, ModelCheckpoint, ... each keyed by its ``state_key``) in the
    library's checkpoint, as Lightning's own checkpoint would keep them."""

    def __init__(self, trainer: pl.Trainer):
        self.trainer = trainer

    def state_dict(self) -> dict:
        return {"callbacks": call._call_callbacks_state_dict(self.trainer)}

    def load_state_dict(self, state: dict) -> None:
        call._call_callbacks_load_state_dict(self.trainer, {"callbacks": state.get("callbacks") or {}})


def _continue_counters(trainer: pl.Trainer, steps: int, epoch: int) -> None:
    """``global_step``, the logger's step and ``current_epoch`` continue from the checkpoint, so loggers'
    x-axes and "every N steps" logic see one run (the data epoch is Lightning's epoch: each Lightning
    epoch is the rest of one data epoch)."""
    loop = trainer.fit_loop
    total = loop.epoch_loop.automatic_optimization.optim_progress.optimizer.step.total
    total.ready = total.completed = steps
    loop.epoch_loop.manual_optimization.optim_step_progress.total.ready = steps
    loop.epoch_loop.manual_optimization.optim_step_progress.total.completed = steps
    loop.epoch_loop._batches_that_stepped = steps
    for tracker in (loop.epoch_progress.total, loop.epoch_progress.current):
        for name in ("ready", "started", "processed", "completed"):
            if hasattr(tracker, name):
                setattr(tracker, name, epoch)


class ElasticLightning:
    """Sets up the job (process group, this start's batch) and hands Lightning what it needs."""

    def __init__(self, ckpt_dir: str | os.PathLike | None = None, **job_kwargs):
        self.job = ElasticJob(ckpt_dir, **job_kwargs)
        self.job.setup()
        self.loop = ExternalLoop(self.job, "pass **elastic.trainer_kwargs() to L.Trainer")

    @property
    def epoch(self) -> int:
        """The data epoch (Lightning's ``current_epoch`` too, continued across starts)."""
        return self.job.epoch

    def trainer_kwargs(self) -> dict:
        a = self.job.assignment
        return {
            "strategy": ElasticDDPStrategy(self),
            "accelerator": "gpu" if self.job.device.type == "cuda" else "cpu",
            "devices": 1,
            "num_nodes": self.job.world_size,
            "callbacks": [ElasticCallback(self)],
            "use_distributed_sampler": False,
            "accumulate_grad_batches": a.accum,
            "enable_checkpointing": False,
        }

    def dataloader(self, dataset, **loader_kwargs) -> torch.utils.data.DataLoader:
        """A DataLoader over a map-style ``dataset`` with the elastic batch sampler (any ``num_workers``)."""
        for k in ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last"):
            if k in loader_kwargs:
                raise TypeError(f"dataloader(): {k}= is set by slurm-elastic (the batch comes from the daemon)")
        self.loop.set_dataset(len(dataset))
        return torch.utils.data.DataLoader(dataset, batch_sampler=FrameworkBatchSampler(self.loop), **loader_kwargs)
