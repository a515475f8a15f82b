"""A step-based lr scheduler counted in samples, so that it survives a batch change.

A schedule written for N optimizer steps at the submitted batch ``B0`` reaches step ``s`` after
``s x B0`` samples here, whatever the batch of each start (a fractional step between two of them at
another batch): it ends where it would have, instead of at step N of a halved batch (lr 0 for the rest
of the run) or half-way at a doubled one. Converted: ``LambdaLR`` (every transformers schedule) and the
torch schedulers with a closed form (StepLR, MultiStepLR, ConstantLR, LinearLR, ExponentialLR,
CosineAnnealingLR, PolynomialLR). Others (ReduceLROnPlateau, OneCycleLR, CyclicLR, chained and
sequential ones, ...) are refused at start with what to write instead, never silently kept.

The converted scheduler no longer changes the lr itself: its ``step()`` only records the lr the library
set (``get_last_lr()`` is then the applied lr, as loggers read it), and the library sets every param
group's lr to ``base_lr x factor(progress)`` before each optimizer step (see ``ElasticJob.apply_lr``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

CLOSED_FORM = ("StepLR", "MultiStepLR", "ConstantLR", "LinearLR", "ExponentialLR", "CosineAnnealingLR",
               "PolynomialLR")

INSTEAD = ("Use a LambdaLR over steps (its lambda then gets the step at the submitted batch, fractional "
           "after a resize), one of " + ", ".join(CLOSED_FORM) + ", or no scheduler and "
           "lr_schedule=lambda samples: <factor> on the job (progress in samples seen).")


class ScheduleError(ValueError):
    """A scheduler that cannot be counted in samples (raised at start, before any step)."""


def _kind(scheduler) -> str:
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR) and lambdas:
        return "lambda"
    if type(scheduler).__name__ in CLOSED_FORM and hasattr(scheduler, "_get_closed_form_lr"):
        return "closed"
    raise ScheduleError(f"the lr scheduler {type(scheduler).__name__} steps once per optimizer step (or on a "
                        "metric), and slurm-elastic changes the batch between starts, so its schedule would "
                        f"end early or late; it cannot be counted in samples. {INSTEAD}")


def _call(fn: Callable, step: float) -> float:
    try:
        return float(fn(step))
    except (TypeError, IndexError):  # a lambda that indexes a table wants an integer step
        return float(fn(math.floor(step)))


class SampleSchedule:
    """The per-param-group lr factors of a converted scheduler at a (fractional) scheduler step."""

    def __init__(self, scheduler):
        self.kind = _kind(scheduler)
        self.scheduler = scheduler
        self.base_lrs = [float(x) for x in scheduler.base_lrs]
        if self.kind == "lambda":
            self._lambdas = list(scheduler.lr_lambdas)

    def replace_lambdas(self, fns) -> None:
        """A LambdaLR's schedule known only after the checkpoint is loaded (the HF Trainer's, whose
        length depends on the LR base batch): one function for every param group."""
        fns = list(fns)
        n = len(self.base_lrs)
        self._lambdas = fns * n if len(fns) == 1 else fns
        if len(self._lambdas) != n:
            raise ValueError(f"{len(fns)} lr functions for {n} param groups")

    def factors(self, step: float) -> list[float]:
        if self.kind == "lambda":
            return [_call(fn, step) for fn in self._lambdas]
        s = self.scheduler
        saved = s.last_epoch
        try:
            s.last_epoch = step
            lrs = s._get_closed_form_lr()
        finally:
            s.last_epoch = saved
        return [float(lr) / b if b else 0.0 for lr, b in zip(lrs, self.base_lrs, strict=True)]

    def neutralize(self, applied: Callable[[], list[float]]) -> None:
        """From now on ``scheduler.step()`` records the applied lr instead of setting its own."""
        s = self.scheduler

        def step(*_args, **_kwargs):
            s._last_lr = applied()

        s.step = step
        s._last_lr = applied()
