"""``slurm-elastic status``: elastic jobs in an squeue-style table (or JSON).

Columns come from Slurm (state, GPUs, nodes, restarts) plus the elastic spec in the job's Comment and
the daemon's decision in its AdminComment. Like squeue: ``-o/--format`` picks columns,
``-h/--noheader`` drops the header, ``--json`` prints one object, ``-u``/``-j``/``-p`` filter.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click

from slurm_elastic.backends.base import ACTIVE_STATES, JobRecord, SlurmError
from slurm_elastic.spec import SpecError, is_elastic_comment, parse_decision, parse_spec

# squeue's compact state codes (%t).
STATE_CODES = {
    "PENDING": "PD", "RUNNING": "R", "SUSPENDED": "S", "COMPLETING": "CG", "COMPLETED": "CD",
    "CANCELLED": "CA", "FAILED": "F", "TIMEOUT": "TO", "NODE_FAIL": "NF", "PREEMPTED": "PR",
    "BOOT_FAIL": "BF", "DEADLINE": "DL", "OUT_OF_MEMORY": "OOM",
}


@dataclass(frozen=True)
class Column:
    key: str
    header: str
    width: int
    right: bool = False


COLUMNS = {
    c.key: c
    for c in [
        Column("jobid", "JOBID", 8, True),
        Column("partition", "PARTITION", 9),
        Column("name", "NAME", 12),
        Column("user", "USER", 8),
        Column("st", "ST", 3),
        Column("gpus", "GPUS", 4, True),
        Column("range", "RANGE", 7),
        Column("nodes", "NODES", 5, True),
        Column("batch", "BATCH", 6, True),
        Column("samples_per_s", "SAMPLES/S", 9, True),
        Column("efficiency", "EFFICIENCY", 10, True),
        Column("rescales", "RESCALES", 8, True),
        Column("restart", "RESTART", 18),
        Column("model", "MODEL", 16),
        Column("progress", "DONE", 6),
        Column("last_change", "LAST-CHANGE", 19),
        Column("reason", "REASON", 30),
    ]
}
DEFAULT_FORMAT = ("jobid,partition,name,user,st,gpus,range,nodes,batch,samples_per_s,efficiency,rescales,restart,model,"
                  "progress,last_change,reason")


def job_row(job: JobRecord) -> dict:
    """One status row from a job's Slurm record (spec, decision and Slurm's own view)."""
    row = {
        "jobid": job.job_id,
        "partition": job.partition,
        "name": job.name,
        "user": job.user,
        "state": job.state,
        "st": STATE_CODES.get(job.state, job.state[:2]),
        "gpus": job.gpus_total,
        "nodes": job.node_count,
        "rescales": job.restart_count,
        "held": job.held,
        "range": "-",
        "min_gpus": None,
        "max_gpus": None,
        "batch": None,
        "samples_per_s": None,
        "efficiency": None,
        "last_change": None,
        "model": None,  # the daemon's model provenance: profile, declared, fitted from N reports, prior
        "paced": None,  # the spec's pace= profile: emulated GPUs, its speed is the profile's (train/pacing.py)
        "progress": None,  # the share of its reported work done, "unused" when the claim is not trusted
        "elastic": is_elastic_comment(job.comment),
        "spec_error": None,
        "limits": None,  # per-type batch limits learned from out-of-memory failures (daemon/oom.py)
        "reason": job.state_reason if job.state_reason not in ("None", "") else "",
    }
    if row["elastic"]:
        try:
            spec = parse_spec(job.comment, job.job_id)
            row.update(range=f"{spec.min_gpus}-{spec.max_gpus}", min_gpus=spec.min_gpus, max_gpus=spec.max_gpus,
                       batch=spec.requested_batch, paced=spec.pace)
        except SpecError as e:
            row["spec_error"] = str(e)
            row["reason"] = f"bad spec: {e.reason} ({e.field})"
        try:
            decision = parse_decision(job.admin_comment, job.job_id)
            if decision is not None:
                row["batch"] = decision.batch
        except SpecError as e:
            row["reason"] = f"bad decision: {e.reason}"
    if job.held and job.is_pending and not row["reason"].startswith("bad"):
        row["reason"] = row["reason"] or "held"
    return row


def merge_daemon_view(row: dict, view: dict | None) -> dict:
    """Add what the daemon recorded for this job in its last cycle (throughput, efficiency, reason)."""
    if not view:
        return row
    row = dict(row)
    for key in ("samples_per_s", "efficiency", "model", "model_uncertainty", "noise_scale", "restart_s",
                "restart_from"):
        if view.get(key) is not None:
            row[key] = view[key]
    if view.get("restart_s") is not None:  # the restart cost the daemon plans with, and where it comes from
        src = view.get("restart_from")
        row["restart"] = f"{view['restart_s']:.0f}s" + (f"({src})" if src else "")
    if view.get("rescales") is not None:
        row["rescales"] = view["rescales"]
    if view.get("last_change"):
        row["last_change"] = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(view["last_change"]))
    if view.get("target_gpus") is not None:
        row["target_gpus"] = view["target_gpus"]
    if view.get("reason") and not row["reason"].startswith("bad"):
        row["reason"] = view["reason"]
    if view.get("model"):  # where the job's throughput model comes from (report, profile, default)
        row["model"] = view["model"]
        row["progress"] = progress_of(view["model"])
    limits = view.get("limits")
    if isinstance(limits, list) and limits:  # per-type batch limits learned from out-of-memory failures
        row["limits"] = "; ".join(str(x) for x in limits)
        row["reason"] = f"{row['reason']}; {row['limits']}".lstrip("; ")
    if view.get("report_error"):
        row["report_error"] = view["report_error"]
        row["reason"] = f"{row['reason']}; report not used: {view['report_error']}".lstrip("; ")
    return row


# The decision-log actions a user sees; the daemon also logs its own measurements there ("measure").
USER_EVENTS = ("start", "resize", "preempt", "hold", "requeue-failed")


def event_text(d: dict) -> str:
    """One decision-log row in words: ``resize 2->4 GPUs, batch 128: done (message)``."""
    what = d["action"]
    if d.get("gpus_to") is not None:
        what += f" {d['gpus_from']}->{d['gpus_to']} GPUs" if d.get("gpus_from") is not None else f" {d['gpus_to']} GPUs"
    if d.get("batch") is not None:
        what += f", batch {d['batch']}"
    return f"{what}: {d['status']}" + (f" ({d['message']})" if d.get("message") else "")


def _read_history(state_dir: str | None) -> tuple[list[dict], dict[int, dict]]:
    """(the decision log, the ended table) of the daemon's state DB; empty where there is none."""
    from slurm_elastic.daemon.state import StateDB

    if not state_dir:
        return [], {}
    try:
        db = StateDB(state_dir, readonly=True)
    except (FileNotFoundError, OSError):
        return [], {}
    try:
        return db.decisions(), db.ended_jobs()
    except Exception:  # an older or locked database must not break status
        return [], {}
    finally:
        db.close()


