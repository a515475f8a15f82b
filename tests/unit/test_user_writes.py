"""Writing into a job's directory from root (daemon/userwrite.py) and ``slurm-elastic stop`` on hostile
checkpoint directories: a symlinked stop-request (to a root-only target standing for /etc), a symlinked
parent directory, a FIFO as the stop-request or the ack, a directory of another user; as root, the
request is created by the job's user. Slurm is a fake backend; the files are real.

Run as root, the job's user is ``nobody`` (65534) and the file must end up owned by it; as another
user, the job's user is the caller (the walk and refusals are the same, without the privilege drop).
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import stat
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from slurm_elastic.backends.base import JobRecord
from slurm_elastic.commands.stop import stop
from slurm_elastic.daemon import userwrite as uw
from slurm_elastic.daemon.userfiles import UserFileError

ROOT = os.geteuid() == 0
JOB_UID = 65534 if ROOT else os.getuid()
JOB_GID = pwd.getpwuid(JOB_UID).pw_gid
SPEC = "elastic:min_gpus=1,max_gpus=8,min_batch=64,max_batch=1024,max_local_batch=256,batch=256"
JOB = 12
needs_root = pytest.mark.skipif(not ROOT, reason="chown to another user needs root")


def other_user() -> pwd.struct_passwd:
    for name in ("daemon", "bin", "sys"):
        try:
            pw = pwd.getpwnam(name)
        except KeyError:
            continue
        if pw.pw_uid not in (0, JOB_UID):
            return pw
    pytest.skip("no second unprivileged user in passwd")


@pytest.fixture
def base():
    """A root-owned 0755 directory under the temp dir that the job's user can walk into."""
    path = Path(tempfile.mkdtemp(prefix="se-userwrite-"))
    os.chmod(path, 0o755)
    if ROOT:
        for p in path.parents:
            if not os.stat(p).st_mode & stat.S_IXOTH:
                pytest.skip(f"{p} is not searchable by other users")
    yield path
    for p in sorted(path.rglob("*"), key=lambda x: -len(x.parts)):
        if p.is_dir() and not p.is_symlink():
            p.rmdir()
        else:
            p.unlink()
    path.rmdir()


def userdir(parent: Path, name: str, uid: int = JOB_UID, gid: int = JOB_GID) -> Path:
    d = parent / name
    d.mkdir()
    os.chmod(d, 0o755)
    if ROOT:
        os.chown(d, uid, gid)
    return d


@pytest.fixture
def rootonly(base):
    """A directory only its owner (root, when run as root) can enter: the stand-in for /etc."""
    d = base / "etc"
    d.mkdir()
    os.chmod(d, 0o700)
    return d


@pytest.fixture(autouse=True)
def no_hang():
    """The old code blocked forever opening a FIFO: fail such a test after 10 s instead of hanging."""
    class Blocked(Exception):  # not an OSError: code that swallows OSError must not swallow this
        pass

    def boom(signum, frame):  # noqa: ARG001
        signal.alarm(2)  # again, should something swallow it anyway
        raise Blocked("blocked for 10 s (a FIFO opened?)")

    old = signal.signal(signal.SIGALRM, boom)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def owned(path: Path, uid: int = JOB_UID) -> Path:
    if ROOT:
        os.lchown(path, uid, JOB_GID)
    return path


# --- daemon/userwrite.py ------------------------------------------------------------------------------


def test_creates_a_regular_file_of_the_jobs_user_and_leaves_an_existing_one(base):
    d = userdir(base, "ck")
    assert uw.create_file(str(d), "stop-request.12.0", JOB_UID) == uw.CREATED
    st = os.lstat(d / "stop-request.12.0")
    assert stat.S_ISREG(st.st_mode) and st.st_size == 0 and st.st_uid == JOB_UID and st.st_gid == JOB_GID
    assert uw.create_file(str(d), "stop-request.12.0", JOB_UID) == uw.EXISTED
    assert uw.create_file(str(d), "data", JOB_UID, data=b"x" * 100000) == uw.CREATED
    assert (d / "data").read_bytes() == b"x" * 100000


def test_a_missing_directory_is_file_not_found(base):
    with pytest.raises(FileNotFoundError):
        uw.create_file(str(base / "nothing" / "here"), "stop-request.12.0", JOB_UID)


@pytest.mark.parametrize("dangling", [False, True])
def test_a_symlink_is_never_followed(base, rootonly, dangling):
    d = userdir(base, "ck")
    target = rootonly / "passwd"
    if not dangling:
        target.write_text("root:x:0:0\n")
    mtime = target.stat().st_mtime_ns if not dangling else None
    link = owned_link(d / "stop-request.12.0", target)
    with pytest.raises(UserFileError) as e:
        uw.create_file(str(d), "stop-request.12.0", JOB_UID)
    assert e.value.path == str(link) and "is a symlink" in e.value.reason
    assert e.value.describe() == f"{link} is a symlink (not followed)"
    if dangling:
        assert not target.exists()
    else:
        assert target.read_text() == "root:x:0:0\n" and target.stat().st_mtime_ns == mtime


