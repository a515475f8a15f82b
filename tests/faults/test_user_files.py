"""What users control after submission, against the root daemon, on the live cluster with the plugin.

Two unprivileged users (useradd): ``h11a_u1`` plants hostile files in its jobs' checkpoint directories
(a FIFO, a device node, a symlink to a root-only file, a symlink to /dev/zero, a 2 GB sparse file,
NaN/Infinity/negative reports, a forged perfect-scaling report), points ``ckpt_dir`` at the other
user's directory or a system directory, asks for ``weight=1000000``, puts control characters in a spec
key and a newline in a job name. ``h11a_u2`` submits ordinary jobs, which must be started by the same
cycles. One cluster, one daemon (in this process, so that its snapshot and RSS can be read), several
RELIABILITY rows.

On the same cluster and users, a second daemon reads hostile out-of-memory reports
(``oom.<job>.<restart>.json``: FIFO, symlink, oversized, bad numbers, another batch, job or restart) and
reports forged to match the start's decision, each forger against an honest twin of the other user.
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


def capture_log():
    """The daemon's log lines (logfmt, INFO and up) into a buffer, as an operator reads them; returns the
    buffer and the function that undoes it."""
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(LogfmtFormatter())
    logger = logging.getLogger("slurm_elastic")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)

    def restore():
        logger.removeHandler(handler)
        logger.setLevel(old_level)

    return buf, restore


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
    logbuf, restore_log = capture_log()
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
        restore_log()
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


OOM_ONE = "elastic:min_gpus=1,max_gpus=1,min_batch=64,max_batch=64,max_local_batch=64,max_accum=2,batch=64"
# The twins: 1 GPU at 1 x 64 fits a local batch below 64 with accumulation (A) or not at all (B: 2 GPUs).
OOM_TWIN_A = "elastic:min_gpus=1,max_gpus=4,min_batch=64,max_batch=256,max_local_batch=64,max_accum=2,batch=64"
OOM_TWIN_B = OOM_TWIN_A.replace("max_accum=2", "max_accum=1")
# (case, what the daemon's reason must say): one case per cycle and per job, two hostile jobs
OOM_ROUNDS = (
    (("fifo", "is a FIFO, not a regular file"), ("nan", "not strict JSON")),
    (("symlink_rootonly", "is a symlink (not followed)"), ("huge_float", "not strict JSON")),
    (("oversized", "5000 bytes, more than the 4096 allowed"), ("huge_int", "not a report for this job and start")),
    (("negative", "not a report for this job and start"), ("not_decision", "is not this start's decision")),
    (("other_users_job", "not a report for this job and start"), ("other_restart", "not a report for this job and start")),
)


def plant_oom(case: str, path: Path, pw, rootonly: Path, jid: int, other_jid: int) -> None:
    """The hostile out-of-memory report of ``case`` at ``path``, owned by the job's user; whatever was there
    before is removed first."""
    path.unlink(missing_ok=True)
    rep = {"format": 1, "job_id": str(jid), "restart_count": 0, "local_batch": 64, "accum": 1, "world_size": 1,
           "global_batch": 64}  # the decision of this start (1 x 64): each case spoils one thing
    if case == "fifo":
        os.mkfifo(path)
    elif case == "symlink_rootonly":
        path.symlink_to(rootonly)
    elif case == "oversized":
        path.write_text(json.dumps(rep).ljust(5000))
    elif case in ("nan", "huge_float"):
        path.write_text(json.dumps(rep).replace('"local_batch": 64', '"local_batch": '
                                                + ("NaN" if case == "nan" else "1e400")))
    else:
        rep.update({"huge_int": {"local_batch": 1 << 40}, "negative": {"local_batch": -64},
                    "not_decision": {"local_batch": 32, "accum": 2},  # a valid shape of the spec, not this start's
                    "other_users_job": {"job_id": str(other_jid)}, "other_restart": {"restart_count": 1}}[case])
        path.write_text(json.dumps(rep))
    own(path, pw, link=case.startswith("symlink"))


@pytest.mark.parametrize("lua_cluster", ["host"], indirect=True)  # the host's Slurm only, like the row above
def test_hostile_out_of_memory_reports(lua_cluster, users, tmp_path, reliability):
    from faultlib import ACKING

    from slurm_elastic.spec import parse_decision
    from slurm_elastic.train.protocol import CHECKPOINT_NAME, oom_path

    reliability("user files", "hostile out-of-memory reports (oom.<job>.<restart>.json, read by the root daemon)",
                "FIFO, symlink to a root-only file, 5000-byte file, NaN / 1e400 / 2^40 / negative local batch, a "
                "batch that is not the start's decision, another user's job id, another restart; then reports "
                "forged to match the start's decision by two jobs in their cooldown, each against an honest twin "
                "(same spec, other user), with 4 GPUs free (2 users, plugin on)",
                "every cycle completes and starts the other user's new jobs; each bad report named in the log with "
                "the job and the path, no limit learned from it; a forger is restarted below its batch and gets no "
                "more GPUs than its twin (1) but the fewest its own claim requires (2 where 1 GPU cannot run "
                "batch 64 below local batch 64 without accumulation), never the free GPUs; no job lost, left "
                "held or without its checkpoint")
    c = lua_cluster
    u1, u2 = users[USERS[0]], users[USERS[1]]
    base = Path(tempfile.mkdtemp(prefix="h23o-", dir=c.script.parent))
    os.chmod(base, 0o755)
    rootonly = base / "rootonly.json"
    rootonly.write_text(json.dumps({"job_id": "1", "restart_count": 0, "local_batch": 64, "accum": 1,
                                    "world_size": 1, "global_batch": 64}))
    os.chmod(rootonly, 0o600)
    acking = base / "acking.sh"
    acking.write_text(ACKING)
    acking.chmod(0o755)
    logbuf, restore_log = capture_log()
    ids: list[int] = []
    dirs: dict[int, Path] = {}
    d = None

    def submit(pw, name, spec, script=None):
        p = base / f"{pw.pw_name}-{name}"
        p.mkdir()
        os.chmod(p, 0o755)
        own(p, pw)
        ck = p / CHECKPOINT_NAME  # stands for the job's last checkpoint: it must outlive every report
        ck.write_text(name)
        own(ck, pw)
        argv = ["--requeue", "--gres=gpu:1", "-o", "/dev/null", "--partition=gpu", f"--job-name=h23o-{name}",
                f"--comment={spec},ckpt_dir={p}", str(script or c.script)] + ([str(p)] if script else [])
        jid = c.sbatch(argv, cwd=p, user=pw.pw_name)
        ids.append(jid)
        dirs[jid] = p
        return jid

    try:
        # 2 of node2's GPUs held by a rigid job: the other 6 take the two hostile jobs and the two pairs of
        # twins at 1 GPU each (submitted in this order: earlier = higher priority). The rigid job's GPUs then
        # go to the other user's new jobs, which end before the forgeries: 4 GPUs are free for a forger.
        rigid = c.sbatch(["--gres=gpu:2", "-w", "node2", "-o", "/dev/null", "--partition=gpu", str(c.script)])
        ids.append(rigid)
        wait_for(lambda: jobs_by_id(c, [rigid])[rigid].is_running, 60, "the rigid job to run")
        h1, h2 = submit(u1, "h1", OOM_ONE), submit(u1, "h2", OOM_ONE)
        twins = {k: (submit(u2, f"twin{k}", s, acking), submit(u1, f"forger{k}", s, acking))
                 for k, s in (("A", OOM_TWIN_A), ("B", OOM_TWIN_B))}
        forgers = [f for _, f in twins.values()]
        cfg = config_from_dict({"state_dir": str(tmp_path / "state"), "metrics_address": "", "cooldown_s": 3600,
                                "partitions": ["gpu"], "max_gpus_per_user": 8, "poll_interval_s": 2,
                                "ack_timeout_s": 60, "restart_cost_s": 5})
        d = Daemon(cfg, backend=c.backend)
        d.open()
        times = []

        def cycle():
            t0 = time.monotonic()
            res = d.cycle()
            times.append(time.monotonic() - t0)
            assert res is not None
            return res

        first = [h1, h2, *[j for pair in twins.values() for j in pair]]
        cycle()
        recs = wait_for(lambda: (r := jobs_by_id(c, first)) and all(x.is_running for x in r.values()) and r, 60,
                        "the hostile jobs and the twins to run")
        assert all(x.gpus_total == 1 for x in recs.values()), recs
        scancel(c, [rigid])
        wait_for(lambda: not jobs_by_id(c, [rigid])[rigid].is_active, 60, "the rigid job to end")

        named, late = 0, []
        other = twins["A"][0]  # the other user's job whose id a report names
        for i, round_ in enumerate(OOM_ROUNDS):
            for jid, (case, _) in zip((h1, h2), round_, strict=True):
                plant_oom(case, oom_path(dirs[jid], jid, 0), u1, rootonly, jid, other)
            if i in (0, 2):  # the other user's new job, started by the same cycles
                late.append(submit(u2, f"late{i}", OOM_ONE))
            res = cycle()
            if i in (0, 2):
                started = {x.action.job_id for x in res.results if x.action.kind == "start" and x.status == "done"}
                assert late[-1] in started, [str(a) for a in res.results]
            log_text = logbuf.getvalue()
            for jid, (case, why) in zip((h1, h2), round_, strict=True):
                problem = d.models.oom.problems.get(jid, "")
                path = str(oom_path(dirs[jid], jid, 0))
                assert path in problem and why in problem, (case, problem)
                assert any(f"job={jid}" in ln and path in ln and "out-of-memory report not used" in ln
                           for ln in log_text.splitlines()), (case, log_text[-2000:])
                named += 1
        assert not {h1, h2, other} & set(d.models.oom.limits), d.models.oom.limits  # nothing learned from them
        recs = wait_for(lambda: (r := jobs_by_id(c, late)) and all(x.is_running for x in r.values()) and r, 60,
                        "the other user's new jobs to run")
        late_lost = sum(1 for x in recs.values() if not x.is_active)
        scancel(c, late)  # they were started; their GPUs are now free for whoever may take them
        wait_for(lambda: not any(x.is_active for x in jobs_by_id(c, late).values()), 60, "the new jobs to end")

        # The forgers: a report that matches the start's decision, as an honest out-of-memory failure
        # would write it. The daemon cannot tell; it costs the forger a restart below that batch. The twins
        # (in cooldown) cannot take the free GPUs: a forger must not take them either.
        decs = {}
        for f in forgers:
            dec = decs[f] = parse_decision(jobs_by_id(c, [f])[f].admin_comment, f)
            path = oom_path(dirs[f], f, 0)
            path.write_text(json.dumps({"format": 1, "job_id": str(f), "restart_count": 0,
                                        "local_batch": dec.local_batch, "accum": dec.accum, "world_size": dec.gpus,
                                        "global_batch": dec.batch}))
            own(path, u1)

        def restarted():
            cycle()
            r = jobs_by_id(c, ids)
            return all(r[f].is_running and r[f].restart_count >= 1 for f in forgers) and r

        wait_for(restarted, 90, "the forgers to run again after their restart")
        for _ in range(3):  # and the cycles after their restart
            cycle()
        recs = jobs_by_id(c, ids)
        gpus = {k: (recs[t].gpus_total, recs[f].gpus_total) for k, (t, f) in twins.items()}
        new = {f: parse_decision(recs[f].admin_comment, f) for f in forgers}
        print(f"\nforgers {[(decs[f].gpus, decs[f].local_batch, decs[f].accum) for f in forgers]} -> "
              f"{[(new[f].gpus, new[f].local_batch, new[f].accum) for f in forgers]}; GPUs twin / forger {gpus}; "
              f"cycles s max {max(times):.2f}")
        for f in forgers:
            assert d.models.oom.notes(f) == [f"local batch <= {decs[f].local_batch - 1} on its GPUs: out of memory "
                                             f"at {decs[f].local_batch}"], d.models.oom.notes(f)
            assert new[f].local_batch < decs[f].local_batch, (decs[f], new[f])
        log = [(f, x["action"], x["reason"]) for f in forgers for x in d.db.decisions(f)]
        assert gpus == {"A": (1, 1), "B": (1, 2)}, (gpus, log)  # B: the fewest that run batch 64 at local <= 63, not 4
        assert all((dirs[j] / CHECKPOINT_NAME).exists() for j in dirs)
        lost = late_lost + sum(1 for j in first if not recs[j].is_active)
        left_held = sum(1 for j in first if recs[j].held)
    finally:
        if d is not None:
            d.close()
        restore_log()
        scancel(c, ids)
        shutil.rmtree(base, ignore_errors=True)
    assert lost == 0 and left_held == 0
    reliability.jobs(lost=lost, left_held=left_held)
    reliability.figure("bad reports named (job + path)", named)
    reliability.figure("cycle s (max)", f"{max(times):.2f}")
    reliability.figure("GPUs twin / forger after the forged report (A: accumulation, B: none; 4 free)",
                       f"A {gpus['A'][0]} / {gpus['A'][1]}, B {gpus['B'][0]} / {gpus['B'][1]}")
