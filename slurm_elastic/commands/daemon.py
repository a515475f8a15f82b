"""``slurm-elastic daemon`` (the scheduler) and ``slurm-elastic plan`` (what its next cycle would do)."""

from __future__ import annotations

import json
import sys

import click

from slurm_elastic.daemon.config import DEFAULT_PATH, ConfigError, load_config

config_option = click.option(
    "--config", "config_path", type=click.Path(dir_okay=False), default=None, envvar="SLURM_ELASTIC_CONFIG",
    help=f"TOML configuration (default {DEFAULT_PATH}; a missing default file means built-in defaults).",
)


def _load(config_path, **overrides):
    try:
        return load_config(config_path, overrides={k: v for k, v in overrides.items() if v is not None})
    except ConfigError as e:
        raise click.ClickException(str(e)) from e


@click.command()
@config_option
@click.option("--once", is_flag=True, help="Run one cycle (and finish what it starts, up to the ack timeout), then exit.")
@click.option("--dry-run", is_flag=True, help="Read, solve and log decisions, but change nothing in Slurm.")
@click.option("--state-dir", default=None, help="Override the configuration's state_dir.")
@click.option("--poll-interval", "poll_interval_s", type=float, default=None, help="Override poll_interval_s.")
def daemon(config_path, once, dry_run, state_dir, poll_interval_s):
    """Run the elastic scheduling daemon against the Slurm that SLURM_CONF points at.

    Reload the configuration with SIGHUP; stop cleanly with SIGTERM. Only one daemon may run per
    state directory.
    """
    from slurm_elastic.backends.base import SlurmError
    from slurm_elastic.daemon.loop import Daemon, setup_logging
    from slurm_elastic.daemon.state import LockHeld
    from slurm_elastic.daemon.watchdog import sd_notify

    cfg = _load(config_path, state_dir=state_dir, poll_interval_s=poll_interval_s)
    setup_logging(cfg.log_level)
    try:
        d = Daemon(cfg, config_path=config_path, dry_run=dry_run)
    except SlurmError as e:  # no backend can be used (e.g. SLURM_CONF names no file): say so, no traceback
        raise click.ClickException(str(e)) from e
    # Signals and the watchdog first: a SIGTERM or a stall during the reconcile at start is handled too.
    d.install_signals()
    d.watchdog.start()
    try:
        d.open()
    except (LockHeld, ConfigError) as e:
        d.watchdog.close()
        raise click.ClickException(str(e)) from e
    except OSError as e:
        d.watchdog.close()
        raise click.ClickException(f"cannot open the state directory {cfg.state_dir}: {e}") from e
    sd_notify("READY=1")
    try:
        if once:
            d.cycle()
            import time

            deadline = time.monotonic() + cfg.ack_timeout_s
            while d.enactor.in_flight and not dry_run and time.monotonic() < deadline and not d.stop_event.is_set():
                d.watchdog.progress("finishing in-flight resizes")
                time.sleep(1.0)
                d.records = {j.job_id: j for j in d.backend.list_jobs()}
                d.enactor.poll()
                d.db.save_books(d.state.books)
        else:
            d.run_forever()
    finally:
        d.close()


@click.command()
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def plan(config_path, as_json):
    """Print what the daemon's next cycle would do (allocation and actions), without doing it."""
    from slurm_elastic.backends.base import SlurmError
    from slurm_elastic.daemon.loop import Daemon

    cfg = _load(config_path)
    try:
        d = Daemon(cfg, dry_run=True)
    except SlurmError as e:
        raise click.ClickException(str(e)) from e
    try:
        from slurm_elastic.daemon.state import StateDB

        d.state.books = StateDB(cfg.state_dir, readonly=True).load_books()
    except (FileNotFoundError, OSError, Exception):
        pass
    d.enactor = None
    try:
        result = d.cycle()
    except SlurmError as e:
        raise click.ClickException(f"cannot read Slurm: {e}") from e
    if result is None:
        raise click.ClickException("cannot read Slurm (see the log line above)")
    snap = result.snapshot
    rows = []
    for v in snap.views:
        a = result.allocation.jobs.get(v.job_id)
        act = next((x for x in result.plan.actions if x.job_id == v.job_id), None)
        rows.append({"job_id": v.job_id, "status": v.status, "gpus_now": v.gpus, "gpus_next": a.gpus if a else None,
                     "batch_next": a.batch if a else None, "action": act.kind if act else "leave",
                     "reason": d.policy.noted(v.job_id, (act.reason if act else "") or (a.reason if a else ""))})
    errors = {str(j): str(e) for j, e in snap.errors.items()}
    if as_json:
        json.dump({"policy": cfg.policy, "capacity": snap.capacity, "objective": result.allocation.objective,
                   "jobs": rows, "spec_errors": errors}, sys.stdout, indent=2)
        click.echo()
        return
    click.echo(f"policy {cfg.policy}: {snap.capacity} GPUs for elastic jobs, objective "
               f"{result.allocation.objective:.3f}, solved in {result.allocation.solve_s * 1000:.1f} ms")
    click.echo(f"{'JOBID':>8} {'STATUS':<10} {'GPUS':>4} {'NEXT':>4} {'BATCH':>6} {'ACTION':<8} REASON")
    for r in rows:
        click.echo(f"{r['job_id']:>8} {r['status']:<10} {r['gpus_now']:>4} {str(r['gpus_next'] or 0):>4} "
                   f"{str(r['batch_next'] or '-'):>6} {r['action']:<8} {r['reason']}")
    for j, e in errors.items():
        click.echo(f"{j:>8} bad spec: {e}")
