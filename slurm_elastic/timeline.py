"""GPUs per job over time, from the daemon's decision log: what ``slurm-elastic report`` and the demo draw.

Why: a decision log is a list of reasons; a sysadmin deciding whether elasticity pays wants to see the
GPUs it kept busy and where it moved them. :func:`build_timeline` is pure (rows in, spans and marks
out); :func:`draw_timeline` writes the PNG with matplotlib's Agg backend, imported only there.

The log gives when the daemon acted, not when a job's tasks ran, so the spans are the daemon's view:
a job holds ``gpus_to`` from its ``start``/``resize`` row with status ``done`` (placed at that size)
until its next such row, its ``preempt`` or its ``end`` row (logged when Slurm no longer lists it).
After a resize the job is restarting until its first step, which the daemon logs as a ``measure`` /
``restart-cost`` row: that window is drawn hatched on the new size (so is the window between a
``begun`` and a ``done`` row, where a log has them).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Span:
    """``job`` held ``gpus`` at global ``batch`` from ``start`` to ``end`` (wall-clock seconds)."""

    job: str
    start: float
    end: float
    gpus: int
    batch: int | None = None
    restarting: bool = False  # the window between a resize's signal and its new start


@dataclass(frozen=True)
class Mark:
    """One decision worth pointing at: a start, shrink, grow, re-batch or preemption, with its reason."""

    job: str
    ts: float
    kind: str  # start | shrink | grow | rebatch | preempt
    gpus_from: int | None
    gpus_to: int | None
    batch_from: int | None
    batch_to: int | None
    reason: str

    def label(self) -> str:
        size = (f"{self.gpus_to} GPUs" if self.kind == "start"
                else f"{self.gpus_from}->{self.gpus_to} GPUs")
        batch = ""
        if self.batch_to is not None:
            batch = (f", batch {self.batch_from}->{self.batch_to}"
                     if self.batch_from not in (None, self.batch_to) else f", batch {self.batch_to}")
        return f"job {self.job} {self.kind} {size}{batch}: {self.reason}"


@dataclass
class Timeline:
    spans: list[Span] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    t0: float = 0.0
    t1: float = 0.0

    @property
    def jobs(self) -> list[str]:
        seen: dict[str, None] = {}
        for s in sorted(self.spans, key=lambda s: s.start):
            seen.setdefault(s.job, None)
        return list(seen)

    def gpu_seconds(self, job: str | None = None) -> float:
        return sum((s.end - s.start) * s.gpus for s in self.spans if job is None or s.job == job)

    def utilization(self, capacity: int) -> float:
        """GPU-seconds held over capacity x the timeline's length (0 when either is 0)."""
        length = self.t1 - self.t0
        return self.gpu_seconds() / (capacity * length) if capacity > 0 and length > 0 else 0.0

    def counts(self) -> dict[str, int]:
        out = {k: 0 for k in ("start", "shrink", "grow", "rebatch", "preempt")}
        for m in self.marks:
            out[m.kind] = out.get(m.kind, 0) + 1
        return out


def build_timeline(decisions: list[dict], now: float | None = None) -> Timeline:
    """Spans and marks from decision-log rows (``StateDB.decisions()``: ts, job_id, action, status,
    gpus_from, gpus_to, batch, reason); a job still holding GPUs at the end is drawn until ``now``
    (default: the last row's time)."""
    rows = sorted(decisions, key=lambda d: (d["ts"], d.get("id") or 0))
    tl = Timeline()
    if not rows:
        return tl
    tl.t0 = rows[0]["ts"]
    tl.t1 = max(rows[-1]["ts"], now if now is not None else rows[-1]["ts"])
    open_: dict[str, tuple[float, int, int | None]] = {}  # job -> (since, gpus, batch)
    restart_at: dict[str, float] = {}
    resized: set[str] = set()  # resized, first step at the new size not yet logged

    def close(job: str, ts: float) -> tuple[int, int | None] | None:
        cur = open_.pop(job, None)
        if cur is None:
            return None
        since, gpus, batch = cur
        began = restart_at.pop(job, None)
        if began is not None and since <= began < ts:
            tl.spans.append(Span(job, since, began, gpus, batch))
            tl.spans.append(Span(job, began, ts, gpus, batch, restarting=True))
        elif ts > since:
            tl.spans.append(Span(job, since, ts, gpus, batch))
        return gpus, batch

    for d in rows:
        job, ts, action, status = str(d["job_id"]), float(d["ts"]), d["action"], d["status"]
        if action == "measure" and status == "restart-cost":
            if job in resized and job in open_:
                since, gpus, batch = open_.pop(job)
                if ts > since:
                    tl.spans.append(Span(job, since, ts, gpus, batch, restarting=True))
                open_[job] = (ts, gpus, batch)
            resized.discard(job)
            continue
        if action == "resize" and status == "begun":
            if job in open_:
                restart_at[job] = ts
            continue
        if status != "done":
            if action == "resize":
                restart_at.pop(job, None)  # timed out or failed: the job kept its size
            continue
        if action in ("start", "resize"):
            prev = close(job, ts)
            gpus, batch = int(d["gpus_to"] or 0), d.get("batch")
            g0, b0 = prev if prev else (d.get("gpus_from"), None)
            if action == "start":
                kind = "start"
            elif g0 is not None and gpus < g0:
                kind = "shrink"
            elif g0 is not None and gpus > g0:
                kind = "grow"
            else:
                kind = "rebatch"
            tl.marks.append(Mark(job, ts, kind, g0, gpus, b0, batch, d.get("reason") or ""))
            if gpus > 0:
                open_[job] = (ts, gpus, batch)
            if action == "resize":
                resized.add(job)
        elif action == "preempt":
            prev = close(job, ts)
            tl.marks.append(Mark(job, ts, "preempt", prev[0] if prev else None, 0, prev[1] if prev else None,
                                 None, d.get("reason") or ""))
        elif action == "end":
            close(job, ts)
    for job in list(open_):
        close(job, tl.t1)
    return tl


