"""A second Slurm version on one machine: another Debian release's packages in a debootstrap chroot.

A Debian 12 (bookworm) host ships Slurm 22.05; a Debian 13 (trixie) root made with
``debootstrap --variant=minbase --include=slurm-wlm,munge,slurm-client trixie DIR MIRROR`` runs
Slurm 24.11 beside it (and the reverse on a Debian 13 host). Only Debian's packages are used, from
the same mirror the host's apt uses.

* **Cache.** Roots are built once per machine into ``<cache>/<release>`` (default
  ``/var/cache/slurm-elastic/chroots``; ``SLURM_ELASTIC_CHROOT_CACHE`` overrides it) under a file
  lock, first into ``<release>.partial`` and renamed when complete; ``<release>.stamp`` (JSON: the
  Slurm version, mirror, build seconds, size) marks a complete root, which is then reused as is.
* **Mounts.** Daemons in the root need ``/proc``, ``/dev`` and ``/sys`` (recursively, with the cgroup
  mounts below it, for 22.05's slurmd): they are bind-mounted (as slave mounts) into
  the root while at least one local cluster of this root is up. Several clusters can share one root,
  so ``<release>.holders.json`` lists the state dirs of the clusters using the mounts; a cluster's
  ``down`` removes itself and unmounts only when no live holder is left (lazily if a mount is busy).
* Nothing is ever deleted under a path that still has a mount below it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

KNOWN_RELEASES = {"bookworm": "12", "trixie": "13", "sid": "unstable"}
# The release whose Slurm a host of each release runs in a chroot (a second, different version).
OTHER_RELEASE = {"bookworm": "trixie", "trixie": "bookworm"}
PACKAGES = ("slurm-wlm", "munge", "slurm-client")
# Mounted in this order, unmounted in reverse. /sys is bound recursively: /sys/fs/cgroup (and, with
# cgroup v1, one mount per controller below it) are mounts of their own, which a plain bind does not
# carry, and Slurm before 23.02 has no CgroupPlugin=disabled: its slurmd refuses to start without
# them ("No filesystem mounted on /sys/fs/cgroup", then "Unexpected fs type on
# /sys/fs/cgroup/systemd", both seen with 22.05 in a chroot). Every bind is made a slave mount, so
# that unmounting it can never propagate back to the host's own mounts.
BIND_MOUNTS = ("proc", "dev", "sys")
RECURSIVE = frozenset({"sys"})


class ChrootError(RuntimeError):
    """A chroot could not be built, mounted or unmounted; the message says which and why."""


def cache_dir() -> Path:
    return Path(os.environ.get("SLURM_ELASTIC_CHROOT_CACHE", "/var/cache/slurm-elastic/chroots"))


def host_release(os_release: str = "/etc/os-release") -> str:
    """The host's Debian codename (VERSION_CODENAME in /etc/os-release), e.g. 'bookworm'."""
    try:
        text = Path(os_release).read_text()
    except OSError as e:
        raise ChrootError(f"cannot read {os_release}: {e}") from e
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            fields[key.strip()] = value.strip().strip('"')
    codename = fields.get("VERSION_CODENAME", "")
    if not codename:
        raise ChrootError(f"{os_release} names no VERSION_CODENAME")
    return codename


def other_release(host: str | None = None) -> str | None:
    """The release to run in a chroot beside ``host`` (trixie on bookworm, bookworm on trixie)."""
    return OTHER_RELEASE.get(host or host_release())


MIRROR_ENV = "SLURM_ELASTIC_DEBIAN_MIRROR"


def apt_mirror(host: str | None = None, sources_dir: str = "/etc/apt") -> str:
    """The Debian archive URI the host's apt uses for its own release (deb822 or one-line sources).

    ``SLURM_ELASTIC_DEBIAN_MIRROR`` overrides it. A source counts when it is enabled, of type ``deb``,
    has the host's release as a suite and ``main`` among its components (so a third-party repository
    that also names the codename, e.g. one with component ``stable``, is not taken) and is not the
    security archive. No mirror is named in this code: without such a source it stops and says so.
    """
    override = os.environ.get(MIRROR_ENV)
    if override:
        return override.rstrip("/")
    host = host or host_release()
    base = Path(sources_dir)
    files = [base / "sources.list", *sorted((base / "sources.list.d").glob("*.list")),
             *sorted((base / "sources.list.d").glob("*.sources"))]
    for path in files:
        try:
            text = path.read_text()
        except OSError:
            continue
        found = _deb822_mirror(text, host) if path.suffix == ".sources" else _one_line_mirror(text, host)
        if found:
            return found
    raise ChrootError(f"no Debian archive for {host} (suite {host}, component main) in the host's apt sources "
                      f"({base / 'sources.list'}, {base / 'sources.list.d'}/*.list, *.sources): set "
                      f"{MIRROR_ENV} to the Debian mirror to build the chroot from")


