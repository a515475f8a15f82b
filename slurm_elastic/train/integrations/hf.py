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

``num_train_epochs`` is the number of data epochs; ``max_steps`` is counted in samples (``max_steps x``
the submitted batch, whatever each start's batch); the Trainer's ``lr_scheduler_type`` schedule is counted
in samples (its step ``s`` after ``s x base_batch`` samples); its ``TrainerState`` (``global_step``,
``epoch``, ``log_history``, best metric) is in the library's checkpoint and continues on the next start.

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

import json
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
    # Refuses an optimizer step before an ElasticTrainer restored the job (a plain Trainer after
    # elastic_setup() would train without checkpoints and ignore stops).
    job._hf_loop = ExternalLoop(job, "train with ElasticTrainer(job=job, ...), not Trainer")
    os.environ.update({
        "RANK": str(job.rank), "WORLD_SIZE": str(job.world_size),
        "LOCAL_RANK": str(job.device.index if job.device.type == "cuda" else job.senv.local_rank),
        "MASTER_ADDR": str(job.ctx.master_addr), "MASTER_PORT": str(job.ctx.master_port),
    })
    return job


# num_train_epochs under max_steps: the run ends at max_steps x base_batch samples (the sampler runs dry,
# on_epoch_end stops the Trainer), so the Trainer's epoch loop must never end first, whatever the batch.
_UNBOUNDED_EPOCHS = 10**6

_STATE_FIELDS = ("global_step", "log_history", "best_metric", "best_global_step", "best_model_checkpoint",
                 "total_flos", "num_input_tokens_seen")


class _HFState:
    """The Trainer's ``TrainerState`` counters and history in the library's checkpoint (as JSON text)."""

    def __init__(self, trainer: ElasticTrainer):
        self.trainer = trainer

    def state_dict(self) -> dict:
        st = self.trainer.state
        return {"json": json.dumps({k: getattr(st, k, None) for k in _STATE_FIELDS}, default=str)}

    def load_state_dict(self, state: dict) -> None:
        saved = json.loads(state["json"])
        for k in _STATE_FIELDS:
            if k in saved and saved[k] is not None:
                setattr(self.trainer.state, k, saved[k])


class _ElasticHFCallback(TrainerCallback):
    def __init__(self, trainer: ElasticTrainer):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        t = self.trainer
        opt = t.optimizer
        opt = getattr(opt, "optimizer", opt)  # accelerate's AcceleratedOptimizer wraps the torch one
        loop = t.elastic_loop
        steps = t.elastic_max_steps
        loop.restore(model=t.model, optimizer=opt, scheduler=t.lr_scheduler,
                     epochs=None if steps is not None else math.ceil(args.num_train_epochs), max_steps=steps,
                     hf=_HFState(t))
        t._elastic_schedule()
        # The counters continue: loggers' x-axes, "every N steps" logic and the logged loss average.
        st = t.state
        st.max_steps += st.global_step  # this start's steps come on top (the flow callback stops at it)
        st.epoch = loop.job.epoch + loop.job.offset / loop.dataset_size
        t._globalstep_last_logged = t._initial_global_step = st.global_step

    def on_step_end(self, args, state, control, **kwargs):
        loop = self.trainer.elastic_loop
        loop.step_end()
        state.epoch = loop.job.epoch + loop.job.offset / loop.dataset_size  # data epochs over all starts

    def on_epoch_end(self, args, state, control, **kwargs):
        if self.trainer.elastic_loop.finished:
            control.should_training_stop = True


class ElasticTrainer(Trainer):
    def __init__(self, *args, job: ElasticJob, **kwargs):
        self.elastic_loop = getattr(job, "_hf_loop", None) or ExternalLoop(job, "use ElasticTrainer")
        super().__init__(*args, **kwargs)
        a, targs = job.assignment, self.args
        if targs.world_size != job.world_size:
            raise RuntimeError(f"the Trainer sees {targs.world_size} processes, the job runs {job.world_size}: "
                               "call elastic_setup() before creating TrainingArguments")
        # max_steps counts optimizer steps, whose size the daemon changes: the library converts it to samples
        # (max_steps x the LR base batch, known once the checkpoint is loaded) and ends the run there; the
        # Trainer's own loop gets epochs enough for any batch and stops when the elastic sampler runs dry.
        self.elastic_max_steps = int(targs.max_steps) if targs.max_steps and targs.max_steps > 0 else None
        if self.elastic_max_steps is not None:
            targs.max_steps = -1
            targs.num_train_epochs = _UNBOUNDED_EPOCHS
        targs.per_device_train_batch_size = a.local_batch
        # The Trainer accumulates itself (its accelerator keeps num_steps=1, which must stay so: accelerate
        # would divide the loss by its own count once more).
        targs.gradient_accumulation_steps = a.accum
        # First, so that other callbacks' on_step_end see the data epoch.
        self.callback_handler.callbacks.insert(0, _ElasticHFCallback(self))

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
        """A placeholder the Trainer steps (it records the applied lr, which HF logs); the real schedule is
        set once the checkpoint is loaded and the LR base batch known (:meth:`_elastic_schedule`)."""
        if self.lr_scheduler is None:
            self._elastic_reference_schedule(1)  # refuse a schedule that is not LambdaLR before training
            opt = self.optimizer if optimizer is None else optimizer
            self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda _step: 1.0)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def _elastic_reference_schedule(self, total: int):
        dummy = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        ref = get_scheduler(self.args.lr_scheduler_type, optimizer=dummy,
                            num_warmup_steps=self.args.get_warmup_steps(total), num_training_steps=total,
                            scheduler_specific_kwargs=self.args.lr_scheduler_kwargs)
        if not getattr(ref, "lr_lambdas", None):
            raise ValueError(f"lr_scheduler_type={self.args.lr_scheduler_type!r} is not a LambdaLR schedule, so "
                             "ElasticTrainer cannot count it in samples: use linear/cosine/constant/... or "
                             "lr_scheduler_type='constant' and lr_schedule=lambda samples: ... in elastic_setup()")
        return ref

    def _elastic_schedule(self) -> None:
        """The Trainer's ``lr_scheduler_type`` counted in samples: its step ``s`` is reached after ``s x
        base_batch`` samples (the LR base: the submitted batch, kept from the checkpoint), with the total
        of an uninterrupted run at that batch, so it ends where it would have whatever each start's batch."""
        job, loop = self.elastic_loop.job, self.elastic_loop
        base = job.lr.base_batch
        if self.elastic_max_steps is not None:
            total = self.elastic_max_steps
        else:
            total = max(1, math.ceil(loop.dataset_size / base) * math.ceil(self.args.num_train_epochs))
        job.schedule.replace_lambdas(self._elastic_reference_schedule(total).lr_lambdas)
        job.apply_lr()

    def train(self, *args, **kwargs):
        if kwargs.get("resume_from_checkpoint") or (args and args[0]):
            raise ValueError("ElasticTrainer resumes from its own checkpoint (ELASTIC_CKPT_DIR); "
                             "do not pass resume_from_checkpoint")
        out = super().train(*args, **kwargs)
        if self.elastic_loop.finished:
            self.elastic_loop.finish()
        return out