def history_rows(state_dir: str | None, active: set[int], decisions=None, ended=None) -> list[dict]:
    """Jobs the daemon's state DB has but Slurm no longer lists: name, user and final state as the daemon
    last saw them (``ENDED`` where it did not see the end), their last decided size and batch, and their
    last user-visible event as the reason."""
    if decisions is None:
        decisions, ended = _read_history(state_dir)
    ended = ended or {}
    last: dict[int, dict] = {}
    count: dict[int, int] = {}
    for d in decisions:
        jid = int(d["job_id"])
        if jid in active or d["action"] == "end":  # its end row: the size shown is the last decided one
            continue
        last.setdefault(jid, {})
        if d["action"] in USER_EVENTS:
            last[jid] = d
        if d["action"] == "resize" and d["status"] == "done":
            count[jid] = count.get(jid, 0) + 1
    rows = []
    for jid in sorted(set(last) | (set(ended) - active)):
        d, e = last.get(jid, {}), ended.get(jid, {})
        state = e.get("state") or "ENDED"
        ts = e.get("ts") or d.get("ts")
        rows.append({"jobid": jid, "partition": e.get("partition") or "-", "name": e.get("name") or "-",
                     "user": e.get("user") or "-", "state": state, "st": STATE_CODES.get(state, "E"),
                     "gpus": d.get("gpus_to"), "nodes": None, "rescales": count.get(jid, 0), "held": False,
                     "range": "-", "batch": d.get("batch"), "samples_per_s": None, "efficiency": None,
                     "last_change": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(ts)) if ts else None,
                     "elastic": True, "spec_error": None,
                     "reason": f"last: {event_text(d)}" if d else ""})
    return rows


