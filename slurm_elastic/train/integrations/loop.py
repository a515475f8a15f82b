"""``ExternalLoop``: :class:`ElasticJob` driven from a training loop that a framework owns.

Lightning and the Hugging Face Trainer run their own loops, DataLoaders and optimizer steps, so the
pieces of ``job.steps()`` are handed to them separately:

* a batch sampler (:class:`FrameworkBatchSampler`) that yields this rank's micro-batches of the epoch from
  the job's global ``(epoch, offset)`` on, always exactly ``accum`` per step on every rank (a rank with
  no samples left in an epoch's tail gets a placeholder of weight 0), so the framework's own
  accumulation boundaries are the library's steps;
* :meth:`step_begin` at every step boundary: the all-reduced stop flag and periodic checkpoints (a stop
  checkpoints, writes the ack and exits 75, exactly as ``job.steps()`` does);
* :meth:`loss_factor` for the k-th micro-batch of the step: what turns the framework's "mean over the
  micro-batch, divided by accum, averaged over ranks" into the mean over the global batch (exactly 1.0
  when all micro-batches are equal, 0 for a placeholder);
* an optimizer step pre-hook that sets the step's lr (lr.py rule x ``lr_schedule(samples)`` x the
  framework's scheduler counted in samples, see ..schedule); it stays in the param groups, so the
  framework's loggers show the lr applied;
* :meth:`step_end` after the optimizer step: advances the sample offset, samples seen, steps, epoch;
* :meth:`noise_begin` / :meth:`noise_end` around each micro-batch's backward: the gradient noise scale
  (:mod:`..noise`) from the per-replica micro-batch gradients and the all-reduced step gradient, as in
  ``job.steps()``, so the daemon learns ``efficiency(batch)`` from framework jobs too.

The position is derived from the job's state alone, never from what the DataLoader prefetched.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from ..job import ElasticJob
from ..sampler import StepPlan, epoch_permutation, plan_step


class ExternalLoop:
    def __init__(self, job: ElasticJob, fix: str = "use the integration's Trainer arguments"):
        self.job = job
        # Until the framework's hooks restore the job, any optimizer step means the integration is not
        # wired (no checkpoint, stops ignored): refuse it at the first step, saying what to add.
        import torch.distributed as dist
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        self._pg = dist.group.WORLD if dist.is_initialized() else None  # the job's process group
        self._guard = register_optimizer_step_pre_hook(self._unwired_step)
        self._fix = fix
        self.dataset_size: int | None = None
        self.epochs: int | None = None  # data epochs asked for (None: until max_samples)
        self.max_samples: int | None = None  # a framework's max_steps x the LR base batch (see restore)
        self.restored = False
        self.plan: StepPlan | None = None
        self.micro = 0  # micro-batches of the current step seen so far (framework hook calls)
        self._perm_key: tuple[int, int] | None = None
        self._perm: torch.Tensor | None = None
        self._flag_t: torch.Tensor | None = None
        self._hooks: list = []
        self._t0 = 0.0

    # ------------------------------------------------------------ position
    @property
    def accum(self) -> int:
        return self.job.assignment.accum

    def perm(self, epoch: int) -> torch.Tensor:
        key = (self.dataset_size, epoch)
        if self._perm_key != key:
            self._perm = epoch_permutation(self.dataset_size, self.job.seed, epoch)
            self._perm_key = key
        return self._perm

    def plan_at(self, epoch: int, offset: int, seen: int | None = None) -> StepPlan:
        """The step from ``(epoch, offset)``; with ``max_samples``, the last one is cut to the samples left
        (``seen``: the samples trained before it, the job's by default), as an epoch's tail is."""
        a = self.job.assignment
        perm = self.perm(epoch)
        if self.max_samples is not None:
            left = self.max_samples - (self.job.samples_seen if seen is None else seen)
            if 0 < left < perm.numel() - offset:
                perm = perm[: offset + left]
        return plan_step(perm, epoch, offset, a.global_batch, self.job.rank, self.job.world_size,
                         a.local_batch, a.accum)

    def micro_batches(self, plan: StepPlan) -> list[tuple[list[int], float]]:
        """Exactly ``accum`` ``(indices, weight)`` for this rank: the plan's, padded with weight-0 placeholders."""
        out = [([int(i) for i in mb.indices], 0.0 if mb.dummy else float(len(mb))) for mb in plan.micro_batches]
        pad = int(plan.micro_batches[0].indices[0]) if plan.micro_batches else int(self.perm(plan.epoch)[0])
        while len(out) < self.accum:
            out.append(([pad], 0.0))
        return out

    def steps_per_epoch(self) -> int:
        b = self.job.assignment.global_batch
        return -(-self.dataset_size // b)

    def set_dataset(self, dataset_size: int) -> None:
        if self.job.dataset_size is not None and self.job.dataset_size != dataset_size:
            raise RuntimeError(f"the checkpoint is for a dataset of {self.job.dataset_size} samples, "
                               f"not {dataset_size}")
        self.dataset_size = int(dataset_size)

    def restore(self, *, model, optimizer, scheduler=None, epochs: int | None, max_steps: int | None = None,
                **user_objects) -> bool:
        """Register the framework's model/optimizer (unwrapped), load the checkpoint, hook the optimizer.

        ``max_steps`` (the framework's, optimizer steps at the submitted batch) is converted to samples as
        step schedules are (..schedule): the run ends after ``max_steps x base_batch`` samples whatever
        each start's batch, and reports that as its total; with ``epochs`` too, whichever comes first."""
        self._guard.remove()
        if self.dataset_size is None:
            raise RuntimeError("the training DataLoader is not slurm-elastic's: its batch sampler never ran (use "
                               "elastic.dataloader(dataset) with Lightning, ElasticTrainer's own with HF)")
        if epochs is None and max_steps is None:
            raise ValueError("give the framework max_epochs/num_train_epochs or max_steps: the daemon ranks jobs "
                             "by the work left")
        self.epochs = None if epochs is None else int(epochs)
        self.job.planned_epochs = self.epochs  # with the dataset size: the remaining work the daemon ranks
        self.job.register(model=model, optimizer=optimizer, scheduler=scheduler, **user_objects)
        found = self.job.restore()
        self.set_dataset(self.dataset_size)
        self.job.dataset_size = self.dataset_size
        if max_steps is not None:
            self.max_samples = int(max_steps) * int(self.job.lr.base_batch)
            if self.epochs is not None:
                self.max_samples = min(self.max_samples, self.epochs * self.dataset_size)
            if self.job._total_samples_arg is None:
                self.job._total_samples_arg = self.max_samples  # reported with the progress
        self.restored = True
        self._hooks = [optimizer.register_step_pre_hook(self._pre_step)]
        if self.job.noise is not None:
            self.job.noise.attach(model)
        return found

    def _unwired_step(self, optimizer, args, kwargs) -> None:  # noqa: ARG002 - torch hook signature
        import torch.distributed as dist

        if self.job.lr is not None or not dist.is_initialized() or dist.group.WORLD is not self._pg:
            self._guard.remove()  # restored, or the job is gone: nothing to guard
            return
        raise RuntimeError(f"an optimizer step ran but slurm-elastic never restored the job, so it would train "
                           f"without checkpoints and ignore the daemon's stops: {self._fix}")

    @property
    def finished(self) -> bool:
        if self.max_samples is not None and self.job.samples_seen >= self.max_samples:
            return True
        return self.epochs is not None and self.job.epoch >= self.epochs

    # ------------------------------------------------------------ step boundary
    def step_begin(self) -> None:
        """At a step boundary on every rank: agree on stop / periodic checkpoint; a stop exits with 75."""
        job = self.job
        self._t0 = time.perf_counter()
        if self._flag_t is None:
            self._flag_t = torch.zeros(2, dtype=torch.int32,
                                       device=job.device if job.ctx.backend == "nccl" else "cpu")
        stop, due = job._agree(self._flag_t)
        if stop:
            self.remove_hooks()
            job._stop_and_exit()  # checkpoint, ack, barrier, teardown, SystemExit(75)
        if due:
            job.checkpoint()
            self._t0 = time.perf_counter()
        self.plan = self.plan_at(job.epoch, job.offset)
        self.micro = 0
        if job.noise is not None:
            job.noise.active = job.optimizer_steps % job.noise_every == 0

    def loss_factor(self, k: int, *, normalized_globally: bool = False) -> float:
        """Multiplier for micro-batch ``k``'s loss.

        ``normalized_globally=False``: the framework's loss is the micro-batch mean divided by ``accum``,
        then averaged over ranks by DDP; the factor ``world * n_k * accum / count`` makes that the mean
        over the global batch (1.0 exactly when all micro-batches are equal). ``True``: the framework
        already normalized by the global item count (HF ``num_items_in_batch``); only placeholders (0).
        """
        plan = self.plan
        n_k = self.micro_batches(plan)[k][1]
        if normalized_globally:
            return 0.0 if n_k == 0 else 1.0
        return self.job.world_size * n_k * self.accum / plan.count

    # ------------------------------------------------------------ noise scale
    def noise_begin(self) -> None:
        """Before micro-batch :attr:`micro`'s backward."""
        if self.job.noise is not None and self.plan is not None:
            self.job.noise.begin_micro()

    def noise_end(self, loss_scale: float = 1.0) -> None:
        """After micro-batch :attr:`micro`'s backward (every rank). The framework's gradient of micro-batch
        ``k`` is ``world * n_k / count`` times its mean gradient (see :meth:`loss_factor`), which is the
        library's sum convention with ``scale = world / count``. After the step's last micro-batch the
        gradient is all-reduced and not yet clipped: fold the step in (one 3-scalar all-reduce)."""
        noise, plan, job = self.job.noise, self.plan, self.job
        if noise is None or plan is None:
            return
        if not noise.active:
            noise.discard()
            return
        n_k = int(self.micro_batches(plan)[self.micro][1])
        noise.end_micro(n_k, job.world_size / plan.count, loss_scale)
        if self.micro == self.accum - 1:
            params = [p for p in job.model.parameters() if p.requires_grad]
            noise.step(params, job.assignment.global_batch, plan.count, job.device, loss_scale)
            job.lr.noise_scale = noise.noise_scale

    def step_end(self) -> None:
        """After the optimizer step (all ranks): advance the global position by the step's samples."""
        job, plan = self.job, self.plan
        job.offset += plan.count
        job._count_step(plan.count, time.perf_counter() - self._t0)  # as in job.steps(): for the daemon
        if job.offset >= self.dataset_size:
            job.epoch += 1
            job.offset = 0
            job.apply_lr()  # an epoch-interval schedule moves here
        self.plan = None

    # ------------------------------------------------------------ lr
    def _pre_step(self, optimizer, args, kwargs) -> None:  # noqa: ARG002 - torch hook signature
        if self.plan is None:
            raise RuntimeError("an optimizer step outside a slurm-elastic step: the training DataLoader is not "
                               "the elastic one, or the callback is missing (use **elastic.trainer_kwargs())")
        self.job.lr_for_step()

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def finish(self) -> None:
        self.remove_hooks()
        self.job.finish()


class FrameworkBatchSampler(torch.utils.data.Sampler):
    """This rank's micro-batches (lists of dataset indices) of the current epoch from the job's position,
    padded with weight-0 placeholders so that a framework's own accumulation boundaries line up with the
    library's steps (the plain-PyTorch sampler, :class:`slurm_elastic.train.data.ElasticBatchSampler`, lets
    the library own accumulation instead).

    Read at ``iter()`` time, so the framework's per-epoch ``iter(dataloader)`` continues where the last
    step ended. ``len()`` is a full epoch (``steps x accum``), whatever the position, since frameworks
    size their loops from it before the checkpoint is loaded; a resumed epoch simply ends early.
    """

    def __init__(self, loop: ExternalLoop):
        self.loop = loop

    def __len__(self) -> int:
        return self.loop.steps_per_epoch() * self.loop.accum

    def __iter__(self) -> Iterator[list[int]]:
        loop = self.loop
        if not loop.restored:
            raise RuntimeError("the elastic DataLoader is iterated before slurm-elastic restored the job: the "
                               "callback is missing (Lightning: L.Trainer(..., **elastic.trainer_kwargs()); HF: "
                               "ElasticTrainer)")
        if loop.finished:
            return
        epoch, offset, seen = loop.job.epoch, loop.job.offset, loop.job.samples_seen
        n = loop.dataset_size
        while offset < n and (loop.max_samples is None or seen < loop.max_samples):
            plan = loop.plan_at(epoch, offset, seen)
            for idx, _w in loop.micro_batches(plan):
                yield idx
            offset += plan.count
            seen += plan.count
