"""Non-negative least squares (Lawson & Hanson 1974, active-set), in numpy only.

scipy is a development dependency; the daemon fits profiles online without it. The tests compare
this against ``scipy.optimize.nnls``.
"""

from __future__ import annotations

import numpy as np


def nnls(A: np.ndarray, b: np.ndarray, max_iter: int | None = None, tol: float | None = None):
    """``argmin ||A x - b||_2`` subject to ``x >= 0``; returns ``(x, residual_norm)``."""
    A = np.asarray(A, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    m, n = A.shape
    if max_iter is None:
        max_iter = 3 * n + 30
    if tol is None:
        tol = 10 * max(m, n) * np.finfo(float).eps * max(1.0, np.abs(A).max(initial=0.0))
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = A.T @ (b - A @ x)
    it = 0
    while (~passive).any() and w[~passive].max(initial=-np.inf) > tol and it < max_iter:
        it += 1
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            idx = np.flatnonzero(passive)
            z[idx] = np.linalg.lstsq(A[:, idx], b, rcond=None)[0]
            if (z[idx] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = np.min(x[neg] / (x[neg] - z[neg]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
            if not passive.any():
                break
        w = A.T @ (b - A @ x)
    return x, float(np.linalg.norm(A @ x - b))
