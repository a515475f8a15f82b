"""Exact multiple-choice knapsack: each job takes exactly one of its choices, total weight <= capacity.

``mckp(offsets, weights, values, capacity)`` maximises the sum of values. Job ``j`` owns choices
``offsets[j]:offsets[j+1]``, listed by non-decreasing weight, and its first choice must have weight 0
(every job the allocator passes here may stay at its guaranteed minimum). It returns
``(objective, chosen)`` with ``chosen[j]`` the index (into the flat arrays) of job ``j``'s choice.

The numba kernel (``cache=True``) is a dynamic program over capacity with three savings, all exact:

1. dominated choices (weight >= a cheaper choice's, value <= it) are dropped up front;
2. stage ``j`` only computes capacities in ``[C - rem_j, min(C, cum_j)]``, where ``cum_j`` is the most
   jobs ``0..j`` can use and ``rem_j`` the most jobs ``j+1..`` can still add (``C = min(capacity,
   total)``); ``dp_j`` means "best with at most ``c`` used", so beyond ``cum_j`` it is flat;
3. the inner loop runs over capacities for one choice at a time, on array slices (contiguous,
   vectorised by LLVM); the arg-max row is copied into the reconstruction table once per job.

Reconstruction keeps one small integer per (job, capacity in its window): int16 when no job has
more than 32,767 choices, int32 otherwise. See docs/ALGORITHM.md for complexity and memory.

:func:`mckp_reference` is the same DP in plain Python (no windows, no pruning): the benchmark's
baseline and the tests' cross-check.
"""

from __future__ import annotations

import time

import numpy as np
from numba import njit


@njit(cache=True)
def _prune(offsets, weights, values, capacity):
    """Drop dominated and over-capacity choices. Returns (offsets, weights, values, orig index)."""
    n_jobs = offsets.size - 1
    new_off = np.empty(n_jobs + 1, np.int64)
    new_w = np.empty(weights.size, np.int64)
    new_v = np.empty(weights.size, np.float64)
    new_i = np.empty(weights.size, np.int64)
    p = 0
    new_off[0] = 0
    for j in range(n_jobs):
        best = -np.inf
        for i in range(offsets[j], offsets[j + 1]):
            w = weights[i]
            if w > capacity:
                break
            if values[i] > best:
                # same weight as the previous kept choice but better: replace it
                if p > new_off[j] and new_w[p - 1] == w:
                    p -= 1
                new_w[p] = w
                new_v[p] = values[i]
                new_i[p] = i
                p += 1
                best = values[i]
        new_off[j + 1] = p
    return new_off, new_w[:p], new_v[:p], new_i[:p]


@njit(cache=True)
def _relax(p, q, g, v, a):
    """``q[i] = max(q[i], p[i] + v)``, recording ``a`` in ``g[i]`` where it wins.

    Called on slices, so that LLVM sees plain non-negative, non-wrapping indices and vectorises it.
    """
    for i in range(q.size):
        cand = p[i] + v
        if cand > q[i]:
            q[i] = cand
            g[i] = a


@njit(cache=True)
def _windows(offsets, weights, capacity):
    n_jobs = offsets.size - 1
    total = 0
    for j in range(n_jobs):
        total += weights[offsets[j + 1] - 1]
    cap = min(capacity, total)
    lo_arr = np.empty(n_jobs, np.int64)
    hi_arr = np.empty(n_jobs, np.int64)
    toff = np.empty(n_jobs + 1, np.int64)
    rem = total
    cum = 0
    toff[0] = 0
    for j in range(n_jobs):
        wm = weights[offsets[j + 1] - 1]
        rem -= wm
        cum += wm
        lo_arr[j] = max(0, cap - rem)
        hi_arr[j] = min(cap, cum)
        toff[j + 1] = toff[j] + hi_arr[j] - lo_arr[j] + 1
    return cap, lo_arr, hi_arr, toff


@njit(cache=True)
def _dp(offsets, weights, values, cap, lo_arr, hi_arr, toff, table, arg):
    """The windowed DP; ``table[toff[j] + c - lo_j]`` gets job j's arg-max choice at capacity c.

    ``arg`` is a scratch row (same dtype as ``table``) copied into the table once per job: one
    sequential write of the big table per job is faster than every choice writing into it.
    """
    n_jobs = offsets.size - 1
    prev = np.zeros(cap + 1)
    cur = np.empty(cap + 1)
    plo = 0
    phi = 0
    for j in range(n_jobs):
        lo = lo_arr[j]
        hi = hi_arr[j]
        base = offsets[j]
        # choice 0 (weight 0) reaches every cell: start from it (so no -inf is ever needed);
        # beyond the previous window dp is flat at prev[phi] ("at most c GPUs")
        v0 = values[base]
        for c in range(lo, min(hi, phi) + 1):
            cur[c] = prev[c] + v0
        flat = prev[phi] + v0
        for c in range(max(lo, phi + 1), hi + 1):
            cur[c] = flat
        arg[lo:hi + 1] = 0
        for i in range(base + 1, offsets[j + 1]):
            w = weights[i]
            v = values[i]
            a = i - base
            # part A: c - w inside the previous window
            c0 = max(lo, plo + w)
            c1 = min(hi, phi + w)
            if c1 >= c0:
                _relax(prev[c0 - w:c1 - w + 1], cur[c0:c1 + 1], arg[c0:c1 + 1], v, a)
            # part B: c - w beyond the previous window, where dp is flat at prev[phi]
            cand = prev[phi] + v
            for c in range(max(lo, phi + w + 1), hi + 1):
                if cand > cur[c]:
                    cur[c] = cand
                    arg[c] = a
        t0 = toff[j]
        table[t0:t0 + hi - lo + 1] = arg[lo:hi + 1]
        prev, cur = cur, prev
        plo = lo
        phi = hi
    return prev[phi]


