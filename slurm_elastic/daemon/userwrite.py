"""Writing into a job's directory from a root process: as the job's owner, never through a user's link.

The read side is :mod:`userfiles`; this is its write side (``slurm-elastic stop`` creating
``stop-request.<job>.<restart>``). Root acts on a user's paths only as that user, or not at all:

- running as the job's uid: the walk and the create happen in this process;
- running as root for another uid: a forked child drops to the job's user (``setgroups([])``,
  ``setgid``, ``setuid``) and does the walk and the create, so the kernel checks the user's own
  permissions and the file is the user's, never root's; the parent only reads the child's answer (with
  a time bound) from a pipe;
- any other caller: refused (the file would belong to the wrong user).

The walk is :func:`userfiles.open_dir` (``openat`` + ``O_NOFOLLOW|O_DIRECTORY``, a symlink followed
only where root alone could have put it, the directory owned by the job's uid and not world-writable).
The file is created with ``O_CREAT|O_EXCL|O_NOFOLLOW|O_NONBLOCK``: an existing name of any kind is never
opened; a symlink, FIFO, device, socket or directory there is refused by ``lstat`` (no open, so no
block), a regular file of the job's user is left as it is.

Anything wrong raises :class:`userfiles.UserFileError` naming the path; a missing directory raises
FileNotFoundError (the caller decides whether that matters).
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import select
import signal
import stat
import time

from slurm_elastic.daemon.userfiles import UserFileError, _check_file, open_dir

CHILD_TIMEOUT_S = 30.0  # the walk and a create: a hung file system fails, it does not hang the caller
CREATED, EXISTED = "created", "existed"


def create_file(dir_path: str, name: str, uid: int | None, *, data: bytes = b"", mode: int = 0o644,
                timeout_s: float = CHILD_TIMEOUT_S) -> str:
    """Create ``dir_path/name`` holding ``data``, owned by ``uid``; :data:`CREATED` or :data:`EXISTED`.

    An existing regular file of the job's user is left unchanged (:data:`EXISTED`): the request is
    already there. Raises UserFileError (naming the path) when anything is unsafe, FileNotFoundError
    when the directory does not exist.
    """
    if "/" in name or name in ("", ".", ".."):
        raise UserFileError(f"{dir_path}/{name}", "bad file name")
    path = f"{dir_path.rstrip('/')}/{name}"
    if uid is None:
        raise UserFileError(path, "not written: the job's uid is unknown")
    euid = os.geteuid()
    if euid == uid:
        return _create(dir_path, name, uid, data, mode)
    if euid != 0:
        raise UserFileError(path, f"not written: this process runs as uid {euid}, not as the job's user (uid {uid})")
    try:
        gid = pwd.getpwuid(uid).pw_gid
    except KeyError:
        raise UserFileError(path, f"not written: the job's uid {uid} has no passwd entry to act as") from None
    return _as_user(uid, gid, path, timeout_s, lambda: _create(dir_path, name, uid, data, mode))


def _create(dir_path: str, name: str, uid: int, data: bytes, mode: int) -> str:
    path = f"{dir_path.rstrip('/')}/{name}"
    try:
        dfd = open_dir(dir_path, uid)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise UserFileError(dir_path, f"cannot open directory ({e.strerror})") from None
    try:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
        try:
            fd = os.open(name, flags, mode, dir_fd=dfd)
        except FileExistsError:
            # O_EXCL: whatever is there (a symlink too, dangling or not) was not opened. Look, do not touch.
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            _check_file(path, st, uid, 1 << 62)  # its size does not matter: it is left as it is
            return EXISTED
        except OSError as e:
            raise UserFileError(path, f"cannot create ({e.strerror})") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                raise UserFileError(path, f"created as uid {st.st_uid}, not as the job's user (uid {uid})")
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        return CREATED
    finally:
        os.close(dfd)


def _as_user(uid: int, gid: int, path: str, timeout_s: float, fn) -> str:
    """``fn()`` in a forked child running as uid/gid (no supplementary groups); its answer or its error."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        code = 1
        try:
            os.close(r)
            try:
                os.setgroups([])
                os.setgid(gid)
                os.setuid(uid)
                if os.geteuid() != uid or os.getegid() != gid or os.getuid() != uid:
                    raise UserFileError(path, f"not written: could not become uid {uid}")
                out = {"ok": fn()}
            except UserFileError as e:
                out = {"error": [e.path, e.reason]}
            except FileNotFoundError as e:
                out = {"missing": e.strerror or "no such file or directory"}
            except OSError as e:
                out = {"error": [path, f"failed as uid {uid} ({e.strerror})"]}
            except BaseException as e:  # noqa: BLE001 - reported to the parent, whatever it is
                out = {"error": [path, f"failed as uid {uid} ({type(e).__name__}: {e})"]}
            os.write(w, json.dumps(out).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                raise UserFileError(path, f"not written: no answer within {timeout_s:g} s from the child acting as uid {uid}")
            ready, _, _ = select.select([r], [], [], left)
            if not ready:
                continue
            b = os.read(r, 65536)
            if not b:
                break
            chunks.append(b)
            if sum(map(len, chunks)) > 65536:
                break
    finally:
        os.close(r)
        while True:
            try:
                os.waitpid(pid, 0)
                break
            except ChildProcessError:
                break
            except InterruptedError:
                continue
    try:
        out = json.loads(b"".join(chunks).decode())
    except ValueError:
        raise UserFileError(path, f"not written: the child acting as uid {uid} gave no answer") from None
    if "ok" in out:
        return out["ok"]
    if "missing" in out:
        raise FileNotFoundError(errno.ENOENT, out["missing"], path)
    p, reason = out["error"]
    raise UserFileError(p, reason)
