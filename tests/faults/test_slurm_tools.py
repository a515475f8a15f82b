"""squeue/scontrol/sinfo failing, hanging or printing garbage, on the real cluster.

The daemon's backend points at a bin dir of wrapper scripts that run the real tool, or misbehave as
told by a mode file: exit 1 with "Socket timed out", hang past the timeout, print truncated or garbled
JSON, print JSON that is not an object. Every case: the cycle is skipped with one clear log line that
names the tool, no Slurm action is taken on partial data (the wrappers log every call), the held jobs
stay as they were, and the next cycle with working tools places them (recovery).
"""

from __future__ import annotations

import logging
import os
import stat

import pytest
from faultlib import jobs_by_id, scancel, wait_for

from slurm_elastic.backends.cli import CliBackend
from slurm_elastic.daemon.config import config_from_dict
from slurm_elastic.daemon.loop import Daemon

pytestmark = [pytest.mark.slurm]

SPEC = "elastic:min_gpus=1,max_gpus=2,min_batch=32,max_batch=256,max_local_batch=64,batch=64"
WRAPPER = r"""#!/bin/bash
tool=$(basename "$0")
here=$(dirname "$0")
mode=$(cat "$here/mode.$tool" 2>/dev/null || echo ok)
echo "$tool $*" >> "$here/calls.log"
case "$mode" in
  transient) echo "$tool: error: Socket timed out on send/recv operation" >&2; exit 1 ;;
  fail) echo "$tool: error: Unexpected message received" >&2; exit 1 ;;
  hang) exec sleep 30 ;;
  truncate) "@BIN@/$tool" "$@" | head -c 3000; exit 0 ;;
  garble) "@BIN@/$tool" "$@" | tr '{}:' '[],' ; exit 0 ;;
  notobject) echo '[{"jobs": []}]'; exit 0 ;;
  empty) exit 0 ;;
  fail-update) if [ "$1" = update ]; then echo "$tool: error: Unexpected message received" >&2; exit 1; fi ;;
esac
exec "@BIN@/$tool" "$@"
"""
TOOLS = ("squeue", "scontrol", "sinfo", "scancel")


