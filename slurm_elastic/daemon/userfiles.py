"""Reading files that users control, as root, without being stopped or fooled by them.

Every file the daemon reads from a job's checkpoint directory (throughput report, stop-ack, ...) goes
through :func:`read_json`. The daemon runs as root, so a user could otherwise point it at anything:

- the directory is walked one component at a time with ``openat`` + ``O_NOFOLLOW|O_DIRECTORY``; a
  symlink is followed only where it sits in a directory that only root can write (``/home -> /data/home``
  set up by the site), never in one a user can write;
- the directory must be owned by the job's user (uid from Slurm's job record) and not world-writable;
- the file is ``lstat``-ed first (a FIFO, device or socket is refused without being opened), opened
  ``O_NOFOLLOW|O_NONBLOCK`` (a FIFO swapped in meanwhile cannot block the open), ``fstat``-ed again
  (a regular file, owned by the job's user, at most :data:`MAX_BYTES`), and read with a bound;
- the JSON is parsed strictly: ``NaN``/``Infinity`` and numbers that do not fit a float are refused.

Anything wrong raises :class:`UserFileError` naming the path; the caller makes it *that job's* error.
"""

from __future__ import annotations

import errno
import json
import os
import stat

MAX_BYTES = 256 * 1024  # a throughput report of 256 points is ~40 KB
MAX_SYMLINKS = 16
_ROOT_ONLY = 0o022  # group/other write bits


class UserFileError(ValueError):
    """A file or directory a job controls is unsafe or malformed; ``path`` names it."""

    def __init__(self, path: str, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{reason}: {path}")

    def describe(self) -> str:
        """The path first: ``/d/stop-request.12.0 is a symlink (not followed)``, ``/d: directory owned by ...``."""
        return f"{self.path} {self.reason}" if self.reason.startswith("is ") else f"{self.path}: {self.reason}"


def _is_trusted_dir(st: os.stat_result) -> bool:
    """Only root can change what this directory holds (so a symlink in it was put there by root)."""
    return st.st_uid == 0 and not (st.st_mode & _ROOT_ONLY)


def open_dir(path: str, uid: int | None) -> int:
    """An O_DIRECTORY fd of the job's directory ``path`` (absolute), walked without trusting user symlinks.

    Raises FileNotFoundError when it does not exist (yet), UserFileError when it is unsafe.
    """
    if uid is None:
        raise UserFileError(path, "the job's uid is unknown; its files are not read")
    if not path.startswith("/"):
        raise UserFileError(path, "not an absolute path")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    hops = 0
    try:
        while parts:
            name = parts.pop(0)
            if name == "..":
                raise UserFileError(path, "'..' in the path")
            try:
                nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK,
                              dir_fd=fd)
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISLNK(st.st_mode):
                    raise UserFileError(path, f"component {name!r} is not a directory") from None
                if not _is_trusted_dir(os.fstat(fd)):
                    raise UserFileError(path, f"component {name!r} is a symlink in a directory users can write") from None
                hops += 1
                if hops > MAX_SYMLINKS:
                    raise UserFileError(path, "too many symlinks") from None
                target = os.readlink(name, dir_fd=fd)
                tparts = [p for p in target.split("/") if p not in ("", ".")]
                if target.startswith("/"):
                    os.close(fd)
                    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                elif ".." in tparts:
                    raise UserFileError(path, f"symlink {name!r} climbs with '..'") from None
                parts = tparts + parts
                continue
            os.close(fd)
            fd = nfd
        st = os.fstat(fd)
        if st.st_uid != uid:
            raise UserFileError(path, f"directory owned by uid {st.st_uid}, not the job's user (uid {uid})")
        if st.st_mode & 0o002:
            raise UserFileError(path, "directory is world-writable")
        out, fd = fd, -1
        return out
    finally:
        if fd >= 0:
            os.close(fd)


def read_bytes(dir_path: str, name: str, uid: int | None, max_bytes: int = MAX_BYTES) -> bytes | None:
    """The bytes of ``dir_path/name``, or None when the file (or the directory) does not exist."""
    if "/" in name or name in ("", ".", ".."):
        raise UserFileError(f"{dir_path}/{name}", "bad file name")
    path = f"{dir_path.rstrip('/')}/{name}"
    try:
        dfd = open_dir(dir_path, uid)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise UserFileError(dir_path, f"cannot open directory ({e.strerror})") from None
    try:
        try:
            st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
        except FileNotFoundError:
            return None
        _check_file(path, st, uid, max_bytes)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY, dir_fd=dfd)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise UserFileError(path, f"cannot open ({e.strerror})") from None
        try:
            st2 = os.fstat(fd)
            _check_file(path, st2, uid, max_bytes)
            if (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino):
                raise UserFileError(path, "file replaced while being opened")
            chunks, left = [], max_bytes + 1
            while left > 0:
                b = os.read(fd, min(left, 65536))
                if not b:
                    break
                chunks.append(b)
                left -= len(b)
            data = b"".join(chunks)
            if len(data) > max_bytes:
                raise UserFileError(path, f"larger than {max_bytes} bytes")
            return data
        finally:
            os.close(fd)
    finally:
        os.close(dfd)


def _check_file(path: str, st: os.stat_result, uid: int, max_bytes: int) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise UserFileError(path, "is a symlink (not followed)")
    if not stat.S_ISREG(st.st_mode):
        kind = ("FIFO" if stat.S_ISFIFO(st.st_mode) else "device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                else "socket" if stat.S_ISSOCK(st.st_mode) else "directory" if stat.S_ISDIR(st.st_mode) else "special file")
        raise UserFileError(path, f"is a {kind}, not a regular file")
    if st.st_uid != uid:
        raise UserFileError(path, f"owned by uid {st.st_uid}, not the job's user (uid {uid})")
    if st.st_size > max_bytes:
        raise UserFileError(path, f"{st.st_size} bytes, more than the {max_bytes} allowed")


def _no_constant(name: str):
    raise ValueError(f"{name} is not a number")


def _strict_float(text: str) -> float:
    x = float(text)
    if x != x or x in (float("inf"), float("-inf")):
        raise ValueError(f"number {text[:30]} is out of range")
    return x


def _strict_int(text: str) -> int:
    if len(text) > 19:
        raise ValueError(f"integer {text[:30]}... is out of range")
    return int(text)


def parse_json(data: bytes, path: str):
    """Strict JSON: UTF-8, no NaN/Infinity, no number that overflows a float or an int64."""
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_no_constant, parse_float=_strict_float,
                          parse_int=_strict_int)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise UserFileError(path, f"not strict JSON ({str(e)[:120]})") from None


def read_json(dir_path: str, name: str, uid: int | None, max_bytes: int = MAX_BYTES):
    """Parsed strict JSON of ``dir_path/name`` (None when absent); raises UserFileError."""
    data = read_bytes(dir_path, name, uid, max_bytes)
    if data is None:
        return None
    return parse_json(data, f"{dir_path.rstrip('/')}/{name}")
