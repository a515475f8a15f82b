"""``slurm-elastic report``: what the daemon did, from its state DB, as text and a timeline PNG.

Reads only the decision log (``StateDB.decisions()``, read-only), so it works after the jobs are gone
and on a copy of the state directory; the figure is :func:`slurm_elastic.timeline.draw_timeline`.
"""

from __future__ import annotations

import time
from pathlib import Path

import click


def summarize(tl, capacity: int | None) -> str:
    """Per job: GPU-seconds and its sizes in order; then the counts of each kind of decision."""
    lines = [f"{'JOB':>8} {'GPU-S':>8}  SIZES (GPUs, batch)"]
    for job in tl.jobs:
        sizes = " -> ".join(f"{m.gpus_to}@{m.batch_to if m.batch_to is not None else '-'}"
                            for m in tl.marks if m.job == job and m.kind != "preempt")
        lines.append(f"{job:>8} {tl.gpu_seconds(job):8.0f}  {sizes}")
    c = tl.counts()
    lines.append(f"{c['start']} starts, {c['shrink']} shrinks, {c['grow']} grows, {c['rebatch']} re-batches, "
                 f"{c['preempt']} preemptions over {tl.t1 - tl.t0:.0f} s")
    if capacity:
        lines.append(f"elastic jobs held {100 * tl.utilization(capacity):.0f}% of the {capacity} managed GPUs")
    return "\n".join(lines)


@click.command()
@click.option("--state-dir", default=None, envvar="SLURM_ELASTIC_STATE_DIR",
              help="The daemon's state directory (default: state_dir of the daemon's configuration).")
@click.option("--config", "config_path", default=None, envvar="SLURM_ELASTIC_CONFIG", help="The daemon's TOML configuration.")
@click.option("-o", "--output", "output", default="elastic-timeline.png", show_default=True,
              help="Where to write the timeline PNG.")
@click.option("-j", "--jobs", "job_ids", default=None, help="Only these job ids (comma-separated).")
@click.option("--since", "since_s", type=float, default=None, help="Only the last SECONDS of the log.")
@click.option("--capacity", type=int, default=None,
              help="GPUs drawn as capacity (default: what the daemon managed at its last cycle).")
def report(state_dir, config_path, output, job_ids, since_s, capacity):
    """Print what the daemon decided and write a timeline PNG of GPUs per job (resizes marked)."""
    from slurm_elastic.daemon.state import StateDB
    from slurm_elastic.timeline import build_timeline, draw_timeline

    if state_dir is None:
        from slurm_elastic.daemon.config import ConfigError, load_config

        try:
            state_dir = load_config(config_path).state_dir
        except ConfigError as e:
            raise click.ClickException(str(e)) from e
    if not (Path(state_dir) / "state.sqlite3").exists():
        raise click.ClickException(f"no daemon state in {state_dir}: give --state-dir or --config")
    try:
        ids = {int(j) for j in (job_ids or "").split(",") if j.strip()}
    except ValueError as e:
        raise click.BadParameter(f"job ids must be integers: {job_ids!r}", param_hint="-j") from e
    db = StateDB(state_dir, readonly=True)
    try:
        rows = db.decisions()
        last = db.get_meta("last_cycle", {}) or {}
    finally:
        db.close()
    if ids:
        rows = [r for r in rows if int(r["job_id"]) in ids]
    if since_s is not None:
        rows = [r for r in rows if r["ts"] >= time.time() - since_s]
    cap = capacity if capacity is not None else (last.get("capacity") if isinstance(last.get("capacity"), int) else None)
    tl = build_timeline(rows, now=last.get("ts") if isinstance(last.get("ts"), (int, float)) else None)
    click.echo(summarize(tl, cap))
    if not tl.spans:
        raise click.ClickException("the decision log has no job that held GPUs: no timeline to draw")
    draw_timeline(tl, output, capacity=cap)
    click.echo(f"timeline written to {output}")