def _usable(uri: str, suite: str, components: list[str], host: str) -> bool:
    return suite == host and "main" in components and not uri.rstrip("/").endswith("-security")


def _deb822_mirror(text: str, host: str) -> str | None:
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        for line in stanza.splitlines():
            if line.startswith(("#", " ", "\t")) or ":" not in line:
                continue  # comments and continuation lines (e.g. an inline Signed-By key)
            k, _, v = line.partition(":")
            fields[k.strip().lower()] = v.strip()
        if fields.get("enabled", "yes").lower() == "no" or "deb" not in fields.get("types", "").split():
            continue
        components = fields.get("components", "").split()
        for uri in fields.get("uris", "").split():
            if any(_usable(uri, suite, components, host) for suite in fields.get("suites", "").split()):
                return uri.rstrip("/")
    return None


def _one_line_mirror(text: str, host: str) -> str | None:
    for line in text.splitlines():
        parts = line.split("#", 1)[0].split()
        if len(parts) >= 3 and parts[0] == "deb":
            rest = [p for p in parts[1:] if not p.startswith("[") and not p.endswith("]") and "=" not in p]
            if len(rest) >= 3 and _usable(rest[0], rest[1], rest[2:], host):
                return rest[0].rstrip("/")
    return None


def mounts_under(path: Path) -> list[str]:
    """Mount points at or below ``path`` (from /proc/self/mountinfo), deepest first."""
    prefix = str(Path(path).absolute()).rstrip("/")
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].replace("\\040", " ")
            if mp == prefix or mp.startswith(prefix + "/"):
                found.append(mp)
    return sorted(found, key=len, reverse=True)


def _safe_rmtree(path: Path) -> None:
    if not path.exists():
        return
    busy = mounts_under(path)
    if busy:
        raise ChrootError(f"refusing to delete {path}: mounts below it: {', '.join(busy)}")
    shutil.rmtree(path)


def _du_mb(path: Path) -> int:
    r = subprocess.run(["du", "-sxm", str(path)], capture_output=True, text=True, timeout=120, check=False)
    try:
        return int(r.stdout.split()[0])
    except (IndexError, ValueError):
        return -1