@pytest.fixture
def wrapped(slurm_cluster, tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for t in TOOLS:
        p = bindir / t
        p.write_text(WRAPPER.replace("@BIN@", slurm_cluster.config.bin))
        p.chmod(p.stat().st_mode | stat.S_IXUSR)
    backend = CliBackend(env={"SLURM_CONF": slurm_cluster.inside(slurm_cluster.conf_path)}, bin_dir=str(bindir),
                         timeout=3, retries=1, retry_delay=0.1)
    # lease_ttl_s 0: the wrappers fake the four tools the cycle uses, not sbatch (the lease's placeholder
    # job; the lease is tested in test_operators.py), and the lease's renewal is no cycle action.
    cfg = config_from_dict({"state_dir": str(tmp_path / "state"), "metrics_address": "", "cooldown_s": 0,
                            "poll_interval_s": 2, "restart_cost_s": 5, "lease_ttl_s": 0})
    d = Daemon(cfg, backend=backend)
    d.open()
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nsleep 300\n")
    os.chmod(tmp_path, 0o755)
    ids = []

    def set_mode(tool, mode):
        (bindir / f"mode.{tool}").write_text(mode)

    def calls():
        p = bindir / "calls.log"
        return p.read_text().splitlines() if p.exists() else []

    def submit(n=2):
        for _ in range(n):
            ids.append(slurm_cluster.sbatch(["--hold", "--requeue", "-o", "/dev/null", "--gres=gpu:1",
                                             f"--comment={SPEC}", str(script)], cwd=tmp_path))
        return ids[-n:]

    try:
        yield d, set_mode, calls, submit, slurm_cluster
    finally:
        d.close()
        scancel(slurm_cluster, ids)


def _nodes_tool(cluster) -> str:
    return "scontrol" if cluster.backend.version_tuple() >= (23, 2, 0) else "sinfo"


CASES = [
    ("squeue", "transient", "Socket timed out (retried, then given up)"),
    ("squeue", "fail", "exit 1"),
    ("squeue", "hang", "no answer within the 3 s timeout"),
    ("squeue", "truncate", "JSON cut at 3000 bytes"),
    ("squeue", "garble", "JSON with its braces and colons rewritten"),
    ("squeue", "notobject", "a JSON array instead of an object"),
    ("squeue", "empty", "empty output"),
    ("nodes", "truncate", "node JSON cut at 3000 bytes (jobs read fine: partial data)"),
    ("nodes", "hang", "node read hangs (jobs read fine: partial data)"),
]


@pytest.mark.parametrize("tool, mode, what", CASES, ids=[f"{t}-{m}" for t, m, _ in CASES])
def test_cycle_skipped_and_nothing_done_on_bad_slurm_output(wrapped, caplog, reliability, tool, mode, what):
    d, set_mode, calls, submit, cluster = wrapped
    real_tool = _nodes_tool(cluster) if tool == "nodes" else tool
    reliability("Slurm tools", f"{real_tool} misbehaves ({mode})", what,
                "cycle skipped with a log line naming the tool; no scontrol update/release issued; jobs stay "
                "held; next cycle with working tools places them")
    cluster.backend.version_tuple()
    d.backend.version_tuple()  # the version is read once, before the fault
    jobs = submit(2)
    set_mode(real_tool, mode)
    before = len(calls())
    with caplog.at_level(logging.INFO, logger="slurm_elastic"):
        assert d.cycle() is None
    skipped = [r for r in caplog.records if r.getMessage() == "cycle skipped: cannot read Slurm"]
    assert len(skipped) == 1, [r.getMessage() for r in caplog.records]
    err = skipped[0].kv["error"]
    assert real_tool in err, err
    acted = [c for c in calls()[before:] if c.startswith(("scontrol update", "scontrol release", "scontrol requeuehold",
                                                          "scontrol hold", "scancel"))]
    assert not acted, acted
    recs = jobs_by_id(cluster, jobs)
    assert all(r.is_pending and r.held and not r.admin_comment for r in recs.values()), recs
    assert not d.db.open_intents()
    # Tools work again: the next cycle places both jobs.
    set_mode(real_tool, "ok")
    assert d.cycle() is not None
    placed = wait_for(lambda: all(not r.held for r in jobs_by_id(cluster, jobs).values()), 30, "both jobs released")
    recs = jobs_by_id(cluster, jobs)
    assert placed and all(r.admin_comment.startswith("elastic-decision:") for r in recs.values())
    starts = [x for x in d.db.decisions() if x["action"] == "start" and x["status"] == "done"]
    assert sorted(x["job_id"] for x in starts) == sorted(jobs)
    reliability.jobs(lost=len(set(jobs) - set(jobs_by_id(cluster, jobs, include_finished=False))),
                     left_held=sum(r.held for r in recs.values()))
    reliability.figure("placed after recovery", f"{len(starts)}/2")


def test_scontrol_update_failing_mid_start_leaves_no_job_held(wrapped, caplog, reliability):
    d, set_mode, calls, submit, cluster = wrapped
    reliability("Slurm tools", "scontrol update fails during a start", "exit 1 on every 'scontrol update'",
                "the action fails with an error naming the job; its intent is kept; the next cycle finishes the "
                "start exactly once; no job left held")
    (job,) = submit(1)
    set_mode("scontrol", "fail-update")
    with caplog.at_level(logging.INFO, logger="slurm_elastic"):
        r = d.cycle()
    assert r is not None
    errors = [x for x in r.results if x.status == "error"]
    assert [x.action.job_id for x in errors] == [job] and "scontrol failed" in errors[0].message
    assert not [c for c in calls() if c.startswith("scontrol release")]
    assert [i["job_id"] for i in d.db.open_intents()] == [job]  # kept so that it is finished, not forgotten
    assert cluster.backend.get_job(job).held
    set_mode("scontrol", "ok")
    d.cycle()
    rec = wait_for(lambda: (x := cluster.backend.get_job(job)) and not x.held and x, 30, "the job released")
    assert rec.admin_comment.startswith("elastic-decision:")
    assert not d.db.open_intents()
    releases = [c for c in calls() if c == f"scontrol release {job}"]
    assert len(releases) == 1, releases
    final = cluster.backend.get_job(job)
    reliability.jobs(lost=int(final is None), left_held=int(bool(final and final.held)))
