"""Elastic data for an ordinary ``DataLoader`` loop: the library keeps the data order and the gradient
scale, the user keeps ``loss = criterion(out, y); loss.backward(); opt.step()``.

Two sources, one plan. :class:`ElasticBatchSampler` (map-style datasets) is the DataLoader's
``batch_sampler``; :class:`ElasticIterableDataset` wraps an iterable dataset (stream order, no
shuffle by us). Both cut the epoch into the same global steps as :meth:`ElasticJob.steps` (global
offset, re-split per start, see :mod:`.sampler`), so resizes keep every sample exactly once.
Each loader item is one micro-batch. :func:`elastic_batches` (``job.batches(loader)``) wraps the
iteration and, per micro-batch:

* knows which step it belongs to (the sampler runs ahead of the loop when ``num_workers > 0``; a FIFO
  of what was sampled, in the loader's in-order delivery, tells what the loop is consuming; iterable
  workers send the tag along with the batch);
* scales the gradient of a **mean**-reduced loss: a hook on the model's output multiplies the gradient
  by ``len(micro-batch) * world / samples_in_global_step``; after DDP's average that is the mean over
  the global batch whatever the world size, accumulation or tail split (0 for a rank's weight-0
  placeholder micro-batch);
* turns off DDP's gradient sync on all but the last micro-batch of a step, and makes ``opt.step()`` and
  ``opt.zero_grad()`` no-ops until the last one (gradient accumulation without user code);
* at step boundaries agrees on the stop flag and periodic checkpoints, like ``job.steps()``.

A loss whose gradient does not flow through the model's output (a penalty on the parameters added to
the loss) is not scaled; keep such terms in the optimizer (``weight_decay``).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from .sampler import epoch_permutation, plan_step


@dataclass(frozen=True)
class MicroTag:
    """Where one loader item sits in the training: its global step and its gradient factor."""

    epoch: int
    offset: int  # the global step's first sample in the epoch order
    count: int  # samples in the global step
    index: int  # micro-batch index within the step on this rank
    last: bool
    factor: float  # multiply a mean loss's gradient by this (0 for a placeholder)
    samples: int = 0  # real samples in the micro-batch (0 for a placeholder)


@dataclass(frozen=True)
class PlanParams:
    """Plain data from which every rank (and loader worker) derives its micro-batches."""

    epoch: int
    offset: int
    epochs: int
    size: int
    seed: int
    global_batch: int
    local_batch: int
    accum: int
    rank: int
    world: int
    shuffle: bool = True


def iter_micro(p: PlanParams) -> Iterator[tuple[torch.Tensor, MicroTag]]:
    """``(indices, tag)`` for every micro-batch of this rank from ``(epoch, offset)`` to the end."""
    epoch, offset = p.epoch, p.offset
    while epoch < p.epochs:
        perm = epoch_permutation(p.size, p.seed, epoch) if p.shuffle else torch.arange(p.size)
        while offset < p.size:
            plan = plan_step(perm, epoch, offset, p.global_batch, p.rank, p.world, p.local_batch, p.accum)
            k = len(plan.micro_batches)
            for i, mb in enumerate(plan.micro_batches):
                f = 0.0 if mb.dummy else len(mb) * mb.scale
                yield mb.indices, MicroTag(epoch, offset, plan.count, i, i == k - 1, f, 0 if mb.dummy else len(mb))
            offset += plan.count
        epoch, offset = epoch + 1, 0


def _params(job, size: int, epochs: int, shuffle: bool) -> PlanParams:
    a = job.assignment
    if a is None or job.lr is None:
        raise RuntimeError("call job.setup() and job.restore() before iterating the data")
    return PlanParams(job.epoch, job.offset, int(epochs), int(size), job.seed, a.global_batch, a.local_batch,
                      a.accum, job.rank, job.world_size, shuffle)


class ElasticBatchSampler:
    """``DataLoader(dataset, batch_sampler=ElasticBatchSampler(job, len(dataset), epochs))``.

    Yields this rank's micro-batches (lists of indices) from the job's resumed position to the end of
    ``epochs``, in the epoch order of ``(seed, epoch)`` (``shuffle=False``: ``0..n-1``).
    """

    def __init__(self, job, dataset_size: int, epochs: int, *, shuffle: bool = True):
        self.job, self.size, self.epochs, self.shuffle = job, int(dataset_size), int(epochs), shuffle
        self.pending: collections.deque[MicroTag] = collections.deque()

    def __iter__(self) -> Iterator[list[int]]:
        self.pending.clear()
        for idx, tag in iter_micro(_params(self.job, self.size, self.epochs, self.shuffle)):
            self.pending.append(tag)
            yield idx.tolist()

    def __len__(self) -> int:
        p = _params(self.job, self.size, self.epochs, self.shuffle)
        left = (p.epochs - p.epoch) * p.size - p.offset
        return max(0, -(-left // p.global_batch)) * p.accum  # an upper bound (tails may have fewer)


class _Tagged:
    """A collated micro-batch with its tag, as an iterable dataset's worker sends it."""

    __slots__ = ("batch", "tag")

    def __init__(self, batch, tag: MicroTag):
        self.batch, self.tag = batch, tag


