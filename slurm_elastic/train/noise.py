"""Gradient noise scale measured inside the job (McCandlish et al. 2018; smoothed as in AdaptDL/Pollux).

Why: the daemon's goodput model is ``throughput(k, b) x efficiency(b)`` with
``efficiency(b) = (noise_scale + base_batch) / (noise_scale + b)``; the noise scale
``B_noise = tr(Sigma) / |G|^2`` (per-sample covariance ``Sigma``, true gradient ``G``, in samples) is
learned from the job's own gradients, so a user's job needs no validation data.

Estimator. A gradient averaged over ``n`` samples has ``E|g_n|^2 = |G|^2 + tr(Sigma) / n``. Each step
gives two such measurements:

* *small*: the gradient of every micro-batch on every rank, before DDP averages it (a tensor hook on
  each parameter sees exactly that micro-batch's contribution): the mean over micro-batches of
  ``|g_m|^2`` estimates ``|G|^2 + tr(Sigma) * mean(1/n_m)``;
* *big*: the all-reduced, accumulated gradient over the whole global batch ``B`` (``p.grad`` when the
  optimizer step begins): ``|G|^2 + tr(Sigma) / B``.

Two linear equations, two unknowns (unbiased for each step). With several ranks or accumulation
micro-steps the two differ; a single rank without accumulation gives no estimate (reported as None).
``|G|^2`` and ``tr(Sigma)`` are smoothed separately by an exponential moving average with bias
correction (AdaptDL), whose weight per step grows with the batch (``smoothing ** (B / base_batch)``).

Cost per measured step: one squared norm (a dot product) per parameter per micro-batch, one over
``p.grad`` at the step, and one all-reduce of three scalars; relative to the backward pass that is
about ``1 / local_batch`` (measured +10% for a 1M-parameter MLP at 32 samples per micro-batch on one
CPU thread, less at larger batches and on GPUs). ``ElasticJob(noise_every=n)`` measures every n-th
step only. It assumes the library's loss convention: the *sum* of
per-sample losses times ``mb.scale`` (so a micro-batch of ``n`` samples contributes
``scale * n * mean``). With an AMP ``GradScaler`` the norms are divided by its scale squared.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class NoiseEstimate:
    """Smoothed ``|G|^2`` and ``tr(Sigma)`` (bias-corrected) and how many steps they rest on."""

    grad_sqr: float
    grad_var: float
    steps: int

    @property
    def noise_scale(self) -> float | None:
        """``tr(Sigma) / |G|^2`` in samples; None while ``|G|^2`` is not positive (no signal yet)."""
        if not (math.isfinite(self.grad_sqr) and math.isfinite(self.grad_var)) or self.grad_sqr <= 0:
            return None
        return max(0.0, self.grad_var) / self.grad_sqr


def two_batch_estimate(small_sqr: float, inv_small: float, big_sqr: float, big_batch: float) -> tuple[float, float] | None:
    """Unbiased ``(|G|^2, tr(Sigma))`` from ``E[small_sqr] = G2 + tr * inv_small`` and
    ``E[big_sqr] = G2 + tr / big_batch``; None when the two batch sizes coincide."""
    inv_big = 1.0 / big_batch
    d = inv_small - inv_big
    if not d > 1e-12:
        return None
    tr = (small_sqr - big_sqr) / d
    g2 = big_sqr - tr * inv_big
    return g2, tr


def _sqnorm(grad: torch.Tensor) -> torch.Tensor:
    """``|grad|^2`` without a temporary the size of the gradient (a dot product; fp32 at least)."""
    g = grad.detach()
    if g.is_sparse:
        g = g.coalesce().values()
    if g.dtype not in (torch.float32, torch.float64):
        g = g.float()
    g = g.reshape(-1)
    return torch.dot(g, g)


class GradientNoise:
    """Per-step noise-scale estimator; :class:`~slurm_elastic.train.job.ElasticJob` drives it."""

    def __init__(self, base_batch: int, smoothing: float = 0.99):
        if not 0.0 < smoothing < 1.0:
            raise ValueError("smoothing must be in (0, 1)")
        self.base_batch = max(1, int(base_batch))
        self.smoothing = float(smoothing)
        self._handles: list = []
        self.active = True  # measure the current step (the job may measure only every n-th step)
        self._cur: torch.Tensor | None = None  # |grad|^2 of the micro-batch under way
        self._sum: torch.Tensor | float = 0.0  # this step: sum over micro-batches of |mean grad|^2
        self._inv = 0.0  # sum 1/n_m
        self._m = 0
        # EMA state (bias-corrected), saved in the checkpoint.
        self.ema_sqr = 0.0
        self.ema_var = 0.0
        self.ema_bias = 0.0
        self.steps = 0

    # ----- hooks -------------------------------------------------------------------------------
    def attach(self, model: torch.nn.Module) -> None:
        """Hook every trainable parameter: each backward adds that micro-batch's local |grad|^2."""
        self.detach()
        for p in model.parameters():
            if p.requires_grad:
                self._handles.append(p.register_hook(self._hook))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, grad: torch.Tensor):
        if not self.active:
            return None
        s = _sqnorm(grad)
        self._cur = s if self._cur is None else self._cur + s
        return None

    def begin_micro(self) -> None:
        self._cur = None

    def end_micro(self, samples: int, scale: float, loss_scale: float = 1.0) -> None:
        """The micro-batch of ``samples`` real samples (loss times ``scale``) finished its backward."""
        cur, self._cur = self._cur, None
        if cur is None or samples <= 0 or scale <= 0:
            return  # a weight-0 placeholder (epoch tail) or no backward: not a measurement
        w = scale * samples * loss_scale  # the hook saw w * (mean gradient of those samples)
        self._sum = self._sum + cur / (w * w)  # stays on the device: no sync per micro-batch
        self._inv += 1.0 / samples
        self._m += 1

    # ----- the step ----------------------------------------------------------------------------
    def step(self, params, global_batch: int, samples: int, device, loss_scale: float = 1.0) -> None:
        """At the optimizer step (``p.grad`` all-reduced): fold this step's estimate into the EMA.

        Every rank must call it (one all-reduce). Only steps with ``samples == global_batch`` count:
        the epoch's short last step has uneven shares and placeholders."""
        s = self._sum.double().reshape(1).cpu() if torch.is_tensor(self._sum) else torch.tensor([float(self._sum)],
                                                                                             dtype=torch.float64)
        t = torch.cat([s, torch.tensor([self._inv, float(self._m)], dtype=torch.float64)])
        self._sum, self._inv, self._m = 0.0, 0.0, 0
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            t = t.to(device)
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
            t = t.cpu()
        total, inv, m = (float(x) for x in t)
        if m <= 0 or samples != global_batch or not inv / m - 1.0 / samples > 1e-12:
            return  # nothing measured, a short step, or a single batch size (one rank, no accumulation)
        grads = [p.grad.detach() for p in params if p.grad is not None]
        if not grads:
            return
        big = float(sum(_sqnorm(g) for g in grads)) / (loss_scale * loss_scale)
        est = two_batch_estimate(total / m, inv / m, big, float(samples))
        if est is None:
            return
        self.update(*est, batch=samples)

    def discard(self) -> None:
        """Forget this step's micro-batch measurements (a step taken outside :meth:`step`)."""
        self._cur, self._sum, self._inv, self._m = None, 0.0, 0.0, 0

    def update(self, grad_sqr: float, grad_var: float, batch: int) -> None:
        if not (math.isfinite(grad_sqr) and math.isfinite(grad_var)):
            return
        theta = self.smoothing ** max(1e-3, batch / self.base_batch)
        self.ema_sqr = theta * self.ema_sqr + (1 - theta) * grad_sqr
        self.ema_var = theta * self.ema_var + (1 - theta) * grad_var
        self.ema_bias = theta * self.ema_bias + (1 - theta)
        self.steps += 1

    def estimate(self) -> NoiseEstimate | None:
        if self.ema_bias <= 0:
            return None
        return NoiseEstimate(self.ema_sqr / self.ema_bias, self.ema_var / self.ema_bias, self.steps)

    @property
    def noise_scale(self) -> float | None:
        e = self.estimate()
        return e.noise_scale if e else None

    def efficiency(self, batch: int) -> float | None:
        """``(B_noise + base_batch) / (B_noise + batch)``: samples at ``batch`` worth one at the base."""
        ns = self.noise_scale
        return None if ns is None else (ns + self.base_batch) / (ns + batch)

    def state_dict(self) -> dict:
        return {"ema_sqr": self.ema_sqr, "ema_var": self.ema_var, "ema_bias": self.ema_bias, "steps": self.steps}

    def load_state_dict(self, state: dict | None) -> None:
        if not state:
            return
        self.ema_sqr = float(state.get("ema_sqr", 0.0))
        self.ema_var = float(state.get("ema_var", 0.0))
        self.ema_bias = float(state.get("ema_bias", 0.0))
        self.steps = int(state.get("steps", 0))
