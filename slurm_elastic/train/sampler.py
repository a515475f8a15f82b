"""Exactly-once data order across world-size changes: a global sample offset, re-split per start.

Each epoch's order is one permutation of ``range(n)`` drawn from ``(seed, epoch)`` alone, the same in
every process and every start. Training consumes it front to back in global batches: the step at
global offset ``o`` takes ``perm[o : o + B]`` and splits it over the ranks of *this* start (contiguous
blocks, ``B / world`` each), and each rank's block into ``accum`` micro-batches. The state to resume is
just ``(epoch, offset)``; a new world size or batch re-splits the remainder, so no sample is read twice
or skipped. (Per-rank positions, as in DistributedSampler or a stateful loader, break when the world
size changes.)

The last step of an epoch takes the ``n - o < B`` samples left, spread as evenly as the ranks allow.
A rank left with nothing runs one micro-batch of weight 0 (a real sample, scale 0) so that every rank
still takes part in the gradient all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant, keeps (seed, epoch) pairs apart
_MASK = (1 << 63) - 1


def epoch_seed(seed: int, epoch: int) -> int:
    return (int(seed) * _MIX + int(epoch) * 0xBF58476D1CE4E5B9 + 1) & _MASK


def epoch_permutation(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of epoch ``epoch``: a permutation of ``range(n)`` (int64), a function of (seed, epoch)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(epoch_seed(seed, epoch))
    return torch.randperm(n, generator=g)


@dataclass(frozen=True)
class MicroBatch:
    """Sample indices for one forward/backward on this rank, and the loss scale to apply.

    Multiply the **sum** of per-sample losses by ``scale`` (= world size / samples in this global step):
    after DDP's gradient average the result is the mean over the global batch, at any world size.
    """

    indices: torch.Tensor
    scale: float
    dummy: bool = False

    def __len__(self) -> int:
        return 0 if self.dummy else int(self.indices.numel())


@dataclass(frozen=True)
class StepPlan:
    epoch: int
    offset: int  # global offset of this step's first sample in the epoch's order
    count: int  # samples in this global step (the global batch, or less at the epoch's end)
    rank_indices: torch.Tensor  # this rank's samples of the step
    micro_batches: tuple[MicroBatch, ...]


def rank_slice(count: int, rank: int, world: int) -> tuple[int, int]:
    """``[lo, hi)`` of rank's contiguous block when ``count`` samples are spread over ``world`` ranks."""
    base, extra = divmod(count, world)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def plan_step(
    perm: torch.Tensor,
    epoch: int,
    offset: int,
    global_batch: int,
    rank: int,
    world: int,
    local_batch: int,
    accum: int,
) -> StepPlan:
    n = int(perm.numel())
    if not 0 <= offset < n:
        raise ValueError(f"offset {offset} is outside the epoch of {n} samples")
    count = min(global_batch, n - offset)
    chunk = perm[offset : offset + count]
    lo, hi = rank_slice(count, rank, world)
    mine = chunk[lo:hi]
    scale = world / count
    if count == global_batch and mine.numel() != local_batch * accum:
        raise ValueError(
            f"global batch {global_batch} on {world} ranks is not {local_batch} x {accum} per rank"
        )
    parts = [p for p in torch.tensor_split(mine, accum) if p.numel()] if mine.numel() else []
    for p in parts:
        if p.numel() > local_batch:
            raise AssertionError("micro-batch larger than local_batch")  # cannot happen (even split)
    if parts:
        mbs = tuple(MicroBatch(p, scale) for p in parts)
    else:
        mbs = (MicroBatch(chunk[:1].clone(), 0.0, dummy=True),)
    return StepPlan(epoch, offset, count, mine, mbs)