class ElasticIterableDataset(torch.utils.data.IterableDataset):
    """Wrap an iterable dataset (a stream of samples of known length per epoch) for exactly-once data.

    Use with ``DataLoader(ElasticIterableDataset(job, stream, epochs), batch_size=None, num_workers=k)``.
    The epoch order is the stream's own order (call ``stream.set_epoch(e)`` if it has it, to reshuffle
    deterministically). Every rank and worker reads the stream and keeps only the samples of its
    micro-batches (worker ``w`` of ``k`` builds micro-batches ``w, w+k, ...``, which the DataLoader
    delivers in order); reading is repeated per rank and worker, so this suits streams that are cheap
    to read or skip. ``size`` defaults to ``len(stream)``.
    """

    def __init__(self, job, stream: Iterable, epochs: int, *, size: int | None = None, collate_fn=None):
        super().__init__()
        self.job, self.stream, self.epochs = job, stream, int(epochs)
        self.size = int(size if size is not None else len(stream))  # type: ignore[arg-type]
        self.collate_fn = collate_fn
        self.params: PlanParams | None = None

    def snapshot(self) -> None:
        """Freeze the job's position into plain data (called by ``job.batches`` before workers start)."""
        self.params = _params(self.job, self.size, self.epochs, shuffle=False)

    def __iter__(self) -> Iterator[_Tagged]:
        from torch.utils.data import default_collate, get_worker_info

        p = self.params
        if p is None:
            raise RuntimeError("iterate an ElasticIterableDataset through job.batches(loader)")
        info = get_worker_info()
        wid, nw = (info.id, info.num_workers) if info is not None else (0, 1)
        collate = self.collate_fn or default_collate
        epoch, wanted, k = None, {}, 0
        it = None
        pos = 0
        buf: dict[int, object] = {}
        for idx, tag in iter_micro(p):
            mine = k % nw == wid
            k += 1
            if not mine:
                continue
            if tag.epoch != epoch:
                epoch, pos, buf = tag.epoch, 0, {}
                if hasattr(self.stream, "set_epoch"):
                    self.stream.set_epoch(epoch)
                it = iter(self.stream)
            wanted = {int(i) for i in idx.tolist()}
            hi = max(wanted)
            while pos <= hi:
                try:
                    sample = next(it)
                except StopIteration:
                    raise RuntimeError(f"the stream ended after {pos} samples in epoch {epoch}; "
                                       f"size={self.size} was given") from None
                if pos in wanted:
                    buf[pos] = sample
                pos += 1
            yield _Tagged(collate([buf.pop(int(i)) for i in idx.tolist()]), tag)


def elastic_batches(job, loader) -> Iterator:
    """Iterate ``loader`` (built on an ElasticBatchSampler or an ElasticIterableDataset) for ``job``."""
    sampler = loader.batch_sampler if isinstance(getattr(loader, "batch_sampler", None), ElasticBatchSampler) \
        else None
    ds = loader.dataset
    if sampler is not None:
        size = sampler.size
    elif isinstance(ds, ElasticIterableDataset):
        ds.snapshot()
        size = ds.size
    else:
        raise TypeError("job.batches() needs a DataLoader with batch_sampler=job.batch_sampler(...) or an "
                        "ElasticIterableDataset with batch_size=None")
    if job.dataset_size is not None and job.dataset_size != size:
        raise RuntimeError(f"the checkpoint is for a dataset of {job.dataset_size} samples, not {size}")
    job.dataset_size = size
    model = job.ddp if job.ddp is not None else job.model
    if model is None or job.optimizer is None:
        raise RuntimeError("job.wrap(model) and job.register(model=..., optimizer=...) before job.batches()")
    state = _LoopState(job)
    hook = model.register_forward_hook(state.forward_hook)
    state.patch_optimizer()
    flag_t = torch.zeros(2, dtype=torch.int32, device=job.device if job.ctx.backend == "nccl" else "cpu")
    try:
        for item in loader:
            if sampler is not None:
                tag, batch = sampler.pending.popleft(), item
            else:
                tag, batch = item.tag, item.batch
            if tag.index == 0:
                state.begin_step(tag, flag_t)
            state.begin_micro(tag)
            if job.ddp is not None:
                job.ddp.require_backward_grad_sync = tag.last
            yield batch
            if tag.last and not state.stepped:
                raise RuntimeError("call opt.step() (or scaler.step(opt)) once per loader item "
                                   "(it is a no-op while accumulating)")
        state.tag = None
    finally:
        hook.remove()
        state.unpatch_optimizer()
        job.micro_tag = None
        if job.ddp is not None:
            job.ddp.require_backward_grad_sync = True
        if job.noise is not None:
            job.noise.discard()


