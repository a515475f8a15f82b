"""Text tables and PNG figures of simulation results.

Figures use matplotlib (the ``dev`` extra) with the non-interactive Agg backend, imported only when
a figure is drawn; :func:`have_matplotlib` tells whether it is installed.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from slurm_elastic.sim.engine import SimResult


def have_matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _plt():
    if not have_matplotlib():
        raise RuntimeError("PNG figures need matplotlib: pip install 'slurm-elastic[dev]' (or matplotlib)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    if x >= 3600:
        return f"{x / 3600:.2f} h"
    if x >= 60:
        return f"{x / 60:.1f} min"
    return f"{x:.0f} s"


def table(metrics: Mapping[str, dict]) -> str:
    """A fixed-width table, one row per policy."""
    cols = ["policy", "done", "avg JCT", "median JCT", "p95 JCT", "avg queue", "GPU util", "rescales", "makespan"]
    rows = []
    for name, m in metrics.items():
        rows.append([
            name, f"{m['jobs_completed']}/{m['jobs_total']}", fmt_s(m["avg_jct_s"]), fmt_s(m["median_jct_s"]),
            fmt_s(m["p95_jct_s"]), fmt_s(m["avg_queue_s"]), f"{m['gpu_utilization']:.1%}", str(m["rescales"]),
            fmt_s(m["makespan_s"]),
        ])
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    line = lambda r: "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths, strict=True)))  # noqa: E731
    return "\n".join([line(cols)] + [line(r) for r in rows])


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def plot_jct_cdf(results: Mapping[str, SimResult], path: str | Path, title: str = "JCT CDF") -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 4), dpi=110)
    for name, r in results.items():
        jct = np.sort([j.jct_s for j in r.jobs if j.jct_s is not None]) / 3600.0
        if len(jct):
            ax.step(jct, np.arange(1, len(jct) + 1) / len(r.jobs), where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (h, log scale)")
    ax.set_ylabel("fraction of jobs completed")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_utilization(results: Mapping[str, SimResult], path: str | Path, title: str = "GPU utilization") -> Path:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=110)
    for name, r in results.items():
        if not r.timeline:
            continue
        t = np.array([p[0] for p in r.timeline]) / 3600.0
        u = np.array([p[1] for p in r.timeline]) / r.config.total_gpus
        ax.step(t, u, where="post", label=name, linewidth=1)
    ax.set_xlabel("time (h)")
    ax.set_ylabel("GPUs allocated / cluster")
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_sweep(rates: Sequence[float], metrics: Mapping[str, Sequence[dict]], path: str | Path,
               title: str = "Arrival-rate sweep") -> Path:
    """Jobs completed and average JCT against arrival rate, one line per policy."""
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=110)
    for name, ms in metrics.items():
        a1.plot(rates, [m["jobs_completed"] for m in ms], marker="o", label=name)
        a2.plot(rates, [(m["avg_jct_s"] or np.nan) / 3600.0 for m in ms], marker="o", label=name)
    a1.set_xlabel("arrival rate (jobs/h)")
    a1.set_ylabel("jobs completed within the horizon")
    a2.set_xlabel("arrival rate (jobs/h)")
    a2.set_ylabel("average JCT (h)")
    a2.set_yscale("log")
    for a in (a1, a2):
        a.grid(True, alpha=0.3)
        a.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path)
    plt.close(fig)
    return path