def last_events(decisions: list[dict]) -> dict[int, str]:
    """{job: its last user-visible event in words} (the reason of an ended job that Slurm still lists)."""
    return {int(d["job_id"]): f"last: {event_text(d)}" for d in decisions if d["action"] in USER_EVENTS}


def load_daemon_views(state_dir: str | None) -> dict[int, dict]:
    """The daemon's per-job views from its state database, or {} when there is none (yet)."""
    from slurm_elastic.daemon.state import StateDB

    if not state_dir:
        return {}
    try:
        db = StateDB(state_dir, readonly=True)
    except (FileNotFoundError, OSError):
        return {}
    try:
        views = db.job_views()
        for jid, m in (db.get_meta("models", {}) or {}).items():
            if isinstance(m, dict) and str(jid).isdigit():
                views.setdefault(int(jid), {}).update(model=m.get("model"), report_error=m.get("report_error"),
                                                      limits=m.get("limits"))
        return views
    except Exception:  # an older or locked database must not break status
        return {}
    finally:
        db.close()


def short_provenance(p: str | None) -> str:
    """``fitted from 3 reports`` -> ``fitted(3)``, ``profile cifar10`` -> ``profile``: fits a column."""
    if not p:
        return "-"
    words = p.split()
    if words[0] == "fitted" and len(words) >= 3 and words[2].isdigit():
        return f"fitted({words[2]})"
    return words[0]


def progress_of(p: str) -> str | None:
    """The progress note the daemon adds to a model's provenance (``..., 37% of 4.8e+04 samples
    done`` -> ``37%``; a claim the trust rule does not use yet or any more, ``..., 37% of ... done; not
    used until verified (...)`` or ``..., progress claim not used: ...`` -> ``unused``): what the
    completion rank uses (slurm_elastic/claims.py)."""
    for part in p.split(", ")[1:]:
        if part.startswith("progress claim not used") or part.startswith("progress not used"):
            return "unused"
        if " samples done" in part and part.split("%")[0].isdigit():
            return "unused" if "not used" in part else part.split(" ")[0]
    return None


def _cell(value, key: str = "", row: dict | None = None) -> str:
    if key == "model":
        # A paced job's speed is its pace profile's, not a measurement of real GPUs: say so.
        return short_provenance(value) + (",paced" if row and row.get("paced") else "")
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}" if value < 10 else f"{value:.0f}"
    return printable(str(value))


