"""Reading user-controlled files as root (daemon/userfiles.py), report trust (daemon/reports.py), site
rules (daemon/siterules.py), escaping, and the watchdog: real files, FIFOs, symlinks, sparse files."""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import threading
import time
from pathlib import Path

import pytest

from slurm_elastic.backends.base import JobRecord
from slurm_elastic.daemon import userfiles as uf
from slurm_elastic.daemon.acks import CheckpointDirAck
from slurm_elastic.daemon.logfmt import LogfmtFormatter, logfmt_value
from slurm_elastic.daemon.models import ModelRegistry
from slurm_elastic.daemon.reports import ReportError, RunEvidence, validate_report, verify_points
from slurm_elastic.daemon.siterules import SiteRules
from slurm_elastic.daemon.watchdog import EXIT_STUCK, Watchdog, sd_notify
from slurm_elastic.spec import SpecError, parse_spec

UID = os.getuid()
SPEC = "elastic:min_gpus=1,max_gpus=8,min_batch=64,max_batch=1024,max_local_batch=256,batch=256"


@pytest.fixture
def ck(tmp_path):
    d = tmp_path / "ck"
    d.mkdir()
    os.chmod(tmp_path, 0o755)
    os.chmod(d, 0o755)
    return d


def read(d, name="throughput.json", uid=UID, **kw):
    return uf.read_json(str(d), name, uid, **kw)


def test_reads_a_regular_file_and_absent_is_none(ck):
    (ck / "throughput.json").write_text('{"points": []}')
    assert read(ck) == {"points": []}
    assert read(ck, "nothing.json") is None
    assert read(ck / "missing-dir") is None


def test_fifo_is_refused_at_once_without_blocking(ck):
    os.mkfifo(ck / "throughput.json")
    t0 = time.monotonic()
    with pytest.raises(uf.UserFileError, match="FIFO") as e:
        read(ck)
    assert time.monotonic() - t0 < 1.0
    assert e.value.path.endswith("ck/throughput.json")


def test_symlinks_are_not_followed_in_a_user_directory(ck, tmp_path):
    secret = tmp_path / "secret.json"
    secret.write_text('{"points": []}')
    os.chmod(secret, 0o600)
    (ck / "throughput.json").symlink_to(secret)
    with pytest.raises(uf.UserFileError, match="symlink"):
        read(ck)
    (ck / "throughput.json").unlink()
    (ck / "throughput.json").symlink_to("/dev/zero")
    with pytest.raises(uf.UserFileError, match="symlink"):
        read(ck)
    # a symlinked directory component in a directory users can write (tmp_path here: not root-only? the
    # test makes it group-writable so that it is not trusted)
    os.chmod(tmp_path, 0o775)
    (tmp_path / "link").symlink_to(ck)
    with pytest.raises(uf.UserFileError, match="symlink in a directory users can write"):
        read(tmp_path / "link")


def test_a_device_node_is_refused_without_being_opened(ck):
    if os.geteuid() != 0:
        pytest.skip("mknod needs root")
    os.mknod(ck / "throughput.json", 0o644 | stat.S_IFCHR, os.makedev(1, 5))  # like /dev/zero
    with pytest.raises(uf.UserFileError, match="device"):
        read(ck)


def test_huge_sparse_file_is_refused_by_size_without_reading(ck):
    p = ck / "throughput.json"
    with open(p, "wb") as f:
        f.truncate(2 << 30)  # 2 GiB, no disk blocks
    t0 = time.monotonic()
    with pytest.raises(uf.UserFileError, match="bytes"):
        read(ck)
    assert time.monotonic() - t0 < 0.5


def test_owner_must_be_the_jobs_user(ck):
    (ck / "throughput.json").write_text("{}")
    with pytest.raises(uf.UserFileError, match="not the job's user"):
        read(ck, uid=UID + 12345)
    with pytest.raises(uf.UserFileError, match="uid is unknown"):
        read(ck, uid=None)
    os.chmod(ck, 0o777)
    with pytest.raises(uf.UserFileError, match="world-writable"):
        read(ck)


@pytest.mark.parametrize("text", ['{"x": NaN}', '{"x": Infinity}', '{"x": -Infinity}', '{"x": 1e400}',
                                  '{"x": ' + "9" * 40 + "}", "\xff", "[" * 100000])
