"""The daemon's durable state: a SQLite database in the state directory, and the single-daemon lock.

Tables:

- ``intents``: one row per job with an action under way, written **before** each step (signal,
  requeue_hold, update, release) with the whole action, so that a restarted daemon can finish or roll
  back what a crashed one left half done (:mod:`slurm_elastic.daemon.reconcile`);
- ``decisions``: the decision log, one row per action result (done, begun, timeout, error) and per
  job whose spec was rejected, with the reason;
- ``books``: per-job bookkeeping the planner needs across restarts (last change, rescales, decision seq);
- ``holds``: the daemon's own holds (``requeuehold``/``hold``), with the restart count the job has
  after them, so that an operator's hold is told apart and never released (:mod:`.oversight`);
- ``jobs``: the last cycle's view of each elastic job (GPUs, batch, samples/s, efficiency, reason), which
  ``slurm-elastic status`` shows;
- ``ended``: name, user and final state of each elastic job when it left Slurm's queue, so that
  ``status --history`` can still name a job after Slurm forgot it.

The directory is created 0755 and the database 0644 (root writes; users may read for ``status``);
nothing here is world-writable.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import time
from dataclasses import asdict
from pathlib import Path

from slurm_elastic import planner as pl
from slurm_elastic.spec import Decision

SCHEMA = """
CREATE TABLE IF NOT EXISTS intents (
    job_id INTEGER PRIMARY KEY,
    kind TEXT NOT NULL,
    step TEXT NOT NULL,
    action TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    restart_count INTEGER
);
CREATE TABLE IF NOT EXISTS decisions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts REAL NOT NULL,
    cycle INTEGER NOT NULL,
    job_id INTEGER NOT NULL,
    action TEXT NOT NULL,
    status TEXT NOT NULL,
    gpus_from INTEGER,
    gpus_to INTEGER,
    batch INTEGER,
    reason TEXT,
    message TEXT
);
CREATE INDEX IF NOT EXISTS decisions_job ON decisions(job_id);
CREATE TABLE IF NOT EXISTS books (
    job_id INTEGER PRIMARY KEY,
    last_change REAL,
    rescales INTEGER NOT NULL,
    seq INTEGER NOT NULL,
    submitted REAL,
    excluded TEXT
);
CREATE TABLE IF NOT EXISTS jobs (
    job_id INTEGER PRIMARY KEY,
    updated REAL NOT NULL,
    gpus INTEGER,
    target_gpus INTEGER,
    batch INTEGER,
    samples_per_s REAL,
    efficiency REAL,
    rescales INTEGER,
    last_change REAL,
    reason TEXT,
    model TEXT,
    model_uncertainty REAL,
    noise_scale REAL,
    restart_s REAL
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS ended (
    job_id INTEGER PRIMARY KEY,
    ts REAL NOT NULL,
    name TEXT,
    user TEXT,
    partition TEXT,
    state TEXT
);
CREATE TABLE IF NOT EXISTS holds (
    job_id INTEGER PRIMARY KEY,
    restart_count INTEGER NOT NULL,
    ts REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS placed (
    job_id INTEGER PRIMARY KEY,
    restart_count INTEGER NOT NULL,
    ts REAL NOT NULL
);
"""


JOB_VIEW_ADDED = (("model", "TEXT"), ("model_uncertainty", "REAL"), ("noise_scale", "REAL"), ("restart_s", "REAL"),
                  ("name", "TEXT"), ("user", "TEXT"), ("partition", "TEXT"), ("restart_from", "TEXT"))
BOOKS_ADDED = (("submitted", "REAL"), ("excluded", "TEXT"))
MAX_EXCLUDED = 4096  # node names kept per job's ExcNodeList (the daemon writes them; bounded all the same)
UNKNOWN_EXCLUDED = ("?",)  # an unreadable stored list: the job has one, to be cleared at its next start


class LockHeld(RuntimeError):
    """Another daemon holds the state directory's lock."""


class DaemonLock:
    """An exclusive ``flock`` on ``<state_dir>/daemon.lock``; the file records the holder's pid."""

    def __init__(self, state_dir: str | os.PathLike):
        self.path = Path(state_dir) / "daemon.lock"
        self._fd: int | None = None

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # The holder writes its pid just after it takes the lock: a daemon started at the same instant
            # can read the file in between, so it waits briefly for the pid before naming "?".
            holder = ""
            for _ in range(20):
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
                if holder:
                    break
                time.sleep(0.05)
            holder = holder or "?"
            os.close(fd)
            raise LockHeld(
                f"another slurm-elastic daemon (pid {holder}) is running with state dir {self.path.parent}; "
                f"refusing to start a second one"
            ) from None
        pid = f"{os.getpid()}\n".encode()
        os.pwrite(fd, pid, 0)  # written before the truncation, so a reader never sees an empty file after a first run
        os.ftruncate(fd, len(pid))
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self):
        self.acquire()
        return self

    def __exit__(self, *exc):
        self.release()


def action_to_json(action: pl.Action) -> str:
    d = asdict(action)
    return json.dumps(d, sort_keys=True)


def action_from_json(text: str) -> pl.Action:
    d = json.loads(text)
    kind = d.get("kind")
    if "decision" in d and isinstance(d["decision"], dict):
        d["decision"] = Decision(**d["decision"])
    cls = {"start": pl.Start, "resize": pl.Resize, "preempt": pl.Preempt, "hold": pl.Hold, "leave": pl.Leave}.get(kind)
    if cls is None:
        raise ValueError(f"unknown action kind {kind!r}")
    for k in ("after", "exclude_nodes"):  # tuples in the action, lists in JSON
        if isinstance(d.get(k), list):
            d[k] = tuple(d[k])
    return cls(**d)


def _excluded(text) -> tuple[str, ...]:
    """A job's stored ExcNodeList (the nodes its last start or resize excluded): kept across daemon restarts,
    so that the list is still cleared at the job's next start (a job left excluded from the nodes it is
    placed on would wait, released, for a place Slurm will not give it). Unreadable: ``UNKNOWN_EXCLUDED``."""
    if text is None:
        return ()
    try:
        names = json.loads(text)
    except (TypeError, ValueError):
        return UNKNOWN_EXCLUDED
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) or len(names) > MAX_EXCLUDED:
        return UNKNOWN_EXCLUDED
    return tuple(names)