def owned_link(link: Path, target: Path) -> Path:
    link.symlink_to(target)
    return owned(link)


def test_a_symlinked_parent_directory_in_a_user_writable_directory_is_refused(base):
    real = userdir(base, "real")
    os.chmod(base, 0o775)  # group-writable: a symlink in it may be a user's
    owned_link(base / "link", real)
    with pytest.raises(UserFileError, match="symlink in a directory users can write") as e:
        uw.create_file(str(base / "link"), "stop-request.12.0", JOB_UID)
    assert e.value.path == str(base / "link")
    assert list(real.iterdir()) == []


@pytest.mark.parametrize("kind", ["fifo", "dir"])
def test_a_fifo_or_directory_there_is_refused_without_opening_it(base, kind):
    d = userdir(base, "ck")
    p = d / "stop-request.12.0"
    os.mkfifo(p) if kind == "fifo" else p.mkdir()
    owned(p)
    t0 = time.monotonic()
    with pytest.raises(UserFileError, match="FIFO" if kind == "fifo" else "directory") as e:
        uw.create_file(str(d), p.name, JOB_UID)
    assert time.monotonic() - t0 < 2 and e.value.path == str(p)


def test_an_existing_file_of_another_owner_is_refused(base):
    d = userdir(base, "ck")
    (d / "stop-request.12.0").write_text("")
    other = other_user().pw_uid if ROOT else None
    if ROOT:
        os.chown(d / "stop-request.12.0", other, other)
        with pytest.raises(UserFileError, match=f"owned by uid {other}, not the job's user"):
            uw.create_file(str(d), "stop-request.12.0", JOB_UID)
    else:
        with pytest.raises(UserFileError, match="not as the job's user|not written"):
            uw.create_file(str(d), "stop-request.12.0", JOB_UID + 1)


@needs_root
def test_as_root_a_directory_of_another_user_is_refused_and_nothing_is_created(base):
    other = other_user()
    d = userdir(base, "theirs", other.pw_uid, other.pw_gid)
    with pytest.raises(UserFileError, match=f"directory owned by uid {other.pw_uid}, not the job's user") as e:
        uw.create_file(str(d), "stop-request.12.0", JOB_UID)
    assert e.value.path == str(d) and list(d.iterdir()) == []
    # root's own directory is another user's too
    with pytest.raises(UserFileError, match="directory owned by uid 0"):
        uw.create_file(str(base), "stop-request.12.0", JOB_UID)
    assert not (base / "stop-request.12.0").exists()


@needs_root
def test_as_root_the_child_acts_with_the_users_permissions(base):
    d = userdir(base, "ck")
    os.chmod(d, 0o555)  # the user cannot write here; root could
    with pytest.raises(UserFileError, match="cannot create .Permission denied.") as e:
        uw.create_file(str(d), "stop-request.12.0", JOB_UID)
    assert e.value.path == str(d / "stop-request.12.0") and list(d.iterdir()) == []
    with pytest.raises(UserFileError, match="no passwd entry"):
        uw.create_file(str(d), "x", 4000000000)


def test_a_caller_that_is_neither_root_nor_the_user_is_refused(base, monkeypatch):
    d = userdir(base, "ck")
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    with pytest.raises(UserFileError, match="runs as uid 4242, not as the job's user"):
        uw.create_file(str(d), "stop-request.12.0", JOB_UID)
    with pytest.raises(UserFileError, match="uid is unknown"):
        uw.create_file(str(d), "stop-request.12.0", None)
    assert list(d.iterdir()) == []


# --- slurm-elastic stop -------------------------------------------------------------------------------


class FakeSlurm:
    def __init__(self, job: JobRecord, on_signal=None):
        self.job, self.on_signal = job, on_signal
        self.signals: list[str] = []
        self.calls: list[tuple] = []

    def get_job(self, job_id, include_finished=False):  # noqa: ARG002
        return self.job

    def signal(self, job_id, sig="USR2", **kw):  # noqa: ARG002
        self.signals.append(sig)
        if self.on_signal:
            self.on_signal()

    def _call(self, name, args):
        self.calls.append((name, list(args)))
        return ""


def job_in(d: Path, uid: int = JOB_UID) -> JobRecord:
    return JobRecord(job_id=JOB, name="train", user=pwd.getpwuid(uid).pw_name, partition="gpu", state="RUNNING",
                     comment=f"{SPEC},ckpt_dir={d}", user_id=uid, work_dir=str(d))


def run_stop(monkeypatch, fake: FakeSlurm, *args: str):
    monkeypatch.setattr("slurm_elastic.backends.cli.CliBackend", lambda *a, **k: fake)
    t0 = time.monotonic()
    r = CliRunner().invoke(stop, [*args, str(JOB)])
    return r, time.monotonic() - t0


