"""The daemon as a process on the real cluster: two at once, its files and port, a job that never acks."""

from __future__ import annotations

import os
import re
import stat
import time
import urllib.request

import pytest
from faultlib import DaemonProc, scancel, wait_for, write_config

from tests.conftest import free_ports

pytestmark = [pytest.mark.slurm]


def _listening(port: int) -> list[str]:
    """Local addresses (hex, as in /proc/net/tcp[6]) of sockets listening on ``port``."""
    out = []
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(f).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            addr, st = cols[1], cols[3]
            if st == "0A" and int(addr.rsplit(":", 1)[1], 16) == port:
                out.append(addr.rsplit(":", 1)[0])
    return out


def test_two_daemons_started_at_once_one_refuses_and_says_why(slurm_cluster, tmp_path, reliability):
    reliability("daemon process", "two daemons started at the same instant on one state dir",
                "both spawned back to back", "exactly one keeps running; the other exits 1 naming the pid that "
                "holds the lock; state dir and database not world-writable; metrics on 127.0.0.1 by default")
    port = free_ports(1, start=29500)
    cfg = write_config(tmp_path / "elastic.toml", tmp_path / "state", metrics_port=port)
    text = cfg.read_text().replace('metrics_address = ""\n', "")  # the default address
    cfg.write_text(text)
    a = DaemonProc.cli(slurm_cluster, cfg, tmp_path / "a.log")
    b = DaemonProc.cli(slurm_cluster, cfg, tmp_path / "b.log")
    try:
        loser = wait_for(lambda: next((p for p in (a, b) if p.proc.poll() is not None), None), 60, "one daemon to exit")
        winner = b if loser is a else a
        time.sleep(1)
        assert winner.proc.poll() is None, winner.text()
        assert loser.proc.returncode == 1
        msg = loser.text()
        assert f"another slurm-elastic daemon (pid {winner.proc.pid}) is running" in msg, msg
        assert "refusing to start a second one" in msg
        wait_for(lambda: "metrics listening" in winner.text(), 30, "the metrics endpoint")
        m = re.search(r"metrics listening.*address=(\S+):(\d+)", winner.text())
        assert m and m.group(1) == "127.0.0.1" and int(m.group(2)) == port, winner.text()
        assert _listening(port) == ["0100007F"], _listening(port)  # 127.0.0.1 only, no IPv6/any bind
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "slurm_elastic_cycles_total" in body
        for p in (tmp_path / "state", tmp_path / "state" / "state.sqlite3", tmp_path / "state" / "daemon.lock"):
            mode = stat.S_IMODE(os.stat(p).st_mode)
            assert not mode & 0o002, f"{p} is world-writable ({mode:o})"
        assert winner.stop() == 0
    finally:
        a.stop()
        b.stop()
    reliability.figure("metrics bind", "127.0.0.1")


def test_job_that_never_acks_is_left_running_and_not_retried_in_a_tight_loop(slurm_cluster, tmp_path, reliability):
    reliability("job faults", "checkpoint ack never comes", "a running elastic job whose task ignores USR2; "
                "daemon wants to grow it 1 -> 4 (ack timeout 5 s, cooldown 10 s, 30 s observed)",
                "each attempt times out with a log line; the job keeps running at 1 GPU, never requeued or held; "
                "attempts <= 1 + observed/cooldown")
    os.chmod(tmp_path, 0o755)
    script = tmp_path / "stubborn.sh"
    ck = tmp_path / "ck"
    ck.mkdir()
    # It reports its first step and a throughput point like the library does (the daemon resizes no start
    # before its first-step record, and grows no job on a bare prior),
    # then ignores the checkpoint signal and never acks.
    script.write_text("#!/bin/bash\n"
                      f"printf '{{\"format\": 1, \"job_id\": %s, \"points\": [{{\"gpus\": 1, \"batch\": 64, \"samples_per_s\": 50.0}}], \"starts\": "
                      "[{\"restart_count\": %s, \"first_step\": %s}]}' \"$SLURM_JOB_ID\" "
                      f"\"${{SLURM_RESTART_COUNT:-0}}\" \"$(date +%s)\" > {ck}/throughput.json\n"
                      "srun --ntasks=1 bash -c 'trap \"\" USR2; exec sleep 300'\n")
    spec = f"elastic:min_gpus=1,max_gpus=4,min_batch=32,max_batch=256,max_local_batch=64,batch=64,ckpt_dir={ck}"
    jid = slurm_cluster.sbatch(["--hold", "--requeue", "-o", str(tmp_path / "job.out"), "--gres=gpu:1",
                                f"--comment={spec}", str(script)], cwd=tmp_path)
    cfg = write_config(tmp_path / "elastic.toml", tmp_path / "state", max_gpus_per_job=1, ack_timeout_s=5,
                       cooldown_s=10)
    d = DaemonProc.cli(slurm_cluster, cfg, tmp_path / "d0.log")
    try:
        wait_for(lambda: (j := slurm_cluster.backend.get_job(jid)) and j.is_running, 60, "the job to start at 1 GPU")
        time.sleep(2)  # its step (and the trap) is up
        d.stop()
        # A cheap restart (0.5 s): dp's rule that a rescale pays for itself 8x over the time the job has
        # held its size (seconds here) must not be what keeps it from wanting the grow this test is about.
        write_config(cfg, tmp_path / "state", max_gpus_per_job=4, ack_timeout_s=5, cooldown_s=10,
                     restart_cost_s=0.5)
        d = DaemonProc.cli(slurm_cluster, cfg, tmp_path / "d1.log")
        t0 = time.monotonic()
        time.sleep(30)
        observed = time.monotonic() - t0
        log = d.text()
        d.stop()
        job = slurm_cluster.backend.get_job(jid)
    finally:
        d.stop()
        scancel(slurm_cluster, [jid])
    signals = [ln for ln in log.splitlines() if f"job={jid}" in ln and "step=signal" in ln]
    timeouts = [ln for ln in log.splitlines() if f"job={jid}" in ln and "status=timeout" in ln]
    assert signals, log
    assert timeouts and "left running as it is" in timeouts[0], log
    assert len(signals) <= 1 + observed / 10, (len(signals), log)
    assert job.is_running and job.gpus_total == 1 and job.restart_count == 0 and not job.held, job
    assert "step=requeue_hold" not in log
    reliability.jobs(lost=int(not job.is_running), left_held=int(job.held))
    reliability.figure("attempts in 30 s", len(signals))
    reliability.figure("timeouts logged", len(timeouts))
