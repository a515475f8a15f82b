"""The Hugging Face Trainer under the slurm-elastic daemon: ``ElasticTrainer``, a Trainer subclass.

Usage (see docs/INTEGRATIONS.md)::

    from slurm_elastic.train import install_stop_handler
    install_stop_handler()
    from transformers import TrainingArguments
    from slurm_elastic.train.integrations.hf import ElasticTrainer, elastic_setup

    job = elastic_setup(seed=0, lr_scaling="sqrt")      # before TrainingArguments: process group, batch
    args = TrainingArguments(output_dir="out", num_train_epochs=3, learning_rate=3e-4, save_strategy="no")
    trainer = ElasticTrainer(job=job, model=model, args=args, train_dataset=train_set)
    trainer.train()

Why a subclass and not only a ``TrainerCallback``: a callback can neither replace the training
DataLoader (accelerate shards the Trainer's batches per rank, a per-rank position that breaks when the
world size changes) nor scale a micro-batch's loss. The subclass overrides ``get_train_dataloader``
(the elastic batch sampler), ``training_step`` (the stop check at each step boundary),
``compute_loss`` (the per-micro-batch factor), ``get_batch_samples`` (placeholders' labels masked so
that ``num_items_in_batch`` counts only real tokens) and ``create_scheduler`` (the schedule in
samples); its callback restores the checkpoint once the optimizer exists and advances the position after
each optimizer step. ``per_device_train_batch_size`` and ``gradient_accumulation_steps`` are set from
the daemon's decision; ``num_train_epochs`` is the number of data epochs. The Trainer's own checkpoints
(``resume_from_checkpoint``) are not used for resizing.
"""

from __future__ import annotations

import math
import os

import torch
from transformers import Trainer, TrainerCallback, get_scheduler

from ..job import ElasticJob
from .loop import ExternalLoop, FrameworkBatchSampler


def elastic_setup(ckpt_dir: str | os.PathLike | None = None, **job_kwargs) -> ElasticJob:
    """Create the job and its process group; export RANK/WORLD_SIZE/... so accelerate joins that group.

    Call before ``TrainingArguments`` (which initializes accelerate's state from the environment).
    """
    job = ElasticJob(ckpt_dir, **job_kwargs)
    job.setup()
    os.environ.update({
        "RANK": str(job.rank), "WORLD_SIZE": str(job.world_size),
        "LOCAL_RANK": str(job.device.index if job.device.type == "cuda" else job.senv.local_rank),
        "MASTER_ADDR": str(job.ctx.master_addr), "MASTER_PORT": str(job.ctx.master_port),
    })
    return job