def write_ack(d: Path) -> None:
    p = d / f"stop-ack.{JOB}.0.json"
    p.write_text(json.dumps({"job_id": str(JOB), "restart_count": 0, "optimizer_steps": 7, "checkpoint": "c.pt"}))
    owned(p)


def test_stop_writes_the_request_as_the_jobs_user_then_cancels_after_the_ack(base, monkeypatch):
    d = userdir(base, "ck")
    fake = FakeSlurm(job_in(d), on_signal=lambda: write_ack(d))
    r, _ = run_stop(monkeypatch, fake, "--timeout", "5")
    assert r.exit_code == 0, r.output
    assert fake.signals == ["USR2"] and fake.calls == [("scancel", [str(JOB)])]
    st = os.lstat(d / f"stop-request.{JOB}.0")
    assert stat.S_ISREG(st.st_mode) and (st.st_uid, st.st_gid) == (JOB_UID, JOB_GID)
    assert "stopped after step 7" in r.output


def test_stop_refuses_a_symlinked_request_and_leaves_the_target_and_the_job_alone(base, rootonly, monkeypatch):
    d = userdir(base, "ck")
    target = rootonly / "shadow"  # does not exist: the old code created it, root-owned
    link = owned_link(d / f"stop-request.{JOB}.0", target)
    fake = FakeSlurm(job_in(d))
    r, took = run_stop(monkeypatch, fake, "--timeout", "3")
    assert r.exit_code != 0 and took < 2, r.output
    assert f"job {JOB}: refusing to write stop-request: {link} is a symlink" in r.output, r.output
    assert "was not signalled and keeps running" in r.output
    assert not target.exists() and not fake.signals and not fake.calls
    assert os.readlink(link) == str(target)


def test_stop_refuses_a_symlinked_checkpoint_directory(base, monkeypatch):
    real = userdir(base, "real")
    os.chmod(base, 0o775)
    link = owned_link(base / "ck", real)
    fake = FakeSlurm(job_in(link))
    r, took = run_stop(monkeypatch, fake, "--timeout", "3")
    assert r.exit_code != 0 and took < 2, r.output
    assert f"{link}: component 'ck' is a symlink in a directory users can write" in r.output, r.output
    assert list(real.iterdir()) == [] and not fake.signals


@pytest.mark.parametrize("which", ["stop-request", "stop-ack"])
def test_stop_refuses_a_fifo_at_once(base, monkeypatch, which):
    d = userdir(base, "ck")
    p = d / (f"stop-request.{JOB}.0" if which == "stop-request" else f"stop-ack.{JOB}.0.json")
    os.mkfifo(p)
    owned(p)
    fake = FakeSlurm(job_in(d))
    r, took = run_stop(monkeypatch, fake, "--timeout", "3")
    assert r.exit_code != 0 and took < 2, (r.output, r.exception)
    verb = "write" if which == "stop-request" else "read"
    assert f"job {JOB}: refusing to {verb} {which}: {p} is a FIFO, not a regular file" in r.output, r.output
    assert not fake.signals and not fake.calls and stat.S_ISFIFO(os.lstat(p).st_mode)


def test_stop_times_out_on_a_fifo_ack_that_appears_after_the_signal(base, monkeypatch):
    d = userdir(base, "ck")
    ack = d / f"stop-ack.{JOB}.0.json"
    fake = FakeSlurm(job_in(d), on_signal=lambda: (os.mkfifo(ack), owned(ack)))
    r, took = run_stop(monkeypatch, fake, "--timeout", "1")
    assert r.exit_code != 0 and took < 4, (r.output, r.exception)
    assert f"no checkpoint acknowledgement within 1 s ({ack} is a FIFO" in r.output, r.output
    assert fake.signals == ["USR2"] and not fake.calls  # asked, never cancelled


@needs_root
def test_stop_as_root_refuses_a_directory_of_another_user(base, monkeypatch):
    other = other_user()
    d = userdir(base, "theirs", other.pw_uid, other.pw_gid)
    fake = FakeSlurm(job_in(d))
    r, _ = run_stop(monkeypatch, fake, "--timeout", "3")
    assert r.exit_code != 0, r.output
    assert f"{d}: directory owned by uid {other.pw_uid}, not the job's user (uid {JOB_UID})" in r.output, r.output
    assert list(d.iterdir()) == [] and not fake.signals


def test_stop_without_the_jobs_uid_touches_nothing(base, monkeypatch):
    import dataclasses

    d = userdir(base, "ck")
    fake = FakeSlurm(dataclasses.replace(job_in(d), user_id=None))
    r, _ = run_stop(monkeypatch, fake, "--timeout", "3")
    assert r.exit_code != 0 and "does not report its owner's uid" in r.output, r.output
    assert list(d.iterdir()) == [] and not fake.signals
