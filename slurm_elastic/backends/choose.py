"""Which backend the daemon talks to Slurm through: config ``backend = "auto" | "cli" | "pyslurm"``.

``auto`` takes pyslurm when it imports and was built for the running Slurm's major version (pyslurm
refuses other majors, and one built for another libslurm would misread its structs), else the CLI;
it logs which it took and why. The import is probed in a child process first: libslurm exits the
process that initialises it with a bad ``SLURM_CONF``, which must not be the daemon. A ``SLURM_CONF``
that names no file is refused at once, by ``auto`` too: libslurm retries reading it for 60 s before it
exits, and the Slurm commands the CLI backend runs read the same file.
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable, Mapping

from slurm_elastic.backends.base import SlurmBackend, SlurmError
from slurm_elastic.backends.cli import CliBackend

BACKENDS = ("auto", "cli", "pyslurm")
log = logging.getLogger("slurm_elastic.daemon")

_PROBE = "import pyslurm, sys; sys.stdout.write(pyslurm.__version__)"


def missing_slurm_conf(env: Mapping[str, str]) -> str:
    """Why libslurm cannot read its configuration at once, or ''. Only a set ``SLURM_CONF`` is checked:
    unset, libslurm reads its compiled-in path or, when that is missing, asks DNS (configless) and fails
    fast by itself; a set one that names no file is retried for 60 s (s_p_parse_file) before it exits."""
    path = env.get("SLURM_CONF")
    if path is None:
        return ""
    if not path:
        return "SLURM_CONF is set but empty: set it to the cluster's slurm.conf or unset it"
    if not os.path.isfile(path):
        what = "is not a file" if os.path.exists(path) else "does not exist"
        return (f"SLURM_CONF={path} {what} (libslurm would retry reading it for 60 s): set SLURM_CONF to "
                f"the cluster's slurm.conf or unset it")
    return ""


def probe_pyslurm(timeout: float = 60.0, python: str = sys.executable,
                  env: Mapping[str, str] | None = None) -> tuple[str | None, str]:
    """(pyslurm's version, '') when ``import pyslurm`` works in a child process, else (None, why)."""
    env = dict(os.environ if env is None else env)
    missing = missing_slurm_conf(env)
    if missing:
        return None, missing
    try:
        r = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout,
                           env=env, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"probing 'import pyslurm' failed: {e}"
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1]
        return None, f"'import pyslurm' fails: {tail[:300]}"
    return r.stdout.strip(), ""


def major(version: str) -> tuple[int, int] | None:
    """(22, 5) from '22.5.3' (pyslurm) or '22.05.8' (Slurm): the pair both number their releases by."""
    m = re.match(r"^\s*(\d+)\.(\d+)", version or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def choose_backend(kind: str, cli: CliBackend, *, probe: Callable[[], tuple[str | None, str]] | None = None,
                   factory: Callable[[CliBackend], SlurmBackend] | None = None) -> tuple[SlurmBackend, str]:
    """(backend, reason). ``pyslurm`` that cannot be used is an error; ``auto`` then takes the CLI."""
    if kind not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {kind!r}")
    if kind == "cli":
        return cli, "backend = \"cli\" in the configuration"
    env = getattr(cli, "env", None)
    missing = missing_slurm_conf(env) if env is not None and not getattr(cli, "prefix", None) else ""
    if missing:  # the Slurm commands read the same file: the CLI would wait on every call as long
        raise SlurmError(f"backend = \"{kind}\" cannot be used: {missing}")
    if probe is None:
        def probe():
            return probe_pyslurm(env=env)
    version, why = probe()
    if version is not None:
        try:
            slurm = cli.version()
        except SlurmError as e:
            slurm, why = "", f"cannot read the running Slurm's version: {e}"
        if slurm:
            if major(version) == major(slurm):
                if factory is None:
                    from slurm_elastic.backends.pyslurm_backend import PyslurmBackend

                    def factory(c):
                        return PyslurmBackend(cli=c, retries=c.retries, retry_delay=c.retry_delay)
                return factory(cli), f"pyslurm {version} imports and matches Slurm {slurm}"
            why = f"pyslurm {version} was built for another Slurm than the running {slurm}"
    if kind == "pyslurm":
        raise SlurmError(f"backend = \"pyslurm\" cannot be used: {why} (see docs/SYSADMIN.md)")
    return cli, f"backend = \"auto\": using the CLI because {why}"


def make_backend(config) -> SlurmBackend:
    """The daemon's backend for a :class:`DaemonConfig`; logs the choice and its reason."""
    cli = CliBackend(bin_dir=config.slurm_bin, timeout=config.slurm_timeout_s)
    backend, reason = choose_backend(getattr(config, "backend", "auto"), cli)
    name = "pyslurm" if backend is not cli else "cli"
    log.info("backend: %s (%s)", name, reason, extra={"kv": {"backend": name, "reason": reason}})
    return backend
