"""A real Slurm on one machine: slurmctld plus one ``slurmd -N nodeN`` per emulated GPU node.

Everything lives in one state directory (config, munge key and socket, spool, logs, fake GPU device
files, pids). The machine's /etc/slurm is never touched: tools find this cluster through
``SLURM_CONF``. ``up`` is idempotent; ``down`` stops only the processes this module started (by the
pids it recorded, after checking that each pid still runs the program it started) and removes nothing.

Fake GPUs: Slurm drops GPUs without a device file, so each node gets character devices made with
``mknod`` (major 1, minor 3: the same device as /dev/null), listed as ``File=`` in gres.conf.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from slurm_elastic.backends.cli import CliBackend

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
    bin: str = "/usr/bin"  # where squeue, scontrol, sbatch live

    def node_names(self) -> list[str]:
        return [f"node{i}" for i in range(1, self.nodes + 1)]

    def slurmd_port(self, index: int) -> int:
        return self.ctld_port + 1 + index


def _pid_alive(pid: int, program: str | None = None) -> bool:
    """True if ``pid`` runs and (when given) its executable is ``program``, so a reused pid is not ours."""
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
            name = os.path.basename(exe).replace(" (deleted)", "")
            return name == program or name.startswith(program + "-")
    except OSError:
        return program is None
    return True


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

    # ----- paths and environment -------------------------------------------------------------
    @property
    def conf_path(self) -> Path:
        return self.state_dir / "etc" / "slurm.conf"

    @property
    def munge_socket(self) -> Path:
        return self.state_dir / "munge" / "munge.socket"

    @property
    def env(self) -> dict[str, str]:
        """The environment for Slurm tools (and jobs) to talk to this cluster."""
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf_path)
        return env

    @property
    def backend(self) -> CliBackend:
        if self._backend is None:
            self._backend = CliBackend(env={"SLURM_CONF": str(self.conf_path)}, bin_dir=self.config.bin)
        return self._backend

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
        tmp = self._state_path().with_suffix(".tmp")
        tmp.write_text(json.dumps({"config": asdict(self.config), "pids": pids}, indent=2))
        os.replace(tmp, self._state_path())

    def pids(self) -> dict:
        saved = self._load_state()
        return saved["pids"] if saved else {}

    # ----- config ------------------------------------------------------------------------------
    def _slurm_version(self) -> tuple[int, int]:
        out = subprocess.run(
            [f"{self.config.sbin}/slurmctld", "-V"], capture_output=True, text=True, timeout=30, check=False
        ).stdout
        try:
            major, minor = out.split()[1].split(".")[:2]
            return int(major), int(minor)
        except (IndexError, ValueError) as e:
            raise ClusterError(f"cannot read the Slurm version from 'slurmctld -V': {out!r}") from e

    def write_config(self) -> None:
        c, d = self.config, self.state_dir
        for sub in ("etc", "ctld", "spool", "log", "run", "munge", "dev"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(d / "munge", 0o755)
        version = self._slurm_version()
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
            f"AuthInfo=socket={self.munge_socket},cred_expire={c.cred_expire}",
            f"StateSaveLocation={d / 'ctld'}",
            f"SlurmdSpoolDir={d / 'spool'}/%n",
            f"SlurmctldPidFile={d / 'run'}/slurmctld.pid",
            f"SlurmdPidFile={d / 'run'}/slurmd-%n.pid",
            f"SlurmctldLogFile={d / 'log'}/slurmctld.log",
            f"SlurmdLogFile={d / 'log'}/slurmd-%n.log",
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
        for i, name in enumerate(c.node_names()):
            lines.append(
                f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={c.slurmd_port(i)} "
                f"CPUs={c.cpus_per_node} RealMemory={c.memory_mb} Gres=gpu:{c.gpus_per_node} State=UNKNOWN"
            )
        lines.append(f"PartitionName={c.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        lines.extend(c.extra_conf)
        gres = []
        for name in c.node_names():
            devdir = d / "dev" / name
            devdir.mkdir(parents=True, exist_ok=True)
            for g in range(c.gpus_per_node):
                dev = devdir / f"gpu{g}"
                if not dev.exists():
                    os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            last = c.gpus_per_node - 1
            files = f"{devdir}/gpu[0-{last}]" if last > 0 else f"{devdir}/gpu0"
            gres.append(f"NodeName={name} Name=gpu File={files}")
        (d / "etc" / "slurm.conf").write_text("\n".join(lines) + "\n")
        (d / "etc" / "gres.conf").write_text("\n".join(gres) + "\n")
        cgroup = ["CgroupPlugin=disabled"] if version >= (23, 2) else []
        (d / "etc" / "cgroup.conf").write_text("\n".join(cgroup + ["ConstrainDevices=no"]) + "\n")

    # ----- processes --------------------------------------------------------------------------
    def _spawn(self, argv: list[str], log_name: str, extra_env: dict | None = None) -> int:
        log = open(self.state_dir / "log" / log_name, "ab")
        env = self.env
        env.update(extra_env or {})
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        return proc.pid

    def _start_munge(self) -> int:
        d = self.state_dir / "munge"
        key = d / "munge.key"
        if not key.exists():
            with open(key, "wb") as f:
                f.write(os.urandom(1024))
            os.chmod(key, 0o600)
        argv = [
            f"{self.config.sbin}/munged",
            "--foreground",
            "--force",
            f"--socket={self.munge_socket}",
            f"--key-file={key}",
            f"--pid-file={d / 'munged.pid'}",
            f"--log-file={self.state_dir / 'log' / 'munged.log'}",
            f"--seed-file={d / 'munged.seed'}",
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
                tail = "\n" + "\n".join((self.state_dir / "log" / log).read_text(errors="replace").splitlines()[-15:])
            except OSError:
                pass
        raise ClusterError(f"{what} within {timeout:.0f} s{tail}")

    def running(self) -> dict[str, bool]:
        """Which recorded daemons are still alive: {'munged': True, 'slurmctld': ..., 'slurmd:node1': ...}."""
        pids = self.pids()
        out = {}
        for key in ("munged", "slurmctld"):
            if key in pids:
                out[key] = _pid_alive(pids[key], key)
        for name, pid in pids.get("slurmd", {}).items():
            out[f"slurmd:{name}"] = _pid_alive(pid, "slurmd")
        return out

    def is_up(self) -> bool:
        alive = self.running()
        expected = 2 + self.config.nodes
        return len(alive) == expected and all(alive.values())

    def up(self, timeout: float = 90) -> bool:
        """Start the cluster and wait until every node is idle. Returns False if it was already up."""
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
        for port in [c.ctld_port] + [c.slurmd_port(i) for i in range(c.nodes)]:
            if not port_free(port):
                raise ClusterError(
                    f"port {port} is in use by another program; choose another --port (slurmctld port; "
                    f"slurmd ports follow it)"
                )
        for tool in ("slurmctld", "slurmd", "munged"):
            if not os.access(f"{c.sbin}/{tool}", os.X_OK):
                raise ClusterError(f"{c.sbin}/{tool} not found: install slurm-wlm and munge (apt-get install slurm-wlm munge)")
        self.write_config()
        pids: dict = {}
        try:
            pids["munged"] = self._start_munge()
            self._save_state(pids)
            pids["slurmctld"] = self._spawn(
                [f"{c.sbin}/slurmctld", "-D", "-f", str(self.conf_path)], "slurmctld.out"
            )
            self._save_state(pids)
            self._wait(self._ctld_answers, 30, "slurmctld did not answer", "slurmctld.log")
            pids["slurmd"] = {}
            for name in c.node_names():
                pids["slurmd"][name] = self._spawn(
                    [f"{c.sbin}/slurmd", "-D", "-N", name, "-f", str(self.conf_path)], f"slurmd-{name}.out"
                )
                self._save_state(pids)
            self._wait_nodes_idle(timeout)
        except BaseException:
            self._save_state(pids)
            self.down()
            raise
        return True

    def _ctld_answers(self) -> bool:
        r = subprocess.run(
            [f"{self.config.bin}/scontrol", "ping"], env=self.env, capture_output=True, text=True, timeout=30, check=False
        )
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

        self._wait(idle, timeout, "not every node became idle", "slurmctld.log")

    def down(self, timeout: float = 30) -> list[str]:
        """Stop the daemons this cluster started (by recorded pid), slurmd first. Returns what was stopped."""
        pids = self.pids()
        order = [(f"slurmd:{n}", p, "slurmd") for n, p in pids.get("slurmd", {}).items()]
        order += [("slurmctld", pids.get("slurmctld"), "slurmctld"), ("munged", pids.get("munged"), "munged")]
        stopped = []
        for label, pid, program in order:
            if pid and _pid_alive(pid, program):
                os.kill(pid, signal.SIGTERM)
                stopped.append(label)
                deadline = time.monotonic() + timeout
                while _pid_alive(pid, program) and time.monotonic() < deadline:
                    time.sleep(0.1)
                if _pid_alive(pid, program):
                    os.kill(pid, signal.SIGKILL)
        if pids:
            self._save_state({})
        return stopped

    def status(self) -> dict:
        """Daemon pids and liveness, and (when up) the nodes with their GPUs."""
        pids = self.pids()
        info = {
            "state_dir": str(self.state_dir),
            "slurm_conf": str(self.conf_path),
            "up": self.is_up(),
            "daemons": [],
            "nodes": [],
        }
        for key, alive in self.running().items():
            pid = pids["slurmd"][key.split(":", 1)[1]] if key.startswith("slurmd:") else pids[key]
            info["daemons"].append({"name": key, "pid": pid, "alive": alive})
        if info["up"]:
            for n in self.backend.list_nodes():
                info["nodes"].append(
                    {"name": n.name, "state": n.state, "gpus_total": n.gpus_total, "gpus_used": n.gpus_used,
                     "partitions": list(n.partitions)}
                )
        return info

    # ----- helpers for tests and the demo ------------------------------------------------------
    def sbatch(self, argv: list[str], cwd: str | os.PathLike | None = None, user: str | None = None) -> int:
        """Submit with ``sbatch --parsable`` (argv list, never a shell) and return the job id."""
        cmd = [f"{self.config.bin}/sbatch", "--parsable", *argv]
        if user is not None:
            cmd = ["runuser", "-u", user, "--", *cmd]
        r = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60, cwd=cwd, check=False)
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