def printable(text: str) -> str:
    """``text`` on one line: control characters (a newline in a job name) shown escaped, never raw."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else ("\\n" if c == "\n" else f"\\x{ord(c):02x}" if ord(c) < 0x100
                                              else f"\\u{ord(c):04x}") for c in text)


def format_table(rows: list[dict], fmt: str = DEFAULT_FORMAT, header: bool = True) -> str:
    cols = parse_format(fmt)
    lines = []
    if header:
        lines.append(" ".join(_pad(c.header, c) for c in cols).rstrip())
    for r in rows:
        lines.append(" ".join(_pad(_cell(r.get(c.key), c.key, r), c) for c in cols).rstrip())
    return "\n".join(lines)


def _pad(text: str, col: Column) -> str:
    if col is list(COLUMNS.values())[-1] or col.key == "reason":
        return text
    text = text[: col.width] if len(text) > col.width and col.key not in ("jobid",) else text
    return text.rjust(col.width) if col.right else text.ljust(col.width)


def parse_format(fmt: str) -> list[Column]:
    """Columns from 'jobid,st,gpus' (optionally 'name:20' for a width), as squeue -O does."""
    cols = []
    for item in fmt.split(","):
        key, _, width = item.strip().lower().partition(":")
        key = key.replace("-", "_").replace("/", "_per_")
        if key not in COLUMNS:
            raise click.BadParameter(f"unknown column {item!r}; known: {', '.join(COLUMNS)}", param_hint="--format")
        col = COLUMNS[key]
        if width:
            if not width.isdigit() or not 0 < int(width) < 200:
                raise click.BadParameter(f"bad width in {item!r}", param_hint="--format")
            col = Column(col.key, col.header, int(width), col.right)
        cols.append(col)
    return cols


def select(rows: list[dict], users: set[str], job_ids: set[int], partitions: set[str], all_jobs: bool) -> list[dict]:
    out = []
    for r in rows:
        if not all_jobs and not r["elastic"]:
            continue
        if users and r["user"] not in users:
            continue
        if job_ids and r["jobid"] not in job_ids:
            continue
        if partitions and r["partition"] not in partitions:
            continue
        out.append(r)
    return out


def _csv(value: str | None) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


@click.command(context_settings={"help_option_names": ["--help"]})  # -h is --noheader, as in squeue
@click.option("-o", "--format", "fmt", default=DEFAULT_FORMAT, show_default=False, envvar="SLURM_ELASTIC_FORMAT",
              help=f"Comma-separated columns, optionally with widths (name:20). Known: {', '.join(COLUMNS)}.")
@click.option("-h", "--noheader", is_flag=True, help="Do not print the header line.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with a 'jobs' list.")
@click.option("-u", "--user", "users", help="Only these users (comma-separated).")
@click.option("-j", "--jobs", "job_ids", help="Only these job ids (comma-separated).")
@click.option("-p", "--partition", "partitions", help="Only these partitions (comma-separated).")
@click.option("-a", "--all", "all_jobs", is_flag=True, help="Also list jobs that are not elastic.")
@click.option("--history", is_flag=True,
              help="Also list ended jobs: Slurm's finished records, and jobs only the daemon's log still has.")
@click.option("--state-dir", default=None, envvar="SLURM_ELASTIC_STATE_DIR",
              help="The daemon's state directory (default: state_dir of the daemon's configuration).")
@click.option("--config", "config_path", default=None, envvar="SLURM_ELASTIC_CONFIG", help="The daemon's TOML configuration.")
def status(fmt, noheader, as_json, users, job_ids, partitions, all_jobs, history, state_dir, config_path):
    """Show elastic jobs, squeue-style: GPUs now and allowed, batch, restarts, reason.

    Reads the Slurm cluster that SLURM_CONF points at (as squeue does).
    """
    from slurm_elastic.backends.cli import CliBackend

    try:
        ids = {int(j) for j in _csv(job_ids)}
    except ValueError as e:
        raise click.BadParameter(f"job ids must be integers: {job_ids!r}", param_hint="-j") from e
    cols = parse_format(fmt)
    try:
        jobs = CliBackend().list_jobs(include_finished=history)
    except SlurmError as e:
        raise click.ClickException(f"cannot read jobs from Slurm: {e}") from e
    source = "--state-dir/SLURM_ELASTIC_STATE_DIR"
    if state_dir is None:
        from slurm_elastic.daemon.config import DEFAULT_PATH, ConfigError, load_config

        try:
            state_dir = load_config(config_path).state_dir
        except ConfigError as e:
            raise click.ClickException(str(e)) from e
        source = f"the daemon configuration {config_path or DEFAULT_PATH}"
    if not (Path(state_dir) / "state.sqlite3").exists() and not as_json:
        # Say so instead of silently printing '-' in every daemon column.
        click.echo(f"status: no daemon state in {state_dir} (from {source}); SAMPLES/S, EFFICIENCY and "
                   "LAST-CHANGE are unknown. Give --config/SLURM_ELASTIC_CONFIG or --state-dir.", err=True)
    views = load_daemon_views(state_dir)
    # An ended job's view is the daemon's last cycle with it running (its reason, e.g. 'kept: ...', is stale).
    rows = [merge_daemon_view(job_row(j), views.get(j.job_id) if j.state in ACTIVE_STATES else None) for j in jobs]
    if history:
        decisions, ended = _read_history(state_dir)
        events = last_events(decisions)
        for r in rows:  # Slurm's own finished records: the reason is what last happened to the job
            if r["state"] not in ACTIVE_STATES and r["jobid"] in events:
                r["reason"] = "; ".join(x for x in (r["reason"], events[r["jobid"]]) if x)
        rows += history_rows(state_dir, {j.job_id for j in jobs}, decisions, ended)
    rows = select(rows, set(_csv(users)), ids, set(_csv(partitions)), all_jobs)
    rows.sort(key=lambda r: r["jobid"])
    if as_json:
        json.dump({"meta": {"plugin": {"type": "slurm-elastic/status", "schema": 1}}, "jobs": rows}, sys.stdout,
                  indent=2)
        click.echo()
        return
    click.echo(format_table(rows, ",".join(c.key if c.width == COLUMNS[c.key].width else f"{c.key}:{c.width}"
                                           for c in cols), header=not noheader))