def test_strict_json(ck, text):
    (ck / "throughput.json").write_bytes(text.encode("latin-1"))
    with pytest.raises(uf.UserFileError, match="strict JSON"):
        read(ck)


def test_root_owned_symlink_in_a_root_only_directory_is_followed(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root-owned directories")
    top = tmp_path / "site"
    real = tmp_path / "real"
    (real / "ck").mkdir(parents=True)
    top.mkdir()
    for p in (tmp_path, top, real, real / "ck"):
        os.chmod(p, 0o755)
    (top / "home").symlink_to(real)  # like /home -> /data/home, set up by root
    (real / "ck" / "throughput.json").write_text('{"points": []}')
    assert read(top / "home" / "ck") == {"points": []}


# ----- reports ------------------------------------------------------------------------------------
def pt(k, b, sps, **kw):
    return {"gpus": k, "batch": b, "samples_per_s": sps, **kw}


@pytest.mark.parametrize("bad,field", [
    (pt(1, 64, -5.0), "samples_per_s"), (pt(0, 64, 5.0), "gpus"), (pt(1.5, 64, 5.0), "gpus"),
    (pt(1, 64, 5.0, seconds=-1), "seconds"), (pt(1, 64, 5.0, noise_scale=1e300), "noise_scale"),
    (pt(1, 64, 5e7), "samples_per_s"), (pt(1, 64, True), "samples_per_s"), (pt(1, 64, 5.0, base_batch=[1]), "base_batch"),
    ({"gpus": 1, "batch": 64}, "samples_per_s"),
])
def test_report_validation_names_the_point_and_field(bad, field):
    with pytest.raises(ReportError, match=field):
        validate_report({"points": [pt(1, 64, 10.0), bad]}, 7)


def test_report_of_another_job_is_refused():
    with pytest.raises(ReportError, match="not this job"):
        validate_report({"job_id": "8", "points": []}, 7)
    assert validate_report({"job_id": "7", "points": [pt(2, 64, 10.0, extra_field=3)]}, 7)


def test_only_points_backed_by_observed_runs_count():
    ev = RunEvidence()
    ev.observe(7, 0, 1, 1000.0, 1200.0)  # ran 200 s on 1 GPU
    ev.observe(7, 1, 2, 1300.0, 1400.0)  # 100 s on 2 GPUs
    pts = [pt(1, 256, 100.0, seconds=150.0, samples=15000, steps=60), pt(2, 256, 190.0, seconds=90.0),
           pt(4, 256, 400.0), pt(8, 256, 800.0)]  # never ran on 4 or 8 GPUs: a forged perfect curve
    ok, why = verify_points(pts, 7, ev)
    assert [p["gpus"] for p in ok] == [1, 2] and len(why) == 2 and "never ran on 4" in why[0]
    # claims more time than it ran; inconsistent samples/seconds
    ok, why = verify_points([pt(2, 256, 190.0, seconds=5000.0), pt(1, 256, 100.0, seconds=10.0, samples=5000)], 7, ev)
    assert ok == [] and "claims" in why[0] and "disagree" in why[1]


def test_superlinear_needs_two_starts():
    ev = RunEvidence()
    ev.observe(7, 0, 1, 0.0 + 1, 500.0)
    ev.observe(7, 1, 4, 600.0, 900.0)
    pts = [pt(1, 256, 100.0), pt(4, 256, 1000.0)]  # 2.5x per GPU
    ok, why = verify_points(pts, 7, ev)
    assert [p["gpus"] for p in ok] == [1] and "super-linear" in why[0]
    ev.observe(7, 2, 4, 1000.0, 1200.0)
    ok, _ = verify_points(pts, 7, ev)
    assert [p["gpus"] for p in ok] == [1, 4]
    assert RunEvidence.from_json(json.loads(json.dumps(ev.to_json()))).runs == ev.runs
    assert RunEvidence.from_json({"x": "garbage"}).runs == {}


def job(ck, **kw):
    spec = parse_spec(SPEC + f",ckpt_dir={ck}")
    rec = JobRecord(job_id=7, name="j", user="u", partition="gpu", state="RUNNING", comment=spec.to_comment(),
                    user_id=UID, restart_count=0, **kw)
    return rec, spec


def test_a_verified_point_at_a_batch_the_spec_cannot_run_is_named_not_dropped_silently(ck):
    # Found by a flaky live test: a job on 3 GPUs reported batch 64 (no whole per-GPU batch), the point was
    # dropped without a word and the job's throughput stayed 'not verified' with no reason shown
    rec, spec = job(ck, gpus_total=3, gpus_per_node=3, node_count=1)
    reg = ModelRegistry(node_size=4)
    reg.evidence.observe(7, 0, 3, 1000.0, 1300.0)
    (ck / "throughput.json").write_text(json.dumps({"points": [pt(3, 64, 300.0)]}))
    reg(rec, spec)
    assert reg.sources[7] == "prior, 1 unverified ignored"
    assert reg.problems[7] == "unverified points ignored: 3 GPUs x batch 64: not a batch the spec runs on 3 GPUs"
    (ck / "throughput.json").write_text(json.dumps({"points": [pt(3, 192, 300.0)]}))
    reg(rec, spec)
    assert reg.sources[7].startswith("fitted from 1 report") and 7 not in reg.problems


def test_registry_ignores_a_forged_perfect_scaling_report_and_names_the_problem(ck):
    rec, spec = job(ck)
    reg = ModelRegistry(node_size=4)
    reg.evidence.observe(7, 0, 1, 1000.0, 1300.0)
    (ck / "throughput.json").write_text(json.dumps({"points": [pt(k, 256, 100.0 * k) for k in (1, 2, 4, 8)]}))
    model = reg(rec, spec)
    assert reg.sources[7] == "fitted from 1 report, 3 unverified ignored"  # only the 1-GPU point ran
    assert model.samples_per_s(8, 2, 32, 1) < 8 * model.samples_per_s(1, 1, 256, 1)
    assert model.samples_per_s(1, 1, 256, 1) == pytest.approx(100.0)  # the verified point, at its scale
    (ck / "throughput.json").write_text('{"points": [{"gpus": 1, "batch": 256, "samples_per_s": NaN}]}')
    reg(rec, spec)
    assert "strict JSON" in reg.problems[7] and "throughput.json" in reg.problems[7]
    assert "report rejected" in reg.sources[7]


def test_stop_ack_fifo_is_not_an_ack_and_does_not_block(ck):
    rec, _ = job(ck)
    ack = CheckpointDirAck(lambda: {7: rec})
    os.mkfifo(ck / "stop-ack.7.0.json")
    t0 = time.monotonic()
    assert ack.checkpoint_acked(7) is False
    assert time.monotonic() - t0 < 1.0
    os.unlink(ck / "stop-ack.7.0.json")
    (ck / "stop-ack.7.0.json").write_text(json.dumps({"job_id": "7", "restart_count": 0}))
    assert ack.checkpoint_acked(7) is True


# ----- site rules -------------------------------------------------------------------------------
def test_site_rules_weight_and_ckpt_dir(ck, tmp_path):
    rules = SiteRules(max_weight=10, state_dir=str(tmp_path / "state"))
    rec, spec = job(ck)
    rules.check(rec, spec)
    heavy = parse_spec(SPEC + ",weight=1000000")
    with pytest.raises(SpecError, match="site maximum") as e:
        rules.check(rec, heavy)
    assert e.value.field == "weight" and "job 7" in str(e.value)
    foreign = JobRecord(job_id=7, name="j", user="v", partition="gpu", state="PENDING", user_id=UID + 4242)
    with pytest.raises(SpecError, match="not the job's user") as e:
        rules.check(foreign, spec)
    assert e.value.field == "ckpt_dir" and str(ck) in str(e.value)
    (tmp_path / "state").mkdir()
    with pytest.raises(SpecError, match="state directory"):
        rules.check(rec, parse_spec(SPEC + f",ckpt_dir={tmp_path}/state/x"))
    with pytest.raises(SpecError, match="system directory") as e:
        parse_spec(SPEC + ",ckpt_dir=/etc")
    assert e.value.field == "ckpt_dir"
    rules.check(rec, parse_spec(SPEC + f",ckpt_dir={tmp_path}/not-made-yet/%j"))


# ----- escaping ---------------------------------------------------------------------------------
def test_logfmt_escapes_control_characters_and_newlines():
    rec = logging.LogRecord("slurm_elastic", logging.WARNING, __file__, 1, "bad elastic spec", None, None)
    rec.kv = {"job": 5, "error": "unknown key: \x1b[31mevil\nlevel=error job=1 \u2028x"}
    line = LogfmtFormatter().format(rec)
    assert "\n" not in line and "\x1b" not in line and "\u2028" not in line
    assert '\\x1b[31mevil\\nlevel=error job=1 \\u2028x"' in line
    assert logfmt_value("plain") == "plain" and logfmt_value('a "b"') == '"a \\"b\\""'


def test_status_table_and_metrics_labels_escape():
    from slurm_elastic.commands.status import format_table
    from slurm_elastic.daemon.metrics import Metrics

    out = format_table([{"jobid": 1, "name": "a\nb\rc", "reason": "x\ny"}], "jobid,name,reason")
    assert len(out.splitlines()) == 2 and "a\\nb\\x0dc" in out
    m = Metrics()
    m.set("slurm_elastic_jobs", 1, state='x"\n\x1b')
    text = m.render()
    assert 'state="x\\"\\n\ufffd"' in text and "\x1b" not in text


# ----- watchdog ---------------------------------------------------------------------------------
def test_watchdog_ends_a_stuck_cycle_and_a_stop_that_does_not_finish():
    now = [0.0]
    w = Watchdog(60, stop_grace_s=30, clock=lambda: now[0])
    w.progress("cycle 1")
    now[0] = 59
    assert w.check() is None
    now[0] = 61
    assert w.check() == EXIT_STUCK
    w.progress("cycle 2")
    w.stop_requested()
    now[0] = 80
    assert w.check() is None
    now[0] = 92
    assert w.check() == 0
    exited = threading.Event()
    w2 = Watchdog(0.5, exit=lambda code: exited.set())
    w2.start()
    assert exited.wait(5)
    w2.close()


def test_sd_notify_sends_datagrams(tmp_path, monkeypatch):
    path = str(tmp_path / "notify")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    srv.bind(path)
    srv.settimeout(2)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert sd_notify("READY=1")
    assert srv.recv(100) == b"READY=1"
    w = Watchdog(100)
    w.progress("x")
    assert srv.recv(100) == b"WATCHDOG=1"
    srv.close()
    monkeypatch.delenv("NOTIFY_SOCKET")
    assert sd_notify("READY=1") is False


def test_sigterm_during_a_hung_reconcile_at_start_ends_the_daemon(tmp_path):
    """Every Slurm tool hangs (60 s timeout): SIGTERM, then a second one, ends the process at once."""
    import signal
    import subprocess
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("squeue", "sinfo", "scontrol", "scancel", "sacct"):
        (bin_dir / tool).write_text("#!/bin/sh\nexec sleep 100\n")
        (bin_dir / tool).chmod(0o755)
    cfg = tmp_path / "elastic.toml"
    cfg.write_text(f'state_dir = "{tmp_path / "state"}"\nslurm_bin = "{bin_dir}"\nslurm_timeout_s = 60.0\n'
                   'metrics_address = ""\npoll_interval_s = 1\n')
    log = open(tmp_path / "log", "wb")
    p = subprocess.Popen([sys.executable, "-m", "slurm_elastic.cli", "daemon", "--config", str(cfg)], stdout=log,
                         stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        children = Path(f"/proc/{p.pid}/task/{p.pid}/children")
        while time.monotonic() < deadline and not children.read_text().strip():
            time.sleep(0.2)  # until a (hanging) Slurm tool runs: the daemon is in its reconcile at start
        time.sleep(0.5)
        t0 = time.monotonic()
        os.kill(p.pid, signal.SIGTERM)
        time.sleep(0.5)
        assert p.poll() is None  # the first TERM waits (up to 30 s) for the step to finish
        os.kill(p.pid, signal.SIGTERM)
        rc = p.wait(timeout=10)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
            p.wait()
        log.close()
        try:  # its hung tools, in the process group the test started
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    text = (tmp_path / "log").read_text()
    assert rc == 0 and took < 5, (rc, took, text)
    assert "watchdog" in text and "has not finished" in text, text  # hung in open(): config check or reconcile
