"""A real Slurm on one machine: slurmctld plus one ``slurmd -N nodeN`` per emulated GPU node.

Everything lives in one state directory (config, munge key and socket, spool, logs, fake GPU device
files, pids). The machine's /etc/slurm is never touched: tools find this cluster through
``SLURM_CONF``. ``up`` is idempotent; ``down`` stops only the processes this module started (by the
pids it recorded, after checking that each pid still runs the program it started) and removes nothing.

Fake GPUs: Slurm drops GPUs without a device file, so each node gets character devices made with
``mknod`` (major 1, minor 3: the same device as /dev/null), listed as ``File=`` in gres.conf.

Slurm versions: ``ClusterConfig.release=None`` runs the host's Slurm; ``release="trixie"`` (or
``"bookworm"``) runs that Debian release's Slurm in a debootstrap chroot (:mod:`slurm_elastic.chroot`).
Then every daemon and tool runs as ``chroot ROOT /usr/sbin/...``, the runtime files (config, munge,
spool, logs, fake GPUs, job dirs) live inside the root under ``/srv/slurm-elastic/<name>`` (the state
dir itself when it already lies inside the root), and slurm.conf names them by their inside paths;
``cluster.json`` stays in the state dir. ``tool()``, ``run_tool()``, ``job_dir()`` and ``inside()``
hide the difference from tests and the demo.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from slurm_elastic.backends.cli import CliBackend
from slurm_elastic.chroot import ChrootError, ChrootRoot, host_release

DEFAULT_STATE_DIR = Path(os.environ.get("XDG_STATE_HOME", str(Path.home() / ".local" / "state"))) / "slurm-elastic" / "cluster"
STATE_FILE = "cluster.json"


class ClusterError(RuntimeError):
    """The local cluster could not be started, stopped or read; the message says which part and why."""


@dataclass
class ClusterConfig:
    """Shape of the emulated cluster. Ports are fixed per state dir so restarts find the same cluster."""

    nodes: int = 4
    gpus_per_node: int = 4
    cpus_per_node: int = 8
    memory_mb: int = 8000
    ctld_port: int = 16817
    partition: str = "gpu"
    cluster_name: str = "elastic"
    cred_expire: int = 10  # seconds a requeued job waits before it may start again (Slurm default 120)
    job_submit_lua: str | None = None  # path of a job_submit.lua to load (JobSubmitPlugins=lua)
    extra_conf: list[str] = field(default_factory=list)  # extra slurm.conf lines, e.g. for tests
    sbin: str = "/usr/sbin"  # where slurmctld, slurmd and munged live
    bin: str = "/usr/bin"  # where squeue, scontrol, sbatch live (inside the chroot when release is set)
    release: str | None = None  # None: the host's Slurm; a Debian codename: that release's Slurm in a chroot
    chroot_cache: str | None = None  # where chroots are built (default: slurm_elastic.chroot.cache_dir())
    # Pools (issue 13): one partition per entry, its nodes with typed GPUs, e.g. TWO_POOLS. Empty: the
    # classic one-partition cluster of ``nodes`` x ``gpus_per_node`` untyped GPUs.
    pools: list[dict] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.pools:
            self.pools = [check_pool(p) for p in self.pools]
            self.nodes = sum(p["nodes"] for p in self.pools)

    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.nodes + 1)]

    def layout(self) -> list[tuple[str, str, str, int]]:
        """(node name, partition, GPU type, GPUs) of every node; type "" for the classic cluster."""
        if not self.pools:
            return [(n, self.partition, "", self.gpus_per_node) for n in self.node_names()]
        out, names = [], iter(self.node_names())
        for p in self.pools:
            out += [(next(names), p["partition"], p["gpu_type"], p["gpus_per_node"]) for _ in range(p["nodes"])]
        return out

    def slurmd_port(self, index: int) -> int:
        return self.ctld_port + 1 + index


# Two partitions with two fake GPU types and two node sizes (issue 13's live scenario). ``max_time``
# (minutes) and ``max_nodes`` become the partition's MaxTime/MaxNodes (omitted: unlimited).
TWO_POOLS = [
    {"partition": "a100", "gpu_type": "a100", "nodes": 2, "gpus_per_node": 4},
    {"partition": "v100", "gpu_type": "v100", "nodes": 2, "gpus_per_node": 8, "max_time": 120, "max_nodes": 2},
]
_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,31}$")


def check_pool(pool: dict) -> dict:
    """One pool entry checked (names Slurm accepts, positive sizes); raises ClusterError naming the field."""
    if not isinstance(pool, dict):
        raise ClusterError(f"a pool must be a mapping, got {pool!r}")
    out = dict(pool)
    for key in ("partition", "gpu_type"):
        if not isinstance(out.get(key), str) or not _NAME_RE.match(out[key]):
            raise ClusterError(f"pool {pool!r}: {key} must be a name of letters, digits and '_'")
    for key, hi in (("nodes", 64), ("gpus_per_node", 16), ("max_time", 10**6), ("max_nodes", 64)):
        v = out.get(key)
        if v is None and key in ("max_time", "max_nodes"):
            continue
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
            raise ClusterError(f"pool {pool!r}: {key} must be an integer in 1..{hi}")
    return out


def parse_pools(text: str) -> list[dict]:
    """``a100:2x4,v100:2x8`` -> pools (partition = GPU type = the name; NODESxGPUS per node); ``two``: TWO_POOLS."""
    if text.strip() == "two":
        return [dict(p) for p in TWO_POOLS]
    pools = []
    for item in text.split(","):
        m = re.match(r"^\s*([A-Za-z][A-Za-z0-9_]*):(\d+)x(\d+)\s*$", item)
        if not m:
            raise ClusterError(f"bad pool {item!r}: expected NAME:NODESxGPUS, e.g. a100:2x4")
        pools.append(check_pool({"partition": m.group(1), "gpu_type": m.group(1), "nodes": int(m.group(2)),
                                 "gpus_per_node": int(m.group(3))}))
    if len({p["partition"] for p in pools}) != len(pools):
        raise ClusterError(f"pools {text!r}: each partition may appear once")
    return pools


def _pid_alive(pid: int, program: str | None = None, root: str | None = None) -> bool:
    """True if ``pid`` runs and (when given) its executable is ``program``, so a reused pid is not ours.

    With ``root`` (a chroot), the executable must also lie inside it: seen from the host,
    /proc/PID/exe of a chrooted daemon is the full host path, e.g. ROOT/usr/sbin/slurmctld-wlm.
    """
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split(") ", 1)[1].startswith("Z"):
                return False  # a zombie: dead, just not reaped yet
        if program is not None:
            exe = os.readlink(f"/proc/{pid}/exe")
            # Debian installs the daemons as alternatives (slurmctld -> slurmctld-wlm).
            exe = exe.replace(" (deleted)", "")
            if root is not None and not exe.startswith(root.rstrip("/") + "/"):
                return False
            if root is None and _in_some_chroot(pid):
                return False
            name = os.path.basename(exe)
            return name == program or name.startswith(program + "-")
    except OSError:
        return program is None
    return True


def _in_some_chroot(pid: int) -> bool:
    """True if ``pid`` runs under another root than ours (so a host cluster never claims it)."""
    try:
        return os.readlink(f"/proc/{pid}/root") != os.readlink("/proc/self/root")
    except OSError:
        return False


def port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def find_free_port_block(count: int, start: int = 20000, stop: int = 40000) -> int:
    """First port p in [start, stop) with p..p+count-1 all free on localhost."""
    p = start
    while p + count < stop:
        if all(port_free(p + i) for i in range(count)):
            return p
        p += count
    raise ClusterError(f"no block of {count} free ports in {start}..{stop}")


class LocalCluster:
    """Start, stop and inspect one local Slurm cluster rooted at ``state_dir``."""

    def __init__(self, state_dir: str | os.PathLike = DEFAULT_STATE_DIR, config: ClusterConfig | None = None):
        self.state_dir = Path(state_dir).absolute()
        saved = self._load_state()
        if config is None:
            config = ClusterConfig(**saved["config"]) if saved else ClusterConfig()
        self.config = config
        self._backend: CliBackend | None = None
        self.chroot: ChrootRoot | None = None
        if config.release is not None:
            self.chroot = ChrootRoot(config.release, config.chroot_cache)
            # Recorded in cluster.json, so that a later `down` looks for its processes in the same root
            # even if SLURM_ELASTIC_CHROOT_CACHE has changed meanwhile.
            config.chroot_cache = str(self.chroot.cache.absolute())

    # ----- paths and environment -------------------------------------------------------------
    @property
    def data_dir(self) -> Path:
        """Host path of the runtime files: the state dir, or a directory inside the chroot."""
        if self.chroot is None:
            return self.state_dir
        root = self.chroot.path
        if self.state_dir == root or root in self.state_dir.parents:
            return self.state_dir
        key = hashlib.sha1(str(self.state_dir).encode()).hexdigest()[:10]
        return root / "srv" / "slurm-elastic" / f"{self.state_dir.name}-{key}"

    def inside(self, path: str | os.PathLike) -> str:
        """``path`` as the cluster's daemons and tools see it (unchanged for the host's Slurm)."""
        if self.chroot is None:
            return str(Path(path).absolute())
        return self.chroot.inside(path)

    @property
    def prefix(self) -> list[str]:
        """argv prefix for running a Slurm program of this cluster: [] or ['chroot', ROOT]."""
        return self.chroot.prefix() if self.chroot else []

    def tool(self, name: str, *args: str) -> list[str]:
        """argv of a Slurm client tool (squeue, scancel, sinfo, ...) of this cluster's version."""
        return [*self.prefix, f"{self.config.bin}/{name}", *args]

    def run_tool(self, name: str, *args: str, check: bool = False, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(self.tool(name, *args), env=self.env, capture_output=True, text=True,
                              timeout=timeout, check=check)

    def job_dir(self, name: str | None = None) -> Path:
        """A fresh world-readable directory for job scripts and output that this cluster's jobs can see."""
        base = self.data_dir / "jobs"
        base.mkdir(parents=True, exist_ok=True)
        os.chmod(base, 0o755)
        if name is None:
            import tempfile

            path = Path(tempfile.mkdtemp(prefix="job-", dir=base))
        else:
            path = base / name
            path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, 0o755)
        return path

    @property
    def conf_path(self) -> Path:
        """Host path of slurm.conf (see ``env`` for the path the tools use)."""
        return self.data_dir / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.data_dir / "munge" / "munge.socket"

    @property
    def env(self) -> dict[str, str]:
        """The environment for this cluster's Slurm tools (and jobs); SLURM_CONF is the tools' view."""
        env = dict(os.environ)
        env["SLURM_CONF"] = self.inside(self.conf_path)
        return env

    @property
    def backend(self) -> CliBackend:
        if self._backend is None:
            self._backend = CliBackend(env={"SLURM_CONF": self.inside(self.conf_path)}, bin_dir=self.config.bin,
                                       prefix=self.prefix)
        return self._backend

    @property
    def label(self) -> str:
        """'host' or the chroot's release, for messages and test ids."""
        return self.config.release or "host"

    # ----- state file ------------------------------------------------------------------------
    def _state_path(self) -> Path:
        return self.state_dir / STATE_FILE

    def _load_state(self) -> dict | None:
        try:
            return json.loads((self.state_dir / STATE_FILE).read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            raise ClusterError(f"cannot read {self.state_dir / STATE_FILE}: {e}") from e

    def _save_state(self, pids: dict) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        tmp = self._state_path().with_suffix(".tmp")
        tmp.write_text(json.dumps({"config": asdict(self.config), "pids": pids}, indent=2))
        os.replace(tmp, self._state_path())

    def pids(self) -> dict:
        saved = self._load_state()
        return saved["pids"] if saved else {}

    # ----- config ------------------------------------------------------------------------------
    def slurm_version(self) -> tuple[int, int]:
        out = subprocess.run(
            [*self.prefix, f"{self.config.sbin}/slurmctld", "-V"], capture_output=True, text=True, timeout=30,
            check=False,
        ).stdout
        try:
            major, minor = out.split()[1].split(".")[:2]
            return int(major), int(minor)
        except (IndexError, ValueError) as e:
            raise ClusterError(f"cannot read the Slurm version from 'slurmctld -V': {out!r}") from e

    _slurm_version = slurm_version

    def write_config(self) -> None:
        c, d = self.config, self.data_dir
        for sub in ("etc", "ctld", "spool", "log", "run", "munge", "dev"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(d / "munge", 0o755)
        version = self._slurm_version()
        i = self.inside  # paths as the daemons see them
        lines = [
            "# Written by slurm-elastic cluster up; regenerated on every up.",
            f"ClusterName={c.cluster_name}",
            "SlurmctldHost=localhost",
            f"SlurmctldPort={c.ctld_port}",
            f"SlurmdPort={c.slurmd_port(0)}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={i(self.munge_socket)},cred_expire={c.cred_expire}",
            f"StateSaveLocation={i(d / 'ctld')}",
            f"SlurmdSpoolDir={i(d / 'spool')}/%n",
            f"SlurmctldPidFile={i(d / 'run')}/slurmctld.pid",
            f"SlurmdPidFile={i(d / 'run')}/slurmd-%n.pid",
            f"SlurmctldLogFile={i(d / 'log')}/slurmctld.log",
            f"SlurmdLogFile={i(d / 'log')}/slurmd-%n.log",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "SchedulerType=sched/backfill",
            "SchedulerParameters=sched_min_interval=100000",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "GresTypes=gpu",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "MpiDefault=none",
            "JobRequeue=1",
            "KillWait=5",
            "MinJobAge=300",
            "InactiveLimit=0",
            "SlurmdTimeout=60",
            "MessageTimeout=20",
        ]
        if c.job_submit_lua:
            shutil.copyfile(c.job_submit_lua, d / "etc" / "job_submit.lua")
            lines.append("JobSubmitPlugins=lua")
        layout = c.layout()
        for n, (name, _part, gtype, gpus) in enumerate(layout):
            (d / "spool" / name).mkdir(parents=True, exist_ok=True)
            typed = f"gpu:{gtype}:{gpus} Features={gtype}" if gtype else f"gpu:{gpus}"
            lines.append(
                f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={c.slurmd_port(n)} "
                f"CPUs={c.cpus_per_node} RealMemory={c.memory_mb} Gres={typed} State=UNKNOWN"
            )
        if not c.pools:
            lines.append(f"PartitionName={c.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        for k, p in enumerate(c.pools):
            names = ",".join(name for name, part, _t, _g in layout if part == p["partition"])
            limits = f"MaxTime={p['max_time']}" if p.get("max_time") else "MaxTime=INFINITE"
            limits += f" MaxNodes={p['max_nodes']}" if p.get("max_nodes") else ""
            lines.append(f"PartitionName={p['partition']} Nodes={names} Default={'YES' if k == 0 else 'NO'} "
                         f"{limits} State=UP")
        lines.extend(c.extra_conf)
        gres = []
        for name, _part, gtype, gpus in layout:
            devdir = d / "dev" / name
            devdir.mkdir(parents=True, exist_ok=True)
            for g in range(gpus):
                dev = devdir / f"gpu{g}"
                if not dev.exists():
                    os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            last = gpus - 1
            files = f"{i(devdir)}/gpu[0-{last}]" if last > 0 else f"{i(devdir)}/gpu0"
            gres.append(f"NodeName={name} Name=gpu{f' Type={gtype}' if gtype else ''} File={files}")
        (d / "etc" / "slurm.conf").write_text("\n".join(lines) + "\n")
        (d / "etc" / "gres.conf").write_text("\n".join(gres) + "\n")
        # 23.02+ slurmd needs a mounted cgroup fs unless the cgroup plugin is disabled.
        cgroup = ["CgroupPlugin=disabled"] if version >= (23, 2) else []
        (d / "etc" / "cgroup.conf").write_text("\n".join(cgroup + ["ConstrainDevices=no"]) + "\n")

    # ----- processes --------------------------------------------------------------------------
    def _spawn(self, argv: list[str], log_name: str, extra_env: dict | None = None) -> int:
        log = open(self.data_dir / "log" / log_name, "ab")
        env = self.env
        env.update(extra_env or {})
        # chroot(8) execs the program, so the pid is the daemon's own.
        proc = subprocess.Popen(
            [*self.prefix, *argv], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
            start_new_session=True,
        )
        log.close()
        return proc.pid

    def _start_munge(self) -> int:
        d = self.data_dir / "munge"
        key = d / "munge.key"
        if not key.exists():
            with open(key, "wb") as f:
                f.write(os.urandom(1024))
            os.chmod(key, 0o600)
        i = self.inside
        argv = [
            f"{self.config.sbin}/munged",
            "--foreground",
            "--force",
            f"--socket={i(self.munge_socket)}",
            f"--key-file={i(key)}",
            f"--pid-file={i(d / 'munged.pid')}",
            f"--log-file={i(self.data_dir / 'log' / 'munged.log')}",
            f"--seed-file={i(d / 'munged.seed')}",
        ]
        pid = self._spawn(argv, "munged.out")
        self._wait(lambda: self.munge_socket.exists(), 20, "munged did not create its socket", "munged.log")
        return pid

    def _wait(self, ok, timeout: float, what: str, log: str | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ok():
                return
            time.sleep(0.2)
        tail = ""
        if log:
            try:
                tail = "\n" + "\n".join((self.data_dir / "log" / log).read_text(errors="replace").splitlines()[-15:])
            except OSError:
                pass
        raise ClusterError(f"{what} within {timeout:.0f} s{tail}")

    def _alive(self, pid: int, program: str) -> bool:
        return _pid_alive(pid, program, str(self.chroot.path) if self.chroot else None)

    def running(self) -> dict[str, bool]:
        """Which recorded daemons are still alive: {'munged': True, 'slurmctld': ..., 'slurmd:node1': ...}."""
        pids = self.pids()
        out = {}
        for key in ("munged", "slurmctld"):
            if key in pids:
                out[key] = self._alive(pids[key], key)
        for name, pid in pids.get("slurmd", {}).items():
            out[f"slurmd:{name}"] = self._alive(pid, "slurmd")
        return out

    def is_up(self) -> bool:
        alive = self.running()
        expected = 2 + self.config.nodes
        return len(alive) == expected and all(alive.values())

    def any_alive(self) -> bool:
        return any(self.running().values())

    def up(self, timeout: float = 90) -> bool:
        """Start the cluster and wait until every node is idle. Returns False if it was already up.

        For a chroot release, the root is built first if it is not cached yet (debootstrap, about a
        minute), and /proc, /dev, /sys are bind-mounted into it.
        """
        if os.geteuid() != 0:
            raise ClusterError("the local cluster runs slurmd as root (mknod, SlurmdUser=root): run as root")
        if self.is_up():
            self._wait_nodes_idle(timeout)
            return False
        self.state_dir.mkdir(parents=True, exist_ok=True)
        alive = {k for k, v in self.running().items() if v}
        if alive:
            # Half up (e.g. a slurmd died): stop what is ours and start cleanly.
            self.down()
        c = self.config
        for port in [c.ctld_port] + [c.slurmd_port(n) for n in range(c.nodes)]:
            if not port_free(port):
                raise ClusterError(
                    f"port {port} is in use by another program; choose another --port (slurmctld port; "
                    f"slurmd ports follow it)"
                )
        if self.chroot is not None:
            try:
                self.chroot.ensure()
            except ChrootError as e:
                raise ClusterError(str(e)) from e
        base = self.chroot.path if self.chroot else Path("/")
        for d, tool in ((c.sbin, "slurmctld"), (c.sbin, "slurmd"), (c.sbin, "munged"), (c.bin, "sbatch")):
            if not os.access(base / d.lstrip("/") / tool, os.X_OK):
                raise ClusterError(f"{base / d.lstrip('/') / tool} not found: install slurm-wlm and munge "
                                   f"(apt-get install slurm-wlm munge)")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        pids: dict = {}
        try:
            if self.chroot is not None:
                self._save_state(pids)  # so that the mount holder list can see this cluster
                try:
                    self.chroot.acquire(str(self.state_dir))
                except ChrootError as e:
                    raise ClusterError(str(e)) from e
            self.write_config()
            pids["munged"] = self._start_munge()
            self._save_state(pids)
            pids["slurmctld"] = self._spawn(
                [f"{c.sbin}/slurmctld", "-D", "-f", self.inside(self.conf_path)], "slurmctld.out"
            )
            self._save_state(pids)
            self._wait(self._ctld_answers, 30, "slurmctld did not answer", "slurmctld.log")
            pids["slurmd"] = {}
            for name in c.node_names():
                pids["slurmd"][name] = self._spawn(
                    [f"{c.sbin}/slurmd", "-D", "-N", name, "-f", self.inside(self.conf_path)], f"slurmd-{name}.out"
                )
                self._save_state(pids)
            self._wait_nodes_idle(timeout)
        except BaseException:
            self._save_state(pids)
            self.down()
            raise
        return True

    # ----- fault injection (tests): stop/start one daemon by its recorded pid ---------------------
    def kill_daemon(self, name: str, sig: int = signal.SIGTERM, timeout: float = 30) -> int | None:
        """Stop one recorded daemon ('slurmctld' or 'slurmd:nodeN') with ``sig``; returns its pid.

        Only a pid this cluster recorded, still running the program it started, is signalled.
        """
        pids = self.pids()
        if name == "slurmctld":
            pid, program = pids.get("slurmctld"), "slurmctld"
        elif name.startswith("slurmd:"):
            pid, program = pids.get("slurmd", {}).get(name.split(":", 1)[1]), "slurmd"
        else:
            raise ClusterError(f"kill_daemon: unknown daemon {name!r} (slurmctld or slurmd:NODE)")
        if not pid or not self._alive(pid, program):
            return None
        os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while self._alive(pid, program) and time.monotonic() < deadline:
            time.sleep(0.1)
        if self._alive(pid, program):
            os.kill(pid, signal.SIGKILL)
        return pid

    def start_slurmctld(self, timeout: float = 30) -> int:
        """Start slurmctld again (after :meth:`kill_daemon`) on the same config and state; wait until it answers."""
        pids = self.pids()
        if pids.get("slurmctld") and self._alive(pids["slurmctld"], "slurmctld"):
            return pids["slurmctld"]
        pids["slurmctld"] = self._spawn([f"{self.config.sbin}/slurmctld", "-D", "-f", self.inside(self.conf_path)],
                                        "slurmctld.out")
        self._save_state(pids)
        self._wait(self._ctld_answers, timeout, "slurmctld did not answer after a restart", "slurmctld.log")
        return pids["slurmctld"]

    def start_slurmd(self, node: str, timeout: float = 60) -> int:
        """Start one node's slurmd again (after :meth:`kill_daemon`)."""
        pids = self.pids()
        old = pids.get("slurmd", {}).get(node)
        if old and self._alive(old, "slurmd"):
            return old
        pid = self._spawn([f"{self.config.sbin}/slurmd", "-D", "-N", node, "-f", self.inside(self.conf_path)],
                          f"slurmd-{node}.out")
        pids.setdefault("slurmd", {})[node] = pid
        self._save_state(pids)
        return pid

    def _ctld_answers(self) -> bool:
        r = subprocess.run(self.tool("scontrol", "ping"), env=self.env, capture_output=True, text=True, timeout=30,
                           check=False)
        return "is UP" in r.stdout

    def _wait_nodes_idle(self, timeout: float) -> None:
        names = set(self.config.node_names())

        def idle() -> bool:
            try:
                nodes = self.backend.list_nodes()
            except Exception:
                return False
            ok = {n.name for n in nodes if n.state in ("IDLE", "MIXED", "ALLOCATED") and n.usable}
            return names <= ok

        try:
            self._wait(idle, timeout, "not every node became idle", "slurmctld.log")
        except ClusterError as e:
            # The reason is usually in a slurmd's own log (e.g. a cgroup it could not use).
            tails = []
            for name in sorted(names):
                try:
                    lines = (self.data_dir / "log" / f"slurmd-{name}.log").read_text(errors="replace").splitlines()
                except OSError:
                    continue
                errors = [line for line in lines if "error" in line.lower()][-3:]
                if errors:
                    tails.append(f"slurmd {name}:\n" + "\n".join(errors))
            if not tails:
                raise
            raise ClusterError(f"{e}\n" + "\n".join(tails)) from None

    def cancel_jobs(self, timeout: float = 20) -> list[int]:
        """Cancel every active job of this cluster (through its own slurmctld) and wait for them to end.

        Called by ``down`` so that no job step (slurmstepd) of this cluster outlives its slurmd.
        """
        try:
            ids = [j.job_id for j in self.backend.list_jobs()]
        except Exception:
            return []
        if not ids:
            return []
        self.run_tool("scancel", *map(str, ids), timeout=30)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if not self.backend.list_jobs():
                    break
            except Exception:
                break
            time.sleep(0.3)
        return ids

    def down(self, timeout: float = 30) -> list[str]:
        """Stop the daemons this cluster started (by recorded pid), slurmd first. Returns what was stopped.

        Jobs still active in this cluster are cancelled first. For a chroot cluster, the bind mounts
        are removed when no other cluster of the same root is still up.
        """
        pids = self.pids()
        alive = self.running()
        if alive.get("slurmctld") and any(v for k, v in alive.items() if k.startswith("slurmd:")):
            self.cancel_jobs()
        order = [(f"slurmd:{n}", p, "slurmd") for n, p in pids.get("slurmd", {}).items()]
        order += [("slurmctld", pids.get("slurmctld"), "slurmctld"), ("munged", pids.get("munged"), "munged")]
        stopped = []
        for label, pid, program in order:
            if pid and self._alive(pid, program):
                os.kill(pid, signal.SIGTERM)
                stopped.append(label)
                deadline = time.monotonic() + timeout
                while self._alive(pid, program) and time.monotonic() < deadline:
                    time.sleep(0.1)
                if self._alive(pid, program):
                    os.kill(pid, signal.SIGKILL)
        if pids:
            self._save_state({})
        if self.chroot is not None:
            me = str(self.state_dir)

            def still_up(holder: str) -> bool:
                try:
                    return holder != me and LocalCluster(holder).any_alive()
                except Exception:
                    return False

            try:
                self.chroot.release_holder(me, still_up)
            except ChrootError as e:
                raise ClusterError(str(e)) from e
        return stopped

    def status(self) -> dict:
        """Daemon pids and liveness, and (when up) the nodes with their GPUs."""
        pids = self.pids()
        info = {
            "state_dir": str(self.state_dir),
            "slurm_conf": str(self.conf_path),
            "slurm": self.label,
            "up": self.is_up(),
            "daemons": [],
            "nodes": [],
        }
        if self.chroot is not None:
            info["chroot"] = str(self.chroot.path)
            info["slurm_conf_inside"] = self.inside(self.conf_path)
            info["mounts"] = self.chroot.mounted()
        for key, alive in self.running().items():
            pid = pids["slurmd"][key.split(":", 1)[1]] if key.startswith("slurmd:") else pids[key]
            info["daemons"].append({"name": key, "pid": pid, "alive": alive})
        if info["up"]:
            info["version"] = self.backend.version()
            for n in self.backend.list_nodes():
                info["nodes"].append(
                    {"name": n.name, "state": n.state, "gpus_total": n.gpus_total, "gpus_used": n.gpus_used,
                     "partitions": list(n.partitions), "gpu_type": n.gpu_type}
                )
        return info

    # ----- helpers for tests and the demo ------------------------------------------------------
    def _translate(self, arg: str) -> str:
        """Host paths within the chroot, alone or as '--opt=PATH', rewritten to the inside view."""
        if self.chroot is None:
            return arg
        root = str(self.chroot.path).rstrip("/") + "/"
        opt, eq, value = arg.partition("=")
        if arg.startswith(root):
            return self.chroot.inside(arg)
        if eq and opt.startswith("-") and value.startswith(root):
            return f"{opt}={self.chroot.inside(value)}"
        return arg

    def sbatch(self, argv: list[str], cwd: str | os.PathLike | None = None, user: str | None = None) -> int:
        """Submit with ``sbatch --parsable`` (argv list, never a shell) and return the job id.

        For a chroot cluster, paths in ``argv`` and ``cwd`` must lie inside the root (see ``job_dir``);
        they are translated to what the tools inside see.
        """
        cmd = [f"{self.config.bin}/sbatch", "--parsable", *(self._translate(str(a)) for a in argv)]
        if user is not None:
            cmd = ["runuser", "-u", user, "--", *cmd]
        run_cwd = cwd
        if self.chroot is not None:
            if cwd is not None:
                cmd = ["/usr/bin/env", f"--chdir={self.inside(cwd)}", *cmd]
            cmd = [*self.prefix, *cmd]
            run_cwd = None
        r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60, cwd=run_cwd, check=False)
        if r.returncode != 0:
            raise ClusterError(f"sbatch failed (exit {r.returncode}): {r.stderr.strip()}")
        return int(r.stdout.strip().split(";")[0])

    def wait_job(self, job_id: int, predicate, timeout: float = 60, poll: float = 0.5):
        """Poll the backend until ``predicate(job_record_or_None)`` holds; return the last record."""
        deadline = time.monotonic() + timeout
        job = None
        while time.monotonic() < deadline:
            job = self.backend.get_job(job_id, include_finished=True)
            if predicate(job):
                return job
            time.sleep(poll)
        raise TimeoutError(f"job {job_id} did not reach the expected state in {timeout:.0f} s; last: {job}")


def resolve_release(slurm: str | None) -> str | None:
    """'host' (or None, or the host's own codename) -> None; another Debian codename -> itself."""
    if slurm in (None, "", "host"):
        return None
    try:
        if slurm == host_release():
            return None
    except ChrootError:
        pass
    return slurm


@contextlib.contextmanager
def cluster_for(state_dir: str | os.PathLike | None, *, prefix: str = "se-", start_port: int = 24000,
                config: ClusterConfig | None = None):
    """The cluster at ``state_dir`` (it must be up), or a temporary one on free ports, stopped on exit.

    For scripts and benchmarks that take ``--state-dir`` or else bring up a cluster of their own.
    """
    if state_dir is not None:
        cluster = LocalCluster(state_dir)
        if not cluster.is_up():
            raise ClusterError(f"no local cluster is up in {state_dir}")
        yield cluster
        return
    cfg = config or ClusterConfig()
    cfg.ctld_port = find_free_port_block(cfg.nodes + 1, start=start_port)
    cluster = LocalCluster(Path(tempfile.mkdtemp(prefix=prefix)), cfg)
    cluster.up()
    try:
        yield cluster
    finally:
        cluster.down()