class _ElasticHFCallback(TrainerCallback):
    def __init__(self, trainer: ElasticTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        t = self.trainer
        opt = t.optimizer
        opt = getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer wraps the torch one
        t.elastic_loop.restore(model=t.model, optimizer=opt, epochs=math.ceil(args.num_train_epochs))

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer.elastic_loop.step_end()

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.trainer.elastic_loop.finished:
            control.should_training_stop = True


class ElasticTrainer(Trainer):
    def __init__(self, *args, job: ElasticJob, **kwargs):
        self.elastic_loop = ExternalLoop(job)
        super().__init__(*args, **kwargs)
        a, targs = job.assignment, self.args
        if targs.world_size != job.world_size:
            raise RuntimeError(f"the Trainer sees {targs.world_size} processes, the job runs {job.world_size}: "
                               "call elastic_setup() before creating TrainingArguments")
        if targs.max_steps and targs.max_steps > 0:
            raise ValueError("max_steps is not supported by ElasticTrainer: give num_train_epochs (data epochs)")
        targs.per_device_train_batch_size = a.local_batch
        # The Trainer accumulates itself (its accelerator keeps num_steps=1, which must stay so: accelerate
        # would divide the loss by its own count once more).
        targs.gradient_accumulation_steps = a.accum
        self.add_callback(_ElasticHFCallback(self))

    # -------------------------------------------------------------- data
    def get_train_dataloader(self) -> torch.utils.data.DataLoader:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        self.elastic_loop.set_dataset(len(self.train_dataset))
        a = self.args
        return torch.utils.data.DataLoader(
            self.train_dataset, batch_sampler=FrameworkBatchSampler(self.elastic_loop),
            collate_fn=self.data_collator, num_workers=a.dataloader_num_workers,
            pin_memory=a.dataloader_pin_memory and self.elastic_loop.job.device.type == "cuda",
            persistent_workers=a.dataloader_persistent_workers and a.dataloader_num_workers > 0)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batch_samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        if num_items is None or not batch_samples:
            return batch_samples, num_items
        loop = self.elastic_loop
        weights = [w for _, w in loop.micro_batches(loop.plan_at(loop.job.epoch, loop.job.offset))]
        if 0.0 in weights[: len(batch_samples)]:
            for b, w in zip(batch_samples, weights, strict=False):
                if w == 0.0 and isinstance(b, dict) and "labels" in b:
                    b["labels"] = torch.full_like(b["labels"], -100)
            num_items = self._get_num_items_in_batch(batch_samples, device)
        return batch_samples, num_items

    # -------------------------------------------------------------- step
    def training_step(self, model, inputs, num_items_in_batch=None):
        loop = self.elastic_loop
        if loop.plan is None:
            loop.step_begin()  # a stop request checkpoints here and exits with 75
        self._elastic_num_items = num_items_in_batch
        loop.noise_begin()
        try:
            out = super().training_step(model, inputs, num_items_in_batch)
            scaler = getattr(self.accelerator, "scaler", None)
            loop.noise_end(float(scaler.get_scale()) if scaler is not None and scaler.is_enabled() else 1.0)
            return out
        finally:
            loop.micro += 1

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        loop = self.elastic_loop
        if not model.training or loop.plan is None:
            return out
        scaled_for_ga = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) \
            or self.compute_loss_func is not None
        if scaled_for_ga and not self.args.average_tokens_across_devices:
            raise ValueError("ElasticTrainer needs average_tokens_across_devices=True (the default) for a loss "
                             "normalized by num_items_in_batch")
        f = loop.loss_factor(loop.micro, normalized_globally=scaled_for_ga)
        if f == 1.0:
            return out
        if return_outputs:
            loss, outputs = out
            return loss * f, outputs
        return out * f

    # -------------------------------------------------------------- lr
    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """The Trainer's schedule, counted in samples: step ``s`` of ``lr_scheduler_type`` is reached after
        ``s x base_batch`` samples, whatever the batch of each start. The optimizer's lr stays constant;
        the library applies the factor (times its batch-size rule) at each optimizer step."""
        if self.lr_scheduler is None:
            job, loop = self.elastic_loop.job, self.elastic_loop
            base = job.base_batch or job._requested_batch or job.assignment.global_batch
            epochs = math.ceil(self.args.num_train_epochs)
            total = max(1, math.ceil(epochs * loop.dataset_size / base)) if loop.dataset_size else num_training_steps
            dummy = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
            ref = get_scheduler(self.args.lr_scheduler_type, optimizer=dummy,
                                num_warmup_steps=self.args.get_warmup_steps(total), num_training_steps=total,
                                scheduler_specific_kwargs=self.args.lr_scheduler_kwargs)
            lambdas = getattr(ref, "lr_lambdas", None)
            if not lambdas:
                raise ValueError(f"lr_scheduler_type={self.args.lr_scheduler_type!r} is not a LambdaLR schedule; "
                                 "ElasticTrainer counts schedules in samples (use linear/cosine/constant/... "
                                 "or pass lr_schedule= to elastic_setup)")
            fn, user = lambdas[0], job.lr_schedule
            job.lr_schedule = (lambda s: fn(s / base)) if user is None else (lambda s: fn(s / base) * user(s))
            opt = self.optimizer if optimizer is None else optimizer
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda _step: 1.0)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def train(self, *args, **kwargs):
        if kwargs.get("resume_from_checkpoint") or (args and args[0]):
            raise ValueError("ElasticTrainer resumes from its own checkpoint (ELASTIC_CKPT_DIR); "
                             "do not pass resume_from_checkpoint")
        out = super().train(*args, **kwargs)
        if self.elastic_loop.finished:
            self.elastic_loop.finish()
        return out
