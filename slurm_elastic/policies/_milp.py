"""The same multiple-choice knapsack as a MILP for ``scipy.optimize.milp`` (HiGHS): a cross-check.

One binary per (job, choice); each job picks exactly one; total weight <= capacity. scipy is a
development dependency, imported only when this is called (benchmarks and tests).
"""

from __future__ import annotations

import numpy as np


def mckp_milp(offsets, weights, values, capacity: int, time_limit: float = 60.0):
    """``(objective, chosen)`` or ``(None, None)`` when HiGHS does not prove optimality in time."""
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import csr_matrix, vstack

    offsets = np.asarray(offsets, dtype=np.int64)
    weights = np.asarray(weights, dtype=np.float64)
    values = np.asarray(values, dtype=np.float64)
    n_jobs, n = offsets.size - 1, weights.size
    rows = np.repeat(np.arange(n_jobs), np.diff(offsets))
    one = csr_matrix((np.ones(n), (rows, np.arange(n))), shape=(n_jobs, n))
    cap = csr_matrix(weights.reshape(1, -1))
    A = vstack([one, cap]).tocsr()
    lo = np.concatenate([np.ones(n_jobs), [-np.inf]])
    hi = np.concatenate([np.ones(n_jobs), [float(capacity)]])
    res = milp(
        -values,
        constraints=LinearConstraint(A, lo, hi),
        integrality=np.ones(n),
        bounds=Bounds(0, 1),
        options={"time_limit": float(time_limit), "mip_rel_gap": 1e-9, "presolve": True},
    )
    if res.status != 0 or res.x is None:
        return None, None
    x = res.x > 0.5
    chosen = np.array([offsets[j] + int(np.argmax(x[offsets[j]:offsets[j + 1]])) for j in range(n_jobs)],
                      dtype=np.int64)
    return float(values[chosen].sum()), chosen