def draw_timeline(tl: Timeline, path, *, capacity: int | None = None, extra: list[Span] = (),
                  names: dict[str, str] | None = None, title: str = "GPUs per job over time",
                  note: str = "") -> None:
    """Write the timeline as a PNG: GPUs per job stacked over time, resizes marked and numbered, the
    decisions' reasons listed under the plot. ``extra``: spans the log does not have (a non-elastic job);
    ``names``: labels for job ids (e.g. the demo's A, B, C)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = names or {}
    spans = list(extra) + list(tl.spans)
    if not spans:
        raise ValueError("nothing to draw: the decision log has no job that held GPUs")
    t0 = min(min(s.start for s in spans), tl.t0 if tl.spans else float("inf"))
    t1 = max(max(s.end for s in spans), tl.t1)
    jobs = [s.job for s in extra] + [j for j in tl.jobs if j not in {s.job for s in extra}]
    jobs = list(dict.fromkeys(jobs))
    edges = sorted({t0, t1, *(s.start for s in spans), *(s.end for s in spans)})
    marks = [m for m in tl.marks if m.kind != "start"]
    lines = [f"{i}. t={m.ts - t0:5.0f}s  {m.label().replace('job ' + m.job, 'job ' + names.get(m.job, m.job), 1)}"
             for i, m in enumerate(marks, 1)]
    wrapped = [ln if len(ln) <= 150 else ln[:147] + "..." for ln in lines]
    fig_h = 5.0 + 0.22 * max(1, len(wrapped))
    fig = plt.figure(figsize=(12, fig_h))
    ax = fig.add_axes((0.07, 1.0 - 4.3 / fig_h, 0.75, 3.8 / fig_h))
    cmap = plt.get_cmap("tab10")
    bottom = [0.0] * (len(edges) - 1)
    for ji, job in enumerate(jobs):
        color = (0.6, 0.6, 0.6) if job in {s.job for s in extra} else cmap(ji % 10)
        label = names.get(job, f"job {job}")
        first = True
        for s in (s for s in spans if s.job == job):
            for i in range(len(edges) - 1):
                a, b = edges[i], edges[i + 1]
                if s.start <= a and b <= s.end:
                    ax.bar(a - t0, s.gpus, width=b - a, bottom=bottom[i], align="edge", color=color,
                           edgecolor="white" if not s.restarting else color, linewidth=0.3,
                           hatch="///" if s.restarting else None, alpha=0.35 if s.restarting else 0.9,
                           label=label if first else None)
                    first = False
                    bottom[i] += s.gpus
    if capacity:
        ax.axhline(capacity, color="black", linestyle="--", linewidth=1, label=f"capacity ({capacity} GPUs)")
    for i, m in enumerate(marks, 1):
        ax.axvline(m.ts - t0, color="black", linewidth=0.6, alpha=0.5)
        ax.annotate(str(i), (m.ts - t0, (capacity or max(bottom)) * 1.02), ha="center", fontsize=8)
    ax.set_xlim(0, t1 - t0)
    ax.set_ylim(0, (capacity or max(bottom)) * 1.12)
    ax.set_xlabel("seconds")
    ax.set_ylabel("GPUs")
    ax.set_title(title + (f"  ({note})" if note else ""), fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.text(0.01, 1.0 - 4.95 / fig_h, "\n".join(wrapped) or "no resizes", fontsize=7.5, family="monospace",
             va="top")
    fig.savefig(path, dpi=110)
    plt.close(fig)
