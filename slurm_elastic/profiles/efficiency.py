"""Statistical efficiency of a batch size from the gradient noise scale (Pollux / AdaScale form).

A sample processed at global batch ``b`` is worth ``efficiency(b)`` of a sample at the job's reference
batch ``base_batch`` (McCandlish et al. 2018; Pollux, OSDI'21, eq. 6):

    efficiency(b) = (noise_scale + base_batch) / (noise_scale + b)

``noise_scale`` is the gradient noise scale B_noise = tr(Sigma) / |G|^2 in samples. A large noise scale
(late in training, noisy gradients) lets big batches stay efficient; a small one makes every sample
above ``base_batch`` partly wasted. ``goodput(k, b) = throughput(k, b) x efficiency(b)``.
"""

from __future__ import annotations

import math

import numpy as np


def efficiency(batch, noise_scale: float, base_batch: float) -> np.ndarray:
    """``(noise_scale + base_batch) / (noise_scale + batch)`` elementwise (1 at ``base_batch``)."""
    b = np.asarray(batch, dtype=np.float64)
    ns = max(0.0, float(noise_scale))
    return (ns + float(base_batch)) / (ns + np.maximum(b, 1e-9))


def noise_scale_from_stats(grad_sqr: float, grad_var: float, base_batch: float) -> float | None:
    """B_noise in samples from Pollux's per-epoch gradient statistics.

    ``grad_var`` is the variance of the mean gradient at ``base_batch`` (tr(Sigma)/base_batch) and
    ``grad_sqr`` the squared norm of the true gradient, so B_noise = base_batch x grad_var / grad_sqr.
    None when the statistics are not finite and positive.
    """
    if not (math.isfinite(grad_sqr) and math.isfinite(grad_var)) or grad_sqr <= 0 or grad_var < 0:
        return None
    return float(base_batch) * grad_var / grad_sqr


def efficiency_fn(noise_scale: float, base_batch: float):
    """``batch_array -> efficiency`` closure for one job (what the batch tables take)."""
    ns, b0 = float(noise_scale), float(base_batch)

    def fn(batch) -> np.ndarray:
        return efficiency(batch, ns, b0)

    return fn