class EpochLoader:
    """``job.loader(dataset, **DataLoader kwargs)``: one data epoch per ``iter()``, from the job's position.

    Used as ``for epoch in job.epochs(E): for x, y in loader: ...``, the loop of an ordinary script:
    each ``iter()`` builds a ``DataLoader`` over the rest of the current epoch (elastic batch sampler
    for a map-style dataset, :class:`ElasticIterableDataset` for an iterable one) and iterates it
    through :func:`elastic_batches`. ``batch_size``/``shuffle``/``sampler`` are the library's."""

    def __init__(self, job, dataset, *, shuffle: bool = True, size: int | None = None, **loader_kwargs):
        for k in ("batch_size", "sampler", "batch_sampler", "drop_last"):
            if k in loader_kwargs:
                raise TypeError(f"job.loader(): {k}= is set by slurm-elastic (the batch comes from the daemon)")
        self.job, self.dataset, self.shuffle, self.kwargs = job, dataset, shuffle, loader_kwargs
        self.iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        if size is None and not hasattr(dataset, "__len__"):
            raise TypeError("job.loader(): this dataset has no len(); give size= (samples per epoch)")
        self.size = int(size if size is not None else len(dataset))

    def __len__(self) -> int:
        """Micro-batches left in the current epoch on this rank (an upper bound at an uneven tail)."""
        a = self.job.assignment
        left = self.size - self.job.offset
        return max(0, -(-left // a.global_batch)) * a.accum

    def __iter__(self) -> Iterator:
        job = self.job
        end = job.epoch + 1
        kw = dict(self.kwargs)
        if self.iterable:
            collate = kw.pop("collate_fn", None)
            ds = ElasticIterableDataset(job, self.dataset, end, size=self.size, collate_fn=collate)
            loader = torch.utils.data.DataLoader(ds, batch_size=None, **kw)
        else:
            loader = torch.utils.data.DataLoader(
                self.dataset, batch_sampler=ElasticBatchSampler(job, self.size, end, shuffle=self.shuffle), **kw)
        return elastic_batches(job, loader)


class _LoopState:
    """The per-iteration bookkeeping of :func:`elastic_batches`."""

    def __init__(self, job):
        self.job = job
        self.tag: MicroTag | None = None
        self.stepped = False
        self.backward_seen = False
        self.t0 = 0.0
        self._orig = None
        self._orig_scaler = None
        self.micro_done = False
        self.in_step = False

    # gradient scale for mean losses --------------------------------------------------------------
    def forward_hook(self, module, inputs, output):  # noqa: ARG002 - torch hook signature
        tag = self.tag
        if tag is None or not torch.is_grad_enabled():
            return None
        f = tag.factor

        def scale(g, f=f):
            self.backward_seen = True
            return g * f

        def visit(o):
            if isinstance(o, torch.Tensor):
                if o.requires_grad and o.is_floating_point():
                    o.register_hook(scale)
            elif isinstance(o, (list, tuple)):
                for x in o:
                    visit(x)
            elif isinstance(o, dict):
                for x in o.values():
                    visit(x)
            elif hasattr(o, "__dataclass_fields__"):
                for name in o.__dataclass_fields__:
                    visit(getattr(o, name))

        visit(output)
        return None

    # step boundaries ------------------------------------------------------------------------------
    def begin_step(self, tag: MicroTag, flag_t: torch.Tensor) -> None:
        job = self.job
        if (tag.epoch, tag.offset) != (job.epoch, job.offset):
            raise RuntimeError(f"the loader is at epoch {tag.epoch} offset {tag.offset}, the job at "
                               f"{job.epoch}/{job.offset}: was opt.step() skipped or the loader re-used?")
        self.t0 = time.perf_counter()
        stop, due = job._agree(flag_t)
        if stop:
            job._stop_and_exit()
        if due:
            job.checkpoint()
            self.t0 = time.perf_counter()
        self.stepped = False
        self.backward_seen = False

    def end_step(self) -> None:
        job, tag = self.job, self.tag
        job.offset = tag.offset + tag.count
        if job.offset >= job.dataset_size:
            job.epoch, job.offset = tag.epoch + 1, 0
        job._count_step(tag.count, time.perf_counter() - self.t0)
        self.stepped = True

    # the user's optimizer (and AMP scaler) -----------------------------------------------------------
    def begin_micro(self, tag: MicroTag) -> None:
        self.tag = tag
        self.job.micro_tag = tag
        self.micro_done = False
        noise = self.job.noise
        if noise is not None:
            if tag.index == 0:
                noise.active = self.job.optimizer_steps % self.job.noise_every == 0
            noise.begin_micro()

    def end_micro(self) -> None:
        """The loop body called ``opt.step()`` / ``scaler.step(opt)``: this micro-batch's backward is done."""
        if self.micro_done:
            return
        self.micro_done = True
        noise, tag = self.job.noise, self.tag
        if noise is not None and noise.active and tag.samples > 0:
            # The output hook made the gradient factor x (micro-batch mean), i.e. the sum convention with
            # scale = factor / samples (see .noise).
            noise.end_micro(tag.samples, tag.factor / tag.samples, self.job._loss_scale())

    def real_step(self, step_fn) -> bool:
        """At the user's step call: True if this was the step's last micro-batch (the real step ran)."""
        tag = self.tag
        self.end_micro()
        if not tag.last or self.stepped:
            return False  # accumulating (or a second call for the same step)
        self.in_step = True
        try:
            self.job._optimizer_step(tag.count, step_fn=step_fn)
        finally:
            self.in_step = False
        self.end_step()
        return True

    def patch_optimizer(self) -> None:
        job = self.job
        opt = job.optimizer
        self.in_step = False
        self._orig = (opt.__dict__.get("step"), opt.__dict__.get("zero_grad"))
        orig_step, orig_zero = opt.step, opt.zero_grad

        def step(*args, **kwargs):
            if self.tag is None or self.in_step:
                return orig_step(*args, **kwargs)
            self.real_step(lambda: orig_step(*args, **kwargs))
            return None

        def zero_grad(*args, **kwargs):
            tag = self.tag
            # Inside a step, after a backward and before the real optimizer step: the gradient is
            # being accumulated, keep it.
            if tag is not None and self.backward_seen and not self.stepped:
                return None
            return orig_zero(*args, **kwargs)

        opt.step = step
        opt.zero_grad = zero_grad
        scaler = job.scaler
        self._orig_scaler = None
        if scaler is not None:
            # ``scaler.scale(loss).backward(); scaler.step(opt); scaler.update()`` in the loop body:
            # step and update wait for the last micro-batch (unscaling a partial gradient would mix
            # scaled and unscaled parts); the library's step unscales once, clips, steps, updates.
            self._orig_scaler = (scaler.__dict__.get("step"), scaler.__dict__.get("update"))
            orig_sstep, orig_update = scaler.step, scaler.update

            def sstep(optimizer, *args, **kwargs):
                if self.tag is None or self.in_step or optimizer is not opt:
                    return orig_sstep(optimizer, *args, **kwargs)
                self.real_step(None)  # job._optimizer_step with the registered scaler: step + update
                return None

            def update(*args, **kwargs):
                if self.tag is None or self.in_step:
                    return orig_update(*args, **kwargs)
                return None  # done by the library's step

            scaler.step = sstep
            scaler.update = update

    def unpatch_optimizer(self) -> None:
        opt = self.job.optimizer
        for name, old in zip(("step", "zero_grad"), self._orig or (None, None), strict=True):
            if old is None:
                opt.__dict__.pop(name, None)
            else:
                opt.__dict__[name] = old
        if self._orig_scaler is not None:
            for name, old in zip(("step", "update"), self._orig_scaler, strict=True):
                if old is None:
                    self.job.scaler.__dict__.pop(name, None)
                else:
                    self.job.scaler.__dict__[name] = old
