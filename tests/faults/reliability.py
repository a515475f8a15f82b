"""The RELIABILITY table's rows (one per fault-suite test, filled through the ``reliability`` fixture)
and its markdown rendering. A plain module, so that the root conftest can write the table in the
pytest-xdist controller, which never loads tests/faults/conftest.py."""

from __future__ import annotations

import os
import platform
import time

ROWS: list[dict] = []  # this process's rows (a pytest-xdist worker's own)


class Reliability:
    """One row of the table: what the test injected or tried, and what it measured."""

    def __init__(self, nodeid: str):
        self.row = {"test": nodeid, "area": "", "fault": "", "tried": "", "checks": "", "completed": None,
                    "lost": None, "left_held": None, "figures": {}, "outcome": "not run"}
        ROWS.append(self.row)

    def __call__(self, area: str, fault: str, tried: str, checks: str) -> None:
        self.row.update(area=area, fault=fault, tried=tried, checks=checks)

    def jobs(self, completed: int | None = None, lost: int | None = None, left_held: int | None = None) -> None:
        for k, v in (("completed", completed), ("lost", lost), ("left_held", left_held)):
            if v is not None:
                self.row[k] = v

    def figure(self, name: str, value) -> None:
        self.row["figures"][name] = value



def test_id(nodeid: str) -> str:
    """The test's id without the ``@group`` that pytest-xdist's loadgroup appends."""
    return nodeid[: nodeid.rindex("@")] if nodeid.rfind("@") > nodeid.rfind("]") else nodeid


def _cell(v) -> str:
    if v is None or v == "":
        return "-"
    return str(v).replace("|", "\\|").replace("\n", " ")


def render(rows: list[dict], wall_s: float) -> str:
    ran = [r for r in rows if r["area"]]
    lines = [
        "# Reliability: faults injected, bad input tried, load held",
        "",
        "Produced by the fault suite on the local real Slurm cluster (real slurmctld/slurmd/munged, real torch",
        "DDP jobs where a job trains), not edited by hand:",
        "",
        "    SLURM_ELASTIC_RELIABILITY_DOC=docs/RELIABILITY.md python -m pytest tests/faults -q",
        "",
        f"Last run: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.node() or 'host'}, "
        f"{os.cpu_count()} CPUs, suite wall time {wall_s:.0f} s; "
        f"{sum(r['outcome'] == 'pass' for r in ran)} of {len(ran)} rows pass.",
        "Each row is one test (tests/faults/); its outcome is that test's pytest outcome, and the job counts",
        "are what the test counted in Slurm afterwards (`-` where the row has no jobs).",
        "",
        "| area | fault injected / input tried | what must hold (checked) | completed | lost | left held | figures | outcome |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in ran:
        figs = "; ".join(f"{k} {v}" for k, v in r["figures"].items())
        lines.append(f"| {_cell(r['area'])} | {_cell(r['fault'])}: {_cell(r['tried'])} | {_cell(r['checks'])} | "
                     f"{_cell(r['completed'])} | {_cell(r['lost'])} | {_cell(r['left_held'])} | {_cell(figs)} | "
                     f"**{r['outcome']}** |")
    lines += [
        "",
        "Terms: *lost* = jobs of the row that Slurm no longer has active (or that failed) when the test checks;",
        "*left held* = jobs the daemon or the fault left held after a decision, or held where the row says they",
        "must run. Jobs still waiting held for GPUs (the load row) or never managed because their spec is bad",
        "(the daemon row of the hostile specs: submitted without the plugin, which would refuse them) are",
        "counted in the figures, not as left held.",
        "",
        "Bugs this suite found, fixed in the commits named (the rows above are the regression tests):",
        "",
        "- the daemon, restarted after a kill right after the stop signal, sent the signal again to a job that",
        "  had already acknowledged; its exiting tasks died of the second USR2 (exit 140 instead of 75) and the",
        "  job failed instead of being requeued (daemon: no resend once the ack is there);",
        "- the submit plugin accepted throughput points the daemon rejects (`points=1x64@1e400`, a 10^18 batch",
        "  in a point) and numbers outside the parser's syntax, so such a job was held at submit and then never",
        "  placed (plugin: the parser's bounds and number syntax);",
        "- one job with a well-formed but unknown `profile=` name made every daemon cycle raise, so no job",
        "  was scheduled at all (problem builder: that job is reported as a bad spec, the cycle goes on);",
        "- an admin's `scontrol requeuehold` of an elastic job was released by the daemon a cycle later: Slurm",
        "  shows every requeuehold as `JobHeldUser`, like the plugin's submit hold (daemon/oversight.py: the",
        "  submit hold is the one with restart count 0; the daemon's own holds are marked in its state DB);",
        "- a Comment with `\\x1f`, NBSP or a space before `elastic:` skipped the plugin while the daemon managed",
        "  it, and `\\x1f` inside a value was trimmed by the daemon but not by the plugin (spec.comment_kind and",
        "  the plugin's comment_kind: one rule, ASCII-only trimming, a differential test).",
        "",
        "Found by the second adversarial review (issue 24), each now a row above on both Slurm versions:",
        "",
        "- two specs at the widest ranges the plugin accepted (batch 2^40) under a per-user cap: the cap listed",
        "  every batch one by one and no cycle ever ended, for any user (spec bounds: batch <= 2^24 in the",
        "  parser and the plugin; no range is listed anywhere, candidates are bounded per job);",
        "- a running job's Comment edited to one the daemon refuses (weight=1000000) took it out of the daemon's",
        "  hands, never shrunk (problem._fallback_spec: its last valid spec, capped at its GPUs);",
        "- reported progress and noise scale were believed as written: a pending job's claim jumped the queue, a",
        "  jump to just below the total made every rescale look too costly (slurm_elastic/claims.py);",
        "- an owner's `scontrol requeue` put her job back PENDING without the daemon's hold: Slurm restarted it",
        "  past her cap (oversight: held again in the same cycle; caps: capped at the decided size);",
        "- root's `stop` followed a user's symlink and blocked on a FIFO (daemon/userwrite.py: as the job's uid);",
        "- `signal = \"KILL\"` and `poll_interval_s = 1e308` were accepted (config ranges and a signal list);",
        "- a job that ignores TERM held every cycle for KillWait inside `requeuehold`, and a cancelled job still",
        "  COMPLETING was planned (enact: requeue without waiting; problem: ending jobs never planned).",
        "",
        "Found by the out-of-memory row (issue 23 item 2): a report forged to match the start's decision, by a",
        "job in its cooldown at 1 GPU where no batch fits below the claimed local batch, grew it to the free",
        "GPUs (3-4) while its honest twin stayed at 1 (policies/_candidates.py: a frozen job gets the fewest",
        "count that fits; daemon/oom.py `most_gpus`: the restart is capped until the next start runs).",
        "",
        "Not covered here: a training task SIGKILLed in the middle of writing its checkpoint is tested without",
        "Slurm in `tests/integration/test_train_ddp.py::test_sigkill_during_checkpoint_write_keeps_previous_and_resumes_from_it`.",
        "",
        "Tests: " + ", ".join(f"`{test_id(r['test'])}`" for r in ran),
        "",
    ]
    return "\n".join(lines)
