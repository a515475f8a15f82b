"""Test helpers for clusters whose Slurm runs in a chroot (``ClusterConfig.release``): paths and users.

The daemon runs on the host as root and reads each job's files at the path Slurm reports; a chroot
cluster reports paths inside its root. ``same_path_on_host`` bind-mounts the directory there, as on a
real site where the daemon and Slurm see one file system. ``chroot_users`` makes host users (made by
``useradd`` for a test) known inside the chroot, so that its slurmctld and ``runuser`` resolve them.
"""

from __future__ import annotations

import contextlib
import grp
import os
import pwd
import subprocess
from pathlib import Path


@contextlib.contextmanager
def same_path_on_host(c, path: Path):
    """For a chroot cluster: ``path`` (inside the root) bind-mounted on the host at the path Slurm reports
    for it. Undone afterwards; only the directories made here are removed. A no-op for the host's Slurm."""
    if c.chroot is None:
        yield
        return
    target = Path(c.inside(path))
    made = [p for p in (*reversed(target.parents), target) if not p.exists()]
    for p in made:
        p.mkdir()
    mounted = False
    try:
        for argv in (["mount", "--bind", str(path), str(target)], ["mount", "--make-private", str(target)]):
            subprocess.run(argv, check=True, capture_output=True, text=True, timeout=30)
            mounted = True
        yield
    finally:
        if mounted:
            subprocess.run(["umount", str(target)], capture_output=True, timeout=60, check=False)
        for p in reversed(made):
            with contextlib.suppress(OSError):
                os.rmdir(p)


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


@contextlib.contextmanager
def chroot_users(c, names):
    """Host users ``names`` (and their primary groups) appended to the chroot's /etc/passwd and /etc/group
    for the duration; only the lines added here are removed. A no-op for the host's Slurm."""
    if c.chroot is None:
        yield
        return
    etc = c.chroot.path / "etc"
    added: dict[str, list[str]] = {"passwd": [], "group": []}
    have = {f: {ln.split(":", 1)[0] for ln in _lines(etc / f)} for f in added}
    for name in names:
        pw = pwd.getpwnam(name)
        gr = grp.getgrgid(pw.pw_gid)
        for f, line in (("passwd", f"{pw.pw_name}:x:{pw.pw_uid}:{pw.pw_gid}::{pw.pw_dir}:{pw.pw_shell}"),
                        ("group", f"{gr.gr_name}:x:{gr.gr_gid}:")):
            key = line.split(":", 1)[0]
            if key not in have[f]:
                added[f].append(line)
                have[f].add(key)
    for f, lines in added.items():
        if lines:
            with open(etc / f, "a") as fh:
                fh.write("".join(ln + "\n" for ln in lines))
    try:
        yield
    finally:
        for f, lines in added.items():
            if lines:
                drop = set(lines)
                kept = [ln for ln in _lines(etc / f) if ln not in drop]
                (etc / f).write_text("".join(ln + "\n" for ln in kept))
