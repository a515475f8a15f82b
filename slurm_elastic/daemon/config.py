"""The daemon's configuration: a TOML file (default /etc/slurm/elastic.toml), every key optional.

Unknown keys and values of the wrong type are errors that name the key, so a typo never silently
falls back to a default. The operator's file is validated like user input (issue 24): the stop signal
comes from a fixed list, every number is finite and within the range :data:`RANGES` gives (the same table
is in ``docs/SYSADMIN.md``), and an error names the key; at SIGHUP the old configuration is then kept.
``docs/SYSADMIN.md`` documents every key; :data:`DEFAULTS` is the truth.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

DEFAULT_PATH = Path("/etc/slurm/elastic.toml")


class ConfigError(ValueError):
    """A bad configuration file; the message names the file and the key."""


@dataclass(frozen=True)
class DaemonConfig:
    partitions: tuple[str, ...] = ()  # managed partitions; empty = every partition
    poll_interval_s: float = 30.0  # time between two cycles
    policy: str = "dp"  # dp | fixed-batch | static
    max_gpus_per_user: int = 0  # 0 = no cap; caps every user's elastic jobs together
    max_gpus_per_job: int = 0  # 0 = no cap; caps each elastic job whatever its spec asks
    cooldown_s: float = 300.0  # minimum time between two rescales of one job
    max_in_flight: int = 4  # most resizes under way at once
    ack_timeout_s: float = 300.0  # wait this long for a job's checkpoint ack, then leave it running
    restart_cost_s: float = 45.0  # restart cost until measured for the job (spec restart_s, else this)
    restart_claim_max_s: float = 600.0  # the most a job's claimed or measured restart cost counts for (claims.py)
    horizon_s: float = 3600.0  # restart costs are weighed against gains over this horizon
    allow_preemption: bool = False  # may the daemon stop a running elastic job to admit others?
    signal: str = "USR2"  # the checkpoint-and-stop signal sent to a job's steps
    state_dir: str = "/var/lib/slurm-elastic"  # SQLite state (decision log, intents), lock file
    log_level: str = "info"  # debug | info | warning | error
    metrics_address: str = "127.0.0.1"  # Prometheus text metrics; "" disables the endpoint
    metrics_port: int = 9788
    slurm_bin: str = "/usr/bin"  # where squeue/scontrol/sinfo/scancel live
    slurm_timeout_s: float = 30.0  # per Slurm command
    max_weight: float = 10.0  # site maximum of a spec's weight; a job asking more is refused (bad spec)
    watchdog_s: float = 600.0  # a cycle (or a stop) stuck this long ends the process (systemd restarts it); 0 = off
    lease_ttl_s: float = 90.0  # one daemon per cluster (daemon/lease.py); at least 3 polls; 0 = no lease
    backend: str = "auto"  # auto (pyslurm if it imports and matches Slurm's version, else cli) | cli | pyslurm
    # GPU type -> per-GPU speed relative to the others, as the site measured it (issue 23): replaces the
    # built-in prior (profiles/types.py TYPE_SPEED) for these types, until jobs' own reports say more
    gpu_speed: dict = field(default_factory=dict)
    # user name, "account:NAME" (a Slurm account) or "*" (everyone) -> the most a spec's weight counts for
    # (daemon/caps.py; the user's own grant first). Unlisted: 1, so a user may only lower a job's standing
    weight_grants: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        d["partitions"] = list(self.partitions)
        return d


DEFAULTS = DaemonConfig()

# Every numeric key's allowed range, inclusive (None: the bound is exclusive 0). The same table is in
# docs/SYSADMIN.md ("Configure"); a unit test checks every key against it.
DAY = 86400.0
RANGES: dict[str, tuple[float | None, float]] = {
    "poll_interval_s": (1.0, 3600.0),  # a cycle at least every hour; below 1 s the daemon would spin
    "max_gpus_per_user": (0, 1 << 20),  # 0 = no cap; spec.MAX_GPUS_LIMIT
    "max_gpus_per_job": (0, 1 << 20),  # 0 = no cap
    "cooldown_s": (0.0, 30 * DAY),
    "max_in_flight": (1, 1024),
    "ack_timeout_s": (1.0, DAY),
    "restart_cost_s": (0.0, DAY),
    "restart_claim_max_s": (1.0, DAY),
    "horizon_s": (1.0, 365 * DAY),
    "metrics_port": (1, 65535),
    "slurm_timeout_s": (1.0, 3600.0),
    "max_weight": (None, 1e6),  # > 0; spec weights are at most 1e6
    "watchdog_s": (0.0, 7 * DAY),  # 0 = off
    "lease_ttl_s": (0.0, DAY),  # 0 = no lease
}
# The checkpoint-and-stop signal: one the in-job library and the batch script catch to checkpoint
# (train/signals.py installs USR2 by default, USR1 on request). Never KILL/TERM/INT/STOP/HUP/...: those
# end or freeze the job without a checkpoint, and a resize would then lose its work.
SIGNALS = ("USR2", "USR1")
_POLICIES = ("dp", "fixed-batch", "static")
_TYPE_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_USER_RE = re.compile(r"^[A-Za-z0-9_.\-@$]{1,64}$")  # what useradd and Slurm accept as a user or account name
_LEVELS = ("debug", "info", "warning", "error")
_BACKENDS = ("auto", "cli", "pyslurm")


def load_config(path: str | Path | None = None, *, must_exist: bool = False, overrides: dict | None = None) -> DaemonConfig:
    """Read the TOML file (keys at top level or under ``[daemon]``); a missing default file means defaults."""
    p = Path(path) if path else DEFAULT_PATH
    data: dict = {}
    if p.exists():
        try:
            data = tomllib.loads(p.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"{p}: {e}") from e
        if "daemon" in data and isinstance(data["daemon"], dict):
            data = {**{k: v for k, v in data.items() if k != "daemon"}, **data["daemon"]}
    elif must_exist or path:
        raise ConfigError(f"{p}: no such file")
    data.update(overrides or {})
    return config_from_dict(data, source=str(p))


def config_from_dict(data: dict, source: str = "config") -> DaemonConfig:
    known = {f.name: f for f in fields(DaemonConfig) if f.name != "extra"}
    values = {}
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"{source}: unknown key {key!r} (known: {', '.join(known)})")
        default = getattr(DEFAULTS, key)
        if isinstance(default, tuple):
            if isinstance(value, str):
                value = [value]
            if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
                raise ConfigError(f"{source}: {key} must be a list of partition names")
            value = tuple(value)
        elif isinstance(default, bool):
            if not isinstance(value, bool):
                raise ConfigError(f"{source}: {key} must be true or false, got {value!r}")
        elif isinstance(default, float):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0:
                raise ConfigError(f"{source}: {key} must be a finite non-negative number, got {value!r}")
            value = float(value)
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{source}: {key} must be a non-negative integer, got {value!r}")
        elif isinstance(default, str):
            if not isinstance(value, str):
                raise ConfigError(f"{source}: {key} must be a string, got {value!r}")
        elif key == "weight_grants":  # user name, "account:NAME" or "*" -> a finite weight in (0, 1e6]
            if not isinstance(value, dict) or len(value) > 100_000 or not all(
                    isinstance(u, str) and (u == "*" or _USER_RE.fullmatch(u.removeprefix("account:")))
                    and not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) and 0 < x <= 1e6
                    for u, x in value.items()):
                raise ConfigError(f"{source}: {key} must map user names, \"account:NAME\" or \"*\" to weights in "
                                  f"(0, 1e6], got {value!r}"[:500])
            value = {u: float(x) for u, x in value.items()}
        elif isinstance(default, dict):  # gpu_speed: type name -> a finite speed in (0, 1000]
            if not isinstance(value, dict) or len(value) > 64 or not all(
                    isinstance(t, str) and _TYPE_RE.fullmatch(t) and not isinstance(x, bool) and isinstance(x, (int, float))
                    and math.isfinite(x) and 0 < x <= 1000 for t, x in value.items()):
                raise ConfigError(f"{source}: {key} must map GPU type names to speeds in (0, 1000], got {value!r}")
            value = {t.lower(): float(x) for t, x in value.items()}
        if key in RANGES:
            lo, hi = RANGES[key]
            if not (value > 0 if lo is None else value >= lo) or value > hi:
                raise ConfigError(f"{source}: {key} must be in {_span(key)}, got {value!r}")
        values[key] = value
    cfg = DaemonConfig(**values)
    if cfg.signal not in SIGNALS:
        raise ConfigError(f"{source}: signal must be one of {', '.join(SIGNALS)} (a signal the job catches to "
                          f"checkpoint; KILL, TERM, INT, STOP and the like end or freeze it without one), "
                          f"got {cfg.signal!r}")
    if cfg.policy not in _POLICIES:
        raise ConfigError(f"{source}: policy must be one of {', '.join(_POLICIES)}, got {cfg.policy!r}")
    if cfg.backend not in _BACKENDS:
        raise ConfigError(f"{source}: backend must be one of {', '.join(_BACKENDS)}, got {cfg.backend!r}")
    if cfg.log_level.lower() not in _LEVELS:
        raise ConfigError(f"{source}: log_level must be one of {', '.join(_LEVELS)}, got {cfg.log_level!r}")
    return cfg


def _span(key: str) -> str:
    lo, hi = RANGES[key]
    return f"(0, {hi:g}]" if lo is None else f"[{lo:g}, {hi:g}]"


def check_managed_partitions(cfg: DaemonConfig, nodes) -> None:
    """Refuse a configuration that manages nothing: a managed partition Slurm does not have (or whose
    nodes have no GPUs) would silently give 0 managed GPUs. ``nodes``: the NodeRecords Slurm lists."""
    gpus: dict[str, int] = {}
    for n in nodes:
        for p in n.partitions:
            gpus[p] = gpus.get(p, 0) + n.gpus_total
    unknown = [p for p in cfg.partitions if p not in gpus]
    if unknown:
        raise ConfigError(f"partitions: {', '.join(map(repr, unknown))} not found in Slurm "
                          f"(it has: {', '.join(sorted(gpus)) or 'none'}); the daemon would manage nothing there")
    if cfg.partitions and not any(gpus[p] for p in cfg.partitions):
        raise ConfigError(f"partitions: {', '.join(cfg.partitions)} have no GPUs; the daemon would manage nothing")
    if not cfg.partitions and nodes and not any(gpus.values()):
        raise ConfigError("no partition of this cluster has GPUs; the daemon would manage nothing")
