"""What users control after submission, against the root daemon, on the live cluster with the plugin.

Two unprivileged users (useradd): ``h11a_u1`` plants hostile files in its jobs' checkpoint directories
(a FIFO, a device node, a symlink to a root-only file, a symlink to /dev/zero, a 2 GB sparse file,
NaN/Infinity/negative reports, a forged perfect-scaling report), points ``ckpt_dir`` at the other
user's directory or a system directory, asks for ``weight=1000000``, puts control characters in a spec
key and a newline in a job name. ``h11a_u2`` submits ordinary jobs, which must be started by the same
cycles. One cluster, one daemon (in this process, so that its snapshot and RSS can be read), several
RELIABILITY rows.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from faultlib import jobs_by_id, scancel, unix_users, wait_for

from slurm_elastic.cluster import ClusterError
from slurm_elastic.daemon.config import config_from_dict
from slurm_elastic.daemon.logfmt import LogfmtFormatter
from slurm_elastic.daemon.loop import Daemon
from slurm_elastic.daemon.models import DEFAULT_MODEL

pytestmark = [pytest.mark.slurm]
USERS = ("h11a_u1", "h11a_u2")
SPEC = "elastic:min_gpus=1,max_gpus=8,min_batch=64,max_batch=1024,max_local_batch=256,batch=64"
CASES = ("fifo", "device", "symlink_rootonly", "symlink_devzero", "sparse_2g", "nan", "inf", "negative", "forged")
REPORT_CASES = {"nan": "NaN", "inf": "Infinity", "negative": "-5.0"}


@pytest.fixture(scope="module")
def users():
    with unix_users(USERS) as found:
        yield found


def rss_kib() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        k, _, v = line.partition(":")
        if k in ("VmRSS", "VmHWM"):
            out[k] = int(v.split()[0])
    return out


def own(path: Path, pw, link=False) -> None:
    (os.lchown if link else os.chown)(path, pw.pw_uid, pw.pw_gid)


def plant(case: str, d: Path, pw, rootonly: Path) -> None:
    """The hostile thing of ``case`` as the job's throughput.json, owned by the job's user."""
    p = d / "throughput.json"
    if case == "fifo":
        os.mkfifo(p)
    elif case == "device":  # a user cannot mknod; a hard link or a mount could give one: refused unopened
        os.mknod(p, 0o644 | stat.S_IFCHR, os.makedev(1, 5))
    elif case == "symlink_rootonly":
        p.symlink_to(rootonly)
    elif case == "symlink_devzero":
        p.symlink_to("/dev/zero")
    elif case == "sparse_2g":
        with open(p, "wb") as f:
            f.truncate(2 << 30)
    elif case in REPORT_CASES:
        p.write_text('{"format": 1, "points": [{"gpus": 1, "batch": 64, "samples_per_s": ' + REPORT_CASES[case] + "}]}")
    elif case == "forged":
        p.write_text(json.dumps({"format": 1, "points": [{"gpus": k, "batch": 64, "samples_per_s": 1000.0 * k,
                                                          "steps": 100, "seconds": 10.0, "samples": 10000 * k}
                                                         for k in (1, 2, 4, 8)]}))
    own(p, pw, link=case.startswith("symlink"))


@pytest.mark.parametrize("lua_cluster", ["host"], indirect=True)  # the host's Slurm only (issue 24)
def test_hostile_user_files_paths_and_names(lua_cluster, users, tmp_path, reliability, request):
    c = lua_cluster
    u1, u2 = users[USERS[0]], users[USERS[1]]
    rows = {k: (reliability if k == "files" else type(reliability)(request.node.nodeid))
            for k in ("files", "reports", "forged", "paths", "escape", "restart")}
    rows["files"]("user files", "hostile files as the job's throughput report (2 users, plugin on, daemon as root)",
                  "FIFO, char device, symlink to a root-only file, symlink to /dev/zero, 2 GB sparse file",
                  "every cycle completes (none blocks); each job named with its path in the log and in status; "
                  "the other user's jobs started in the same cycle; the jobs themselves keep their prior model; "
                  "RSS bounded")
    rows["reports"]("user files", "bad numbers in a throughput report", "NaN, Infinity, negative samples/s",
                    "cycle completes for all; that job named (log + status), its report not used")
    rows["forged"]("reports earn trust", "forged perfect-scaling report (1..8 GPUs, valid JSON)",
                   "points at GPU counts the job never ran on", "all points unverified and ignored: the job's model "
                   "is the default prior, provenance shown in status")
    rows["paths"]("paths and weights", "ckpt_dir of another user, ckpt_dir=/etc and the daemon's state dir, "
                  "weight=1000000", "foreign dir to the daemon; system dirs to sbatch with the plugin",
                  "foreign dir and weight: bad spec naming job, field and path, never acted on, left as submitted "
                  "(held); system dirs refused at submit naming ckpt_dir")
    rows["escape"]("escaping", "control characters in a spec key (ESC, \\x1f, newline via scontrol update) and a "
                   "newline in a job name", "daemon log (logfmt) and `status`",
                   "one log line per event with the key escaped and the job named; status prints one line per job")
    rows["restart"]("user files", "daemon restarted with every hostile file still in place",
                    "close, open (lock, reconcile), one cycle", "restart and cycle complete; the same jobs named")

    base = Path(tempfile.mkdtemp(prefix="h11a-", dir=c.script.parent))
    os.chmod(base, 0o755)
    rootonly = base / "rootonly.json"
    rootonly.write_text(json.dumps({"points": [{"gpus": k, "batch": 64, "samples_per_s": 1e5 * k} for k in (1, 2, 4, 8)]}))
    os.chmod(rootonly, 0o600)
    state = tmp_path / "state"
    logbuf = io.StringIO()
    handler = logging.StreamHandler(logbuf)
    handler.setFormatter(LogfmtFormatter())
    logger = logging.getLogger("slurm_elastic")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    ids: list[int] = []
    d = d2 = None

    def submit(pw, name, comment, cwd, job_name=None):
        jid = c.sbatch(["--requeue", "--gres=gpu:1", "-o", "/dev/null", f"--job-name={job_name or 'h11a-' + name}",
                        f"--comment={comment}", str(c.script)], cwd=cwd, user=pw.pw_name)
        ids.append(jid)
        return jid

    def userdir(pw, name):
        p = base / f"{pw.pw_name}-{name}"
        p.mkdir()
        os.chmod(p, 0o755)
        own(p, pw)
        return p

    try:
        # The other user's ordinary jobs first (earlier submit = higher priority; see the caps note in the report).
        good_dirs = [userdir(u2, f"good{i}") for i in range(2)]
        good = [submit(u2, f"good{i}", f"{SPEC},ckpt_dir={g}", g) for i, g in enumerate(good_dirs)]
        nl_dir = userdir(u2, "nl")
        newline = submit(u2, "nl", f"{SPEC},ckpt_dir={nl_dir}", nl_dir, job_name="evil\nname")
        hostile = {}
        for case in CASES:
            dd = userdir(u1, case)
            hostile[case] = (submit(u1, case, f"{SPEC},ckpt_dir={dd}", dd), dd)
            plant(case, dd, u1, rootonly)
        foreign = submit(u1, "foreign", f"{SPEC},ckpt_dir={good_dirs[0]}", userdir(u1, "foreign-cwd"))
        heavy_dir = userdir(u1, "heavy")
        heavy = submit(u1, "heavy", f"{SPEC},weight=1000000,ckpt_dir={heavy_dir}", heavy_dir)
        ctl_dir = userdir(u1, "ctl")
        ctl = submit(u1, "ctl", f"{SPEC},ckpt_dir={ctl_dir}", ctl_dir)
        # Root edits the comment after submit (the plugin lets the daemon's uids do so): control characters.
        evil = f"{SPEC},ckpt_dir={ctl_dir},\x1b[31mevil\x1fkey\nlevel=error=1"
        r = subprocess.run([f"{c.config.bin}/scontrol", "update", f"JobId={ctl}", f"Comment={evil}"], env=c.env,
                           capture_output=True, text=True, timeout=30, check=False)
        assert r.returncode == 0, r.stderr
        assert c.backend.get_job(ctl).comment == evil
        # System directories: refused at submit by the plugin, naming the field.
        refused = 0
        for sysdir in ("/etc", "/var/lib/slurm-elastic/%j"):
            with pytest.raises(ClusterError) as e:
                submit(u1, "sys", f"{SPEC},ckpt_dir={sysdir}", ctl_dir)
            assert "field 'ckpt_dir'" in str(e.value) and "system directory" in str(e.value), str(e.value)
            refused += 1
        recs = jobs_by_id(c, ids, include_finished=False)
        assert all(recs[j].held for j in ids) and recs[hostile["fifo"][0]].user_id == u1.pw_uid

        cfg = config_from_dict({"state_dir": str(state), "metrics_address": "", "cooldown_s": 3600,
                                "partitions": ["gpu"], "max_gpus_per_user": 4, "poll_interval_s": 2})
        d = Daemon(cfg, backend=c.backend)
        rss0 = rss_kib()
        d.open()
        times, results = [], []
        for i in range(5):
            t0 = time.monotonic()
            res = d.cycle()
            times.append(time.monotonic() - t0)
            assert res is not None
            results.append(res)
            if i == 0:
                rss1 = rss_kib()  # after the first cycle: imports and JIT of the policy, and every hostile file read
        rss2 = rss_kib()
        growth_mib = (rss2["VmRSS"] - rss1["VmRSS"]) / 1024
        print(f"\nadversarial cycles s: {', '.join(f'{t:.2f}' for t in times)}; RSS before {rss0['VmRSS'] // 1024} MiB, "
              f"after cycle 1 {rss1['VmRSS'] // 1024} MiB, after cycle 5 {rss2['VmRSS'] // 1024} MiB "
              f"(growth {growth_mib:.1f} MiB), peak {rss2['VmHWM'] // 1024} MiB")
        assert rss2["VmHWM"] < 1024 * 1024 and growth_mib < 32 and max(times) < 30
        log_text = logbuf.getvalue()
        snap = results[-1].snapshot

        # Files: each job named with the path, reason matching the case; never blocked.
        why = {"fifo": "FIFO", "device": "device", "symlink_rootonly": "symlink", "symlink_devzero": "symlink",
               "sparse_2g": "bytes, more than", "nan": "strict JSON", "inf": "strict JSON", "negative": "out of range"}
        for case, (jid, dd) in hostile.items():
            if case == "forged":
                continue
            problem = d.models.problems.get(jid, "")
            assert str(dd / "throughput.json") in problem and why[case] in problem, (case, problem)
            assert f"job={jid}" in log_text and str(dd) in log_text
            assert "report rejected" in d.models.sources[jid], d.models.sources[jid]
        # The forged report: every point unverified; the job runs on the default prior.
        fj = hostile["forged"][0]
        assert "unverified ignored" in d.models.sources[fj] and d.models.sources[fj].startswith("prior")
        req = {j.job_id: j for j in snap.problem.jobs}
        assert req[fj].model.provenance == "prior" and req[fj].model.inner is DEFAULT_MODEL
        assert req[fj].model.scale == 1.0  # nothing verified: the prior, not scaled to the forged figures
        # Paths and weight: bad specs naming job, field and path; never acted on.
        err_f, err_w = str(snap.errors[foreign]), str(snap.errors[heavy])
        assert f"job {foreign}" in err_f and "ckpt_dir" in err_f and str(good_dirs[0]) in err_f, err_f
        assert f"job {heavy}" in err_w and "weight" in err_w and "site maximum" in err_w, err_w
        acted = {x.action.job_id for res in results for x in res.results}
        assert not acted & {foreign, heavy, ctl}
        # Control characters: the log stays one line per event, the key escaped, the job named.
        assert ctl in snap.errors
        lines = [ln for ln in log_text.splitlines() if f"job={ctl}" in ln]
        assert lines and all("\x1b" not in ln and "\x1f" not in ln for ln in log_text.splitlines())
        assert any("\\x1b[31mevil\\x1fkey\\nlevel" in ln for ln in lines), lines
        assert not any(ln.startswith("level=error=1") for ln in log_text.splitlines())

        # The other user's jobs (and the hostile ones up to the caps) were started by these cycles.
        placed = wait_for(lambda: (r := jobs_by_id(c, good)) and all(x.is_running for x in r.values()) and r,
                          60, "u2's jobs to run")
        assert all(x.admin_comment.startswith("elastic-decision:") for x in placed.values())

        # status: the provenance and the rejected report shown per job; a newline in a name stays one line.
        env = dict(c.env, PATH=f"{c.config.bin}:{os.environ.get('PATH', '')}")
        st = subprocess.run([sys.executable, "-m", "slurm_elastic.cli", "status", "--state-dir", str(state), "--json"],
                            env=env, capture_output=True, text=True, timeout=60, check=True)
        by_id = {r["jobid"]: r for r in json.loads(st.stdout)["jobs"]}
        assert "FIFO" in by_id[hostile["fifo"][0]]["report_error"]
        assert "unverified" in by_id[fj]["model"]
        table = subprocess.run([sys.executable, "-m", "slurm_elastic.cli", "status", "--state-dir", str(state),
                                "-j", f"{newline},{hostile['fifo'][0]}", "-o", "jobid,name,model,reason"],
                               env=env, capture_output=True, text=True, timeout=60, check=True).stdout
        print(table)
        assert len(table.splitlines()) == 3 and "evil\\nname" in table and "FIFO" in table, table

        # Restart with every hostile file in place.
        d.close()
        d = None
        t0 = time.monotonic()
        d2 = Daemon(cfg, backend=c.backend)
        d2.open()
        res = d2.cycle()
        restart_s = time.monotonic() - t0
        assert res is not None and hostile["fifo"][0] in d2.models.problems and foreign in res.snapshot.errors
        d2.close()
        d2 = None
        rss3 = rss_kib()

        recs = jobs_by_id(c, ids)
        lost = sum(1 for j in ids if j not in recs or not recs[j].is_active)
        running = [j for j in ids if recs[j].is_running]
        bad_spec_held = sum(1 for j in (foreign, heavy, ctl) if recs[j].held)
        # Left held after a decision: a job the daemon decided on (AdminComment) but did not release.
        left_held = sum(1 for j in ids if recs[j].held and recs[j].admin_comment)
    finally:
        for x in (d, d2):
            if x is not None:
                x.close()
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        scancel(c, ids)
        shutil.rmtree(base, ignore_errors=True)
    assert lost == 0 and left_held == 0 and bad_spec_held == 3
    for row in rows.values():
        row.jobs(lost=lost, left_held=left_held)
    rows["files"].figure("cycle s (max of 5)", f"{max(times):.2f}")
    rows["files"].figure("RSS MiB after cycle 1 / 5", f"{rss1['VmRSS'] // 1024} / {rss2['VmRSS'] // 1024}")
    rows["files"].figure("peak RSS MiB (pytest + daemon, after restart)", rss3["VmHWM"] // 1024)
    rows["files"].figure("jobs running at the end", len(running))
    rows["reports"].figure("jobs named", 3)
    rows["paths"].figure("refused at submit", f"{refused}/2")
    rows["paths"].figure("bad specs kept held (never acted on)", bad_spec_held)
    rows["restart"].figure("restart + cycle s", f"{restart_s:.2f}")