class StateDB:
    """Thin, explicit access to the daemon's SQLite file (one connection, autocommit per statement)."""

    def __init__(self, state_dir: str | os.PathLike, *, readonly: bool = False):
        self.dir = Path(state_dir)
        self.path = self.dir / "state.sqlite3"
        if readonly:
            if not self.path.exists():
                raise FileNotFoundError(f"no daemon state at {self.path}")
            self.conn = sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=10)
        else:
            self.dir.mkdir(parents=True, exist_ok=True)
            os.chmod(self.dir, 0o755)
            new = not self.path.exists()
            self.conn = sqlite3.connect(self.path, timeout=10, isolation_level=None)
            if new:
                os.chmod(self.path, 0o644)
            self.conn.executescript(SCHEMA)
            for table, added in (("jobs", JOB_VIEW_ADDED), ("books", BOOKS_ADDED)):
                have = {r[1] for r in self.conn.execute(f"PRAGMA table_info({table})").fetchall()}
                for col, typ in added:  # a database made before these columns existed
                    if col not in have:
                        self.conn.execute(f"ALTER TABLE {table} ADD COLUMN {col} {typ}")
        self.conn.row_factory = sqlite3.Row

    def close(self) -> None:
        self.conn.close()

    # ----- intents ---------------------------------------------------------------------------
    def write_intent(self, action: pl.Action, step: str, restart_count: int | None = None) -> None:
        now = time.time()
        self.conn.execute(
            "INSERT INTO intents(job_id, kind, step, action, created, updated, restart_count) "
            "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(job_id) DO UPDATE SET step=excluded.step, "
            "action=excluded.action, updated=excluded.updated, "
            "restart_count=COALESCE(excluded.restart_count, intents.restart_count)",
            (int(action.job_id), action.kind, step, action_to_json(action), now, now, restart_count),
        )

    def close_intent(self, job_id: int) -> None:
        self.conn.execute("DELETE FROM intents WHERE job_id = ?", (int(job_id),))

    def open_intents(self) -> list[dict]:
        rows = self.conn.execute("SELECT * FROM intents ORDER BY created").fetchall()
        return [dict(r) for r in rows]

    # ----- the daemon's own holds ----------------------------------------------------------------
    def mark_held(self, job_id: int, restart_count: int) -> None:
        self.conn.execute("INSERT INTO holds(job_id, restart_count, ts) VALUES (?, ?, ?) ON CONFLICT(job_id) "
                          "DO UPDATE SET restart_count=excluded.restart_count, ts=excluded.ts",
                          (int(job_id), int(restart_count), time.time()))

    def unmark_held(self, job_id: int) -> None:
        self.conn.execute("DELETE FROM holds WHERE job_id = ?", (int(job_id),))

    def held_marks(self) -> dict[int, int]:
        return {r[0]: r[1] for r in self.conn.execute("SELECT job_id, restart_count FROM holds").fetchall()}

    # ----- the restart count at which the daemon last let each job go (oversight: a path around the hold)
    def mark_placed(self, job_id: int, restart_count: int) -> None:
        self.conn.execute("INSERT INTO placed(job_id, restart_count, ts) VALUES (?, ?, ?) ON CONFLICT(job_id) "
                          "DO UPDATE SET restart_count=excluded.restart_count, ts=excluded.ts",
                          (int(job_id), int(restart_count), time.time()))

    def unmark_placed(self, job_id: int) -> None:
        self.conn.execute("DELETE FROM placed WHERE job_id = ?", (int(job_id),))

    def placed_marks(self) -> dict[int, int]:
        return {r[0]: r[1] for r in self.conn.execute("SELECT job_id, restart_count FROM placed").fetchall()}

    # ----- decision log ------------------------------------------------------------------------
    def log_decision(self, cycle: int, job_id: int, action: str, status: str, *, gpus_from=None, gpus_to=None,
                     batch=None, reason: str = "", message: str = "") -> None:
        self.conn.execute(
            "INSERT INTO decisions(ts, cycle, job_id, action, status, gpus_from, gpus_to, batch, reason, message) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (time.time(), cycle, int(job_id), action, status, gpus_from, gpus_to, batch, reason, message),
        )

    def decisions(self, job_id: int | None = None) -> list[dict]:
        if job_id is None:
            rows = self.conn.execute("SELECT * FROM decisions ORDER BY id").fetchall()
        else:
            rows = self.conn.execute("SELECT * FROM decisions WHERE job_id = ? ORDER BY id", (int(job_id),)).fetchall()
        return [dict(r) for r in rows]

    # ----- books -------------------------------------------------------------------------------
    def load_books(self) -> dict[int, pl.JobBook]:
        rows = self.conn.execute("SELECT * FROM books").fetchall()
        return {r["job_id"]: pl.JobBook(last_change_s=r["last_change"], rescales=r["rescales"], seq=r["seq"],
                                        submitted_s=r["submitted"], excluded=_excluded(r["excluded"]))
                for r in rows}

    def save_books(self, books: dict) -> None:
        with self.conn:
            self.conn.execute("BEGIN")
            for job_id, b in books.items():
                self.conn.execute(
                    "INSERT INTO books(job_id, last_change, rescales, seq, submitted, excluded) VALUES (?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT(job_id) DO UPDATE SET last_change=excluded.last_change, "
                    "rescales=excluded.rescales, seq=excluded.seq, submitted=excluded.submitted, "
                    "excluded=excluded.excluded",
                    (int(job_id), b.last_change_s, b.rescales, b.seq, b.submitted_s,
                     json.dumps(list(b.excluded)) if b.excluded else None),
                )

    def forget_jobs(self, active_ids: set[int], final_states: dict[int, str] | None = None) -> None:
        """Drop books and views of jobs Slurm no longer lists as active (the decision log is kept); an
        elastic job's name, user and final state (``final_states``: what Slurm last showed, e.g.
        COMPLETED; NULL when it vanished unseen) move to ``ended`` for ``status --history``."""
        final_states = final_states or {}
        now = time.time()
        for row in self.conn.execute("SELECT job_id, name, user, partition FROM jobs").fetchall():
            if row[0] not in active_ids:
                self.conn.execute(
                    "INSERT INTO ended(job_id, ts, name, user, partition, state) VALUES (?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT(job_id) DO UPDATE SET ts=excluded.ts, name=COALESCE(excluded.name, ended.name), "
                    "user=COALESCE(excluded.user, ended.user), partition=COALESCE(excluded.partition, "
                    "ended.partition), state=excluded.state",
                    (row[0], now, row[1], row[2], row[3], final_states.get(row[0])))
        for table in ("books", "jobs"):
            ids = [r[0] for r in self.conn.execute(f"SELECT job_id FROM {table}").fetchall()]
            for jid in ids:
                if jid not in active_ids:
                    self.conn.execute(f"DELETE FROM {table} WHERE job_id = ?", (jid,))

    def ended_jobs(self) -> dict[int, dict]:
        """{job id: its ``ended`` row}; {} for a database written before the table existed (read-only)."""
        try:
            return {r["job_id"]: dict(r) for r in self.conn.execute("SELECT * FROM ended").fetchall()}
        except sqlite3.OperationalError:
            return {}

    # ----- per-job view for status -------------------------------------------------------------
    def save_job_views(self, rows: list[dict]) -> None:
        now = time.time()
        with self.conn:
            self.conn.execute("BEGIN")
            for r in rows:
                self.conn.execute(
                    "INSERT INTO jobs(job_id, updated, gpus, target_gpus, batch, samples_per_s, efficiency, "
                    "rescales, last_change, reason, model, model_uncertainty, noise_scale, restart_s, name, user, "
                    "partition, restart_from) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?) "
                    "ON CONFLICT(job_id) DO UPDATE SET updated=excluded.updated, gpus=excluded.gpus, "
                    "target_gpus=excluded.target_gpus, batch=excluded.batch, samples_per_s=excluded.samples_per_s, "
                    "efficiency=excluded.efficiency, rescales=excluded.rescales, last_change=excluded.last_change, "
                    "reason=excluded.reason, model=excluded.model, model_uncertainty=excluded.model_uncertainty, "
                    "noise_scale=excluded.noise_scale, restart_s=excluded.restart_s, name=excluded.name, "
                    "user=excluded.user, partition=excluded.partition, restart_from=excluded.restart_from",
                    (int(r["job_id"]), now, r.get("gpus"), r.get("target_gpus"), r.get("batch"),
                     r.get("samples_per_s"), r.get("efficiency"), r.get("rescales"), r.get("last_change"),
                     r.get("reason"), r.get("model"), r.get("model_uncertainty"), r.get("noise_scale"),
                     r.get("restart_s"), r.get("name"), r.get("user"), r.get("partition"), r.get("restart_from")),
                )
                # Active again (a requeue after it was seen ending): no longer ended.
                self.conn.execute("DELETE FROM ended WHERE job_id = ?", (int(r["job_id"]),))

    def job_views(self) -> dict[int, dict]:
        return {r["job_id"]: dict(r) for r in self.conn.execute("SELECT * FROM jobs").fetchall()}

    def set_meta(self, key: str, value) -> None:
        self.conn.execute("INSERT INTO meta(key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
                          (key, json.dumps(value)))

    def get_meta(self, key: str, default=None):
        row = self.conn.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else default
