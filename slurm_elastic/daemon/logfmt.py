"""The daemon's log format: one logfmt line per event, every user-controlled value escaped."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("slurm_elastic.daemon")


def logfmt_value(v) -> str:
    """One logfmt value: quoted when needed, with every control character (and Unicode line break)
    escaped, so a user's spec, path or job name can neither break a line nor forge a field."""
    s = str(v)
    if s and not any(c in s for c in ' "=\\') and s.isprintable():
        return s
    out = []
    for c in s:
        if c in '"\\':
            out.append("\\" + c)
        elif c == "\n":
            out.append("\\n")
        elif c == "\t":
            out.append("\\t")
        elif not c.isprintable() and c != " ":
            out.append(f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
        else:
            out.append(c)
    return '"' + "".join(out) + '"'


class LogfmtFormatter(logging.Formatter):
    """``ts=... level=info event=... job=12 reason="..."``: one line per decision or action."""

    def format(self, record: logging.LogRecord) -> str:
        fields = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created)),
                  "level": record.levelname.lower(), "msg": record.getMessage()}
        fields.update(getattr(record, "kv", {}) or {})
        if record.exc_info:
            fields["exc"] = self.formatException(record.exc_info)
        return " ".join(f"{logfmt_value(k)}={logfmt_value(v)}" for k, v in fields.items())


def setup_logging(level: str) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(LogfmtFormatter())
    root = logging.getLogger("slurm_elastic")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def event(level: int, msg: str, **kv) -> None:
    log.log(level, msg, extra={"kv": kv})


def note_problem(problems: dict, job_id: int, text: str | None, msg: str) -> None:
    """Keep ``job_id``'s current problem with one of its files in ``problems`` (None/"": none), and log it
    once when it changes, not every cycle it persists."""
    if text and problems.get(job_id) != text:
        event(logging.WARNING, msg, job=job_id, error=text)
    if text:
        problems[job_id] = text
    else:
        problems.pop(job_id, None)