@contextlib.contextmanager
def _locked(lock_path: Path):
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class ChrootRoot:
    """One Debian release's root under the cache dir: build, check, mount and unmount it."""

    def __init__(self, release: str, cache: str | os.PathLike | None = None):
        if release not in KNOWN_RELEASES:
            raise ChrootError(f"unknown Debian release {release!r}; known: {', '.join(KNOWN_RELEASES)}")
        self.release = release
        self.cache = Path(cache) if cache is not None else cache_dir()
        self.path = (self.cache / release).absolute()

    @property
    def stamp_path(self) -> Path:
        return self.cache / f"{self.release}.stamp"

    @property
    def lock_path(self) -> Path:
        return self.cache / f"{self.release}.lock"

    @property
    def holders_path(self) -> Path:
        return self.cache / f"{self.release}.holders.json"

    # ----- build --------------------------------------------------------------------------------
    def stamp(self) -> dict | None:
        """The build record of a complete root, or None if the root is missing or incomplete."""
        try:
            info = json.loads(self.stamp_path.read_text())
        except (OSError, ValueError):
            return None
        if not (self.path / "usr/sbin/slurmctld").exists():
            return None
        return info

    def is_complete(self) -> bool:
        return self.stamp() is not None

    def ensure(self, log=print) -> dict:
        """Build the root unless a complete one is cached; returns its stamp. Safe to call concurrently."""
        info = self.stamp()
        if info is not None:
            return info
        if os.geteuid() != 0:
            raise ChrootError("building a chroot needs root (debootstrap)")
        if not shutil.which("debootstrap"):
            raise ChrootError("debootstrap is not installed (apt-get install debootstrap)")
        with _locked(self.lock_path):
            info = self.stamp()  # someone else may have built it while we waited
            if info is not None:
                return info
            return self._build(log)

    def _build(self, log) -> dict:
        mirror = apt_mirror()
        partial = self.cache / f"{self.release}.partial"
        _safe_rmtree(partial)
        if self.path.exists():  # an incomplete root (no stamp): rebuild it
            _safe_rmtree(self.path)
        self.stamp_path.unlink(missing_ok=True)
        argv = ["debootstrap", "--variant=minbase", f"--include={','.join(PACKAGES)}", self.release,
                str(partial), mirror]
        log(f"chroot: building {self.release} into {self.path} from {mirror} (debootstrap, about a minute)")
        t0 = time.monotonic()
        r = subprocess.run(argv, capture_output=True, text=True, timeout=1800, check=False)
        seconds = time.monotonic() - t0
        if r.returncode != 0:
            tail = "\n".join((r.stdout + r.stderr).splitlines()[-20:])
            leftover = mounts_under(partial)
            for mp in leftover:  # debootstrap may leave /proc or /sys mounted when it fails
                subprocess.run(["umount", "-l", mp], capture_output=True, timeout=60, check=False)
            raise ChrootError(f"debootstrap failed (exit {r.returncode}): {' '.join(argv)}\n{tail}")
        for mp in mounts_under(partial):
            subprocess.run(["umount", "-l", mp], capture_output=True, timeout=60, check=False)
        # The downloaded .debs and apt's package lists (about 55 MB) are not needed at run time.
        for junk in [*(partial / "var/cache/apt/archives").glob("*.deb"), *(partial / "var/cache/apt").glob("*.bin"),
                     *(partial / "var/lib/apt/lists").glob("*_*")]:
            junk.unlink()
        version = subprocess.run(["chroot", str(partial), "/usr/sbin/slurmctld", "-V"], capture_output=True,
                                 text=True, timeout=60, check=False).stdout.strip()
        if not version.startswith("slurm"):
            raise ChrootError(f"the new {self.release} root has no working slurmctld: {version!r}")
        os.replace(partial, self.path)
        info = {
            "release": self.release,
            "slurm": version,
            "mirror": mirror,
            "packages": list(PACKAGES),
            "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "build_seconds": round(seconds, 1),
            "size_mb": _du_mb(self.path),
        }
        tmp = self.stamp_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(info, indent=2) + "\n")
        os.replace(tmp, self.stamp_path)
        log(f"chroot: {self.release} ready: {version}, {info['build_seconds']} s, {info['size_mb']} MB")
        return info

    # ----- paths ------------------------------------------------------------------------------------
    def inside(self, host_path: str | os.PathLike) -> str:
        """The path a process in the root sees for ``host_path`` (which must lie within the root)."""
        p = Path(host_path).absolute()
        try:
            rel = p.relative_to(self.path)
        except ValueError as e:
            raise ChrootError(f"{p} is not inside the chroot {self.path}") from e
        return "/" + str(rel) if str(rel) != "." else "/"

    def outside(self, inner_path: str) -> Path:
        return self.path / inner_path.lstrip("/")

    def prefix(self) -> list[str]:
        """argv prefix that runs a program inside the root."""
        return ["chroot", str(self.path)]

    # ----- mounts -------------------------------------------------------------------------------
    @staticmethod
    def wanted_mounts() -> list[str]:
        """The bind mounts a running cluster needs."""
        return list(BIND_MOUNTS)

    def mounted(self) -> list[str]:
        """Which of the bind mounts (proc, dev, sys) are mounted in the root now."""
        points = set(mounts_under(self.path))
        return [name for name in BIND_MOUNTS if str(self.path / name) in points]

    def _holders(self) -> list[str]:
        try:
            return list(json.loads(self.holders_path.read_text()))
        except (OSError, ValueError):
            return []

    def _write_holders(self, holders: list[str]) -> None:
        tmp = self.holders_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(sorted(set(holders))) + "\n")
        os.replace(tmp, self.holders_path)

    def acquire(self, holder: str) -> None:
        """Record ``holder`` (a cluster state dir) as a user of the mounts; mount what is missing."""
        with _locked(self.lock_path):
            self._write_holders([*self._holders(), holder])
            have = set(self.mounted())
            for name in self.wanted_mounts():
                if name in have:
                    continue
                target = self.path / name
                target.mkdir(parents=True, exist_ok=True)
                how = "--rbind" if name in RECURSIVE else "--bind"
                for argv in (["mount", how, f"/{name}", str(target)],
                             ["mount", "--make-rslave" if name in RECURSIVE else "--make-slave", str(target)]):
                    r = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
                    if r.returncode != 0:
                        raise ChrootError(f"{' '.join(argv)} failed: {r.stderr.strip()}")
            # minbase has no /etc/hosts, and 'localhost' must resolve.
            shutil.copyfile("/etc/hosts", self.path / "etc/hosts")

    def release_holder(self, holder: str, still_in_use=lambda h: False) -> list[str]:
        """Drop ``holder``; when no holder for which ``still_in_use`` is true remains, unmount.

        Returns the mount points it unmounted (lazily when one was busy).
        """
        with _locked(self.lock_path):
            holders = [h for h in self._holders() if h != holder and still_in_use(h)]
            self._write_holders(holders)
            if holders:
                return []
            done = []
            for name in reversed(BIND_MOUNTS):
                target = str(self.path / name)
                if target not in mounts_under(self.path):
                    continue
                r = subprocess.run(["umount", "-R", target], capture_output=True, text=True, timeout=60,
                                   check=False)
                if r.returncode != 0:  # e.g. "target is busy" for /dev: detach it (and what is below) lazily
                    r = subprocess.run(["umount", "-l", target], capture_output=True, text=True, timeout=60,
                                       check=False)
                    if r.returncode != 0:
                        raise ChrootError(f"umount {target} failed: {r.stderr.strip()}")
                done.append(target)
            return done
