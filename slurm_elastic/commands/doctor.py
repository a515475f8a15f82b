"""``slurm-elastic doctor``: check this site's Slurm and environment for what the daemon needs.

Gathers the facts (Slurm's running configuration, partitions and nodes, the job_submit.lua next to
slurm.conf, the state directory, munge, the backend the daemon would choose) and prints the verdicts of
:mod:`slurm_elastic.doctor`, one line per check (OK / WARN / FAIL) with the change to make. Exit 1 when
any check FAILs. Run it as the daemon will run (root on the controller); as another user it still reads
everything Slurm shows any user.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import click

from slurm_elastic import doctor as rules
from slurm_elastic.backends.base import SlurmError
from slurm_elastic.daemon.config import DEFAULT_PATH, DEFAULTS, ConfigError, load_config

MAX_PLUGIN_BYTES = 1 << 20
DEFAULT_MUNGE_SOCKET = "/run/munge/munge.socket.2"
SHARED_PLUGIN = Path("/usr/share/slurm-elastic/job_submit_elastic.lua")  # where install-site.sh puts it


def _read_bounded(path: Path) -> str | None:
    """The file's text (at most 1 MB, not through a symlink), None when it does not exist."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"-- unreadable: {e.strerror}"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "-- not a regular file"
        return os.read(fd, MAX_PLUGIN_BYTES).decode("utf-8", "replace")
    finally:
        os.close(fd)


def _state_dir_facts(path: str) -> dict:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return {"exists": False}
    except OSError as e:
        return {"exists": True, "is_dir": False, "error": str(e)}
    return {"exists": True, "is_symlink": stat.S_ISLNK(st.st_mode), "is_dir": stat.S_ISDIR(st.st_mode),
            "uid": st.st_uid, "mode": stat.S_IMODE(st.st_mode)}


def munge_socket(config: dict[str, str]) -> str:
    """The munge socket Slurm uses: AuthInfo's ``socket=`` or munge's default."""
    for part in (config.get("AuthInfo") or "").split(","):
        key, _, value = part.partition("=")
        if key.strip() == "socket" and value.strip():
            return value.strip()
    return DEFAULT_MUNGE_SOCKET


def probe_munge(socket: str, timeout: float = 20.0) -> tuple[bool, str]:
    """(works, what happened): a credential made by ``munge -n`` and decoded by ``unmunge``."""
    try:
        cred = subprocess.run(["munge", "-n", "-S", socket], capture_output=True, text=True, timeout=timeout,
                              check=False)
        if cred.returncode != 0:
            return False, f"munge -n -S {socket} failed: {(cred.stderr.strip() or f'exit {cred.returncode}')[:200]}"
        back = subprocess.run(["unmunge", "-S", socket], input=cred.stdout, capture_output=True, text=True,
                              timeout=timeout, check=False)
    except FileNotFoundError:
        return False, "munge/unmunge are not installed (apt-get install munge)"
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"munge at {socket}: {e}"
    if back.returncode != 0:
        return False, f"unmunge -S {socket} refused the credential: {(back.stderr.strip() or '?')[:200]}"
    return True, f"munge -n | unmunge works ({socket})"


def gather(config_path: str | None) -> rules.SiteFacts:
    from slurm_elastic.backends.choose import choose_backend
    from slurm_elastic.backends.cli import CliBackend
    from slurm_elastic.sitefiles import site_file

    f = rules.SiteFacts(euid=os.geteuid())
    path = Path(config_path) if config_path else DEFAULT_PATH
    f.config_path = str(path) if path.exists() else ""
    try:
        cfg = load_config(config_path)
    except ConfigError as e:
        f.daemon_config_error = str(e)
        cfg = DEFAULTS  # the other checks still run, against the defaults
    f.daemon_config = cfg
    f.missing_tools = [t for t in rules.SLURM_TOOLS if not os.access(Path(cfg.slurm_bin) / t, os.X_OK)]
    cli = CliBackend(bin_dir=cfg.slurm_bin, timeout=cfg.slurm_timeout_s)
    try:
        f.slurm_config = cli.slurm_config()
    except SlurmError as e:
        f.slurm_error = str(e)
    for shipped in (SHARED_PLUGIN, None):  # install-site.sh's copy, else the package's own
        try:
            path = shipped or site_file("plugin")
            f.shipped_plugin_text, f.shipped_plugin_path = path.read_text(), str(path)
            break
        except OSError:
            continue
    if f.slurm_config is not None:
        conf = f.slurm_config.get("SLURM_CONF") or os.environ.get("SLURM_CONF", "/etc/slurm/slurm.conf")
        f.plugin_path = str(Path(conf).parent / "job_submit.lua")
        f.plugin_text = _read_bounded(Path(f.plugin_path))
        try:
            r = subprocess.run([str(Path(cfg.slurm_bin) / "scontrol"), "-o", "show", "partition"], capture_output=True,
                               text=True, timeout=cfg.slurm_timeout_s, check=False)
            f.partitions_text = r.stdout if r.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired):
            f.partitions_text = None
        try:
            f.nodes = cli.list_nodes()
        except SlurmError:
            f.nodes = None
        f.munge = probe_munge(munge_socket(f.slurm_config))
    else:
        f.munge = probe_munge(DEFAULT_MUNGE_SOCKET)
    f.state_dir = _state_dir_facts(cfg.state_dir)
    try:
        # the same choice as the daemon's (the import probed in a child), without loading pyslurm here
        backend, why = choose_backend(cfg.backend, cli, factory=lambda c: "pyslurm")
        f.backend = ("cli" if backend is cli else "pyslurm", why)
    except SlurmError as e:
        f.backend = ("", str(e))
    return f


@click.command()
@click.option("--config", "config_path", default=None,
              help=f"the daemon's configuration (default {DEFAULT_PATH}; missing: every default)")
def doctor(config_path):
    """Check slurm.conf and this machine for what the daemon needs; one line per check with the fix.

    Exit status 1 when a check FAILs (the daemon would refuse to start or could not resize jobs).
    """
    checks = rules.diagnose(gather(config_path))
    for c in checks:
        click.echo(c.line())
    fails = sum(c.level == rules.FAIL for c in checks)
    warns = sum(c.level == rules.WARN for c in checks)
    click.echo(f"{len(checks)} checks: {fails} FAIL, {warns} WARN")
    sys.exit(rules.exit_code(checks))