@njit(cache=True)
def _reconstruct(offsets, weights, table, lo_arr, hi_arr, toff, cap, chosen):
    n_jobs = offsets.size - 1
    c = cap
    for j in range(n_jobs - 1, -1, -1):
        if c > hi_arr[j]:
            c = hi_arr[j]
        a = table[toff[j] + c - lo_arr[j]]
        i = offsets[j] + a
        chosen[j] = i
        c -= weights[i]


def mckp(offsets, weights, values, capacity: int):
    """Solve exactly; returns ``(objective, chosen)`` (see the module docstring)."""
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    weights = np.ascontiguousarray(weights, dtype=np.int64)
    values = np.ascontiguousarray(values, dtype=np.float64)
    n_jobs = offsets.size - 1
    if n_jobs == 0:
        return 0.0, np.empty(0, np.int64)
    starts = weights[offsets[:-1]]
    if (np.diff(offsets) < 1).any() or (starts != 0).any():
        raise ValueError("every job needs at least one choice, and its first choice must weigh 0")
    same_job = np.ones(max(0, weights.size - 1), dtype=bool)
    same_job[offsets[1:-1] - 1] = False
    if (np.diff(weights)[same_job] < 0).any():
        raise ValueError("each job's choices must be listed by non-decreasing weight")
    capacity = max(0, int(capacity))
    off2, w2, v2, idx = _prune(offsets, weights, values, capacity)
    kmax = int(np.diff(off2).max())
    dtype = np.int16 if kmax <= np.iinfo(np.int16).max else np.int32
    cap, lo_arr, hi_arr, toff = _windows(off2, w2, capacity)
    table = np.empty(int(toff[-1]), dtype)
    obj = _dp(off2, w2, v2, cap, lo_arr, hi_arr, toff, table, np.empty(cap + 1, dtype))
    chosen = np.empty(n_jobs, np.int64)
    _reconstruct(off2, w2, table, lo_arr, hi_arr, toff, cap, chosen)
    return float(obj), idx[chosen]


def dp_stats(offsets, weights, values, capacity: int) -> dict:
    """Sizes of the DP the kernel would run: jobs, choices kept, capacity, table cells."""
    off2, w2, _, _ = _prune(np.asarray(offsets, np.int64), np.asarray(weights, np.int64),
                            np.asarray(values, np.float64), int(capacity))
    cap, _, _, toff = _windows(off2, w2, int(capacity))
    kmax = int(np.diff(off2).max()) if off2.size > 1 else 0
    return {
        "jobs": int(off2.size - 1),
        "choices": int(w2.size),
        "capacity": int(cap),
        "table_cells": int(toff[-1]),
        "table_bytes": int(toff[-1]) * (2 if kmax <= np.iinfo(np.int16).max else 4),
    }


def warm_up() -> float:
    """Compile (or load from numba's cache) every kernel; returns the seconds it took."""
    t = time.perf_counter()
    mckp(np.array([0, 2, 4]), np.array([0, 1, 0, 2]), np.array([0.0, 1.0, 0.0, 1.5]), 2)
    return time.perf_counter() - t


def mckp_reference(offsets, weights, values, capacity: int):
    """The same problem by a textbook DP in plain Python lists (slow; for baselines and tests)."""
    n_jobs = len(offsets) - 1
    cap = max(0, int(capacity))
    neg = float("-inf")
    dp = [0.0] * (cap + 1)
    choice_rows = []
    for j in range(n_jobs):
        new = [neg] * (cap + 1)
        arg = [-1] * (cap + 1)
        for i in range(int(offsets[j]), int(offsets[j + 1])):
            w = int(weights[i])
            v = float(values[i])
            for c in range(w, cap + 1):
                cand = dp[c - w] + v
                if cand > new[c]:
                    new[c] = cand
                    arg[c] = i
        dp = new
        choice_rows.append(arg)
    best_c = max(range(cap + 1), key=lambda c: dp[c])
    chosen = [0] * n_jobs
    c = best_c
    for j in range(n_jobs - 1, -1, -1):
        i = choice_rows[j][c]
        chosen[j] = i
        c -= int(weights[i])
    return dp[best_c], np.array(chosen, dtype=np.int64)
