"""slurmctld stopped and restarted under a running daemon; one slurmd of a node with an elastic job killed."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest
from faultlib import DaemonProc, scancel, wait_for, write_config

from slurm_elastic.daemon.state import StateDB

pytestmark = [pytest.mark.slurm]
SPEC = "elastic:min_gpus=1,max_gpus=4,min_batch=32,max_batch=256,max_local_batch=64,batch=64"


def _ts(line: str) -> float | None:
    m = re.match(r"ts=(\S+)", line)
    return time.mktime(time.strptime(m.group(1), "%Y-%m-%dT%H:%M:%S")) if m else None


def _kill_orphaned_steps(cluster, node: str) -> None:
    """The killed slurmd's node keeps the job's old batch step (slurmstepd + script) running after the job
    was requeued elsewhere; stop exactly those: scripts under this cluster's spool dir of ``node`` and
    their slurmstepd parent."""
    spool = str(cluster.data_dir / "spool" / node) + "/"
    for pid in [p for p in os.listdir("/proc") if p.isdigit()]:
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\0")
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            parent = open(f"/proc/{ppid}/cmdline", "rb").read().decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
        if any(a.startswith(spool) and a.endswith("/slurm_script") for a in cmd):
            for victim, ok in ((ppid, parent.startswith("slurmstepd:")), (int(pid), True)):
                if ok:
                    try:
                        os.kill(victim, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


def _submit(cluster, work, n=1):
    script = work / "job.sh"
    script.write_text("#!/bin/bash\nsleep 300\n")
    return [cluster.sbatch(["--hold", "--requeue", "-o", "/dev/null", "--gres=gpu:1", f"--comment={SPEC}",
                            str(script)], cwd=work) for _ in range(n)]


@pytest.mark.parametrize("backend", ["cli", "pyslurm"])
def test_slurmctld_stopped_and_restarted_while_the_daemon_runs(slurm_cluster, tmp_path, reliability, backend):
    """With either backend: pyslurm's RPC errors while slurmctld is down skip the cycle as squeue's do."""
    if backend == "pyslurm":
        import importlib.util

        if importlib.util.find_spec("pyslurm") is None:
            why = "pyslurm is not installed in this venv: run scripts/build_pyslurm.sh"
            pytest.fail(why) if os.environ.get("SLURM_ELASTIC_REQUIRE_SLURM") == "1" else pytest.skip(why)
    reliability("Slurm daemons", f"slurmctld stopped (SIGTERM) for ~20 s under a running daemon ({backend} "
                "backend), then restarted",
                "one elastic job running, one submitted after the restart",
                "daemon stays up, logs each skipped cycle with a growing retry delay, takes no action while "
                "slurmctld is down, places the new job after the restart, the running job untouched")
    os.chmod(tmp_path, 0o755)
    c = slurm_cluster
    cfg = write_config(tmp_path / "elastic.toml", tmp_path / "state", slurm_timeout_s=5, backend=backend)
    d = DaemonProc.cli(c, cfg, tmp_path / "daemon.log")
    ids = []
    try:
        wait_for(lambda: f"backend: {backend} (" in d.text(), 60, f"the daemon to log its {backend} backend")
        ids += _submit(c, tmp_path)
        wait_for(lambda: (j := c.backend.get_job(ids[0])) and j.is_running, 60, "the first job to run")
        time.sleep(3)
        down_at = time.time()
        assert c.kill_daemon("slurmctld", signal.SIGTERM)
        wait_for(lambda: d.text().count("cycle skipped: cannot read Slurm") >= 2, 90, "two skipped cycles")
        time.sleep(5)
        assert d.proc.poll() is None, d.text()[-2000:]
        up_at = time.time()
        c.start_slurmctld()
        c._wait_nodes_idle(60)
        ids += _submit(c, tmp_path)
        wait_for(lambda: (j := c.backend.get_job(ids[1])) and not j.held and j, 60, "the new job to be placed")
        first = c.backend.get_job(ids[0])
        active = {j.job_id: j for j in c.backend.list_jobs()}
        log = d.text()
        assert d.stop() == 0
    finally:
        d.stop()
        if not c.running().get("slurmctld"):
            c.start_slurmctld()
        scancel(c, ids)
    lines = log.splitlines()
    skipped = [ln for ln in lines if "cycle skipped: cannot read Slurm" in ln]
    delays = [float(m.group(1)) for ln in skipped if (m := re.search(r"retry_in_s=([0-9.]+)", ln))]
    assert len(skipped) >= 2 and delays == sorted(delays) and delays[-1] > delays[0], skipped
    acted_while_down = [ln for ln in lines if ("action step" in ln or "msg=action " in ln)
                        and (t := _ts(ln)) is not None and down_at + 1 < t < up_at - 1]
    assert not acted_while_down, acted_while_down
    assert first.is_running and first.restart_count == 0 and not first.held
    db = StateDB(tmp_path / "state", readonly=True)
    starts = [x for x in db.decisions() if x["action"] == "start" and x["status"] == "done"]
    db.close()
    assert sorted(x["job_id"] for x in starts) == sorted(ids)  # each placed once
    assert "Traceback" not in log, log[log.find("Traceback") - 600:log.find("Traceback") + 2500]
    reliability.jobs(lost=len(set(ids) - set(active)), left_held=sum(active[j].held for j in ids if j in active))
    reliability.figure("skipped cycles", len(skipped))
    reliability.figure("retry delays s", "/".join(f"{x:g}" for x in delays[:4]))


@pytest.mark.parametrize("lua_cluster", ["host"], indirect=True)  # the host's Slurm only (issue 24)
def test_slurmd_of_a_node_with_an_elastic_job_killed(lua_cluster, tmp_path, reliability):
    reliability("Slurm daemons", "slurmd of the node running an elastic job SIGKILLed (SlurmdTimeout 10 s)",
                "the node goes down under the job; slurmd restarted afterwards",
                "Slurm requeues the job (JobRequeue=1, --requeue) and it runs again on the other node; the "
                "daemon keeps cycling, re-plans on the smaller capacity, never crashes; nothing left held")
    c = lua_cluster
    os.chmod(tmp_path, 0o755)
    cfg = write_config(tmp_path / "elastic.toml", tmp_path / "state", partitions=["gpu"])
    d = DaemonProc.cli(c, cfg, tmp_path / "daemon.log")
    ids, node = [], None
    try:
        ids += [c.sbatch(["--requeue", "--gres=gpu:1", "-o", "/dev/null", f"--comment={SPEC}", str(c.script)],
                         cwd=c.script.parent)]
        job = wait_for(lambda: (j := c.backend.get_job(ids[0])) and j.is_running and j, 60, "the job to run")
        (node,) = job.nodes
        assert c.kill_daemon(f"slurmd:{node}", signal.SIGKILL)
        wait_for(lambda: any(n.name == node and not n.usable for n in c.backend.list_nodes()), 90,
                 f"{node} to be marked down")
        again = wait_for(lambda: (j := c.backend.get_job(ids[0], include_finished=True)) and j.restart_count >= 1
                         and (j.is_running or not j.is_active) and j, 120, "the job to be requeued and run again")
        time.sleep(6)  # a few daemon cycles on the smaller cluster
        db = StateDB(tmp_path / "state", readonly=True)
        meta = db.get_meta("last_cycle")
        db.close()
        assert d.proc.poll() is None, d.text()[-3000:]
        log = d.text()
    finally:
        d.stop()
        if node:
            c.start_slurmd(node)
        scancel(c, ids)
    assert again.is_running and node not in again.nodes and not again.held, again
    assert meta["capacity"] == 4, meta  # node1-2 managed, one of them down
    assert "cycle failed" not in log and "Traceback" not in log
    if node:
        wait_for(lambda: any(n.name == node and n.usable for n in c.backend.list_nodes()), 90, f"{node} back")
        _kill_orphaned_steps(c, node)
    reliability.jobs(lost=int(not again.is_running), left_held=int(again.held))
    reliability.figure("job restarts", again.restart_count)
