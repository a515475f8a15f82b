"""Process-group setup from the Slurm environment, with a master port that cannot collide.

Rank, local rank and world size come from ``SLURM_PROCID`` / ``SLURM_LOCALID`` / ``SLURM_NTASKS``; the
master address is the first node of the step's node list (``SLURM_STEP_NODELIST`` or
``SLURM_JOB_NODELIST``, expanded here), falling back to rank 0's own host name and then 127.0.0.1 when
the node name does not resolve (emulated nodes on one host).

The port. Ports derived from the job id (Lightning: 15000 + last 4 digits; submitit: Random(job_id))
collide when several jobs share a host, as emulated nodes do, and a port reused after a requeue fails
with EADDRINUSE while anything still holds it. So rank 0 lets the kernel choose: it opens the c10d
``TCPStore`` on port 0 and publishes ``{addr, port, nonce}`` in
``<rendezvous dir>/<job>.<restart>.<step>.json`` (atomically; the directory is the job's checkpoint
directory, which all nodes share). The other ranks wait for that file, connect, and check that the
store they reached holds the same nonce, so a stale file or a foreign store fails loudly instead of
mixing two jobs. The key includes ``SLURM_RESTART_COUNT`` and the step id, so each start has its own.
``MASTER_ADDR`` / ``MASTER_PORT`` in the environment override all of this (then the user guarantees
uniqueness). Without a rendezvous directory the port is derived from (job, restart, step) and a busy
port is an error that says so.

``init_process_group`` always gets an explicit timeout (gloo's default is 30 min, NCCL's 10 min).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import secrets
import socket
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .protocol import atomic_write_json
from .slurm_env import SlurmEnv

NONCE_KEY = "slurm_elastic/nonce"
CLOCK_SKEW_S = 10.0
# Seconds between leaving the process group and exiting: see leave_process_group.
LEAVE_SETTLE_S = 0.2


class RendezvousError(RuntimeError):
    pass


@dataclass
class DistContext:
    rank: int
    local_rank: int
    world_size: int
    backend: str
    device: torch.device
    master_addr: str
    master_port: int
    store: dist.Store
    rdzv_file: Path | None


def choose_backend(env: Mapping[str, str] | None = None) -> tuple[str, torch.device, int]:
    """``(backend, device_type, gpus_visible)``: nccl with CUDA, gloo otherwise (SLURM_ELASTIC_BACKEND overrides)."""
    env = os.environ if env is None else env
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = env.get("SLURM_ELASTIC_BACKEND") or ("nccl" if ngpu else "gloo")
    return backend, torch.device("cuda" if ngpu and backend == "nccl" else "cpu"), ngpu


def _resolves(host: str) -> bool:
    try:
        socket.getaddrinfo(host, None)
        return True
    except (socket.gaierror, UnicodeError, OSError):
        return False


def master_address(senv: SlurmEnv, env: Mapping[str, str] | None = None, *, own_node: bool = False) -> str:
    """The address rank 0 listens on: ``MASTER_ADDR``, else the first node of the step (or, with
    ``own_node``, the node rank 0 itself runs on, which only rank 0 can know), else this host's name."""
    env = os.environ if env is None else env
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    first = senv.first_node if senv.nodes else None
    candidates = ([senv.node_name] if own_node and senv.node_name else []) + [first, socket.gethostname()]
    for host in candidates:
        if host and _resolves(host):
            return host
    return "127.0.0.1"


def derived_port(job_id: str | None, restart: int, step: str, lo: int = 20000, hi: int = 60000) -> int:
    key = f"{job_id}.{restart}.{step}".encode()
    return lo + zlib.crc32(key) % (hi - lo)


def rendezvous_path(rdzv_dir: str | os.PathLike, senv: SlurmEnv) -> Path:
    return Path(rdzv_dir) / f"{senv.job_id or 'local'}.{senv.restart_count}.{senv.step_id}.json"


def _port_open(addr: str, port: int, timeout: float = 2.0) -> bool:
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return True
    except OSError:
        return False


def _wait_for_master(path: Path, not_before: float, deadline: float) -> dict:
    """Rank 0's published address, once the file is from this start and its port accepts connections.

    A file left by an earlier attempt with the same key is older than ``not_before`` or points at a
    closed port; either way we keep polling until rank 0 replaces it.
    """
    delay = 0.02
    tried: set[str] = set()
    while True:
        try:
            with open(path, encoding="utf-8") as f:
                info = json.load(f)
            nonce = str(info.get("nonce"))
            if float(info.get("time", 0)) >= not_before and nonce not in tried:
                if _port_open(info["addr"], int(info["port"])):
                    return info
                tried.add(nonce)
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if time.time() > deadline:
            raise RendezvousError(
                f"rank 0 did not publish a live address in {path} in time (is the checkpoint dir shared "
                "by all nodes? did rank 0 start?)"
            )
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)


def init_distributed(
    senv: SlurmEnv,
    *,
    rdzv_dir: str | os.PathLike | None,
    timeout_s: float = 300.0,
    env: Mapping[str, str] | None = None,
    started_at: float | None = None,
) -> DistContext:
    """Create the TCPStore and the default process group for this task; see the module docstring."""
    env = os.environ if env is None else env
    backend, dev_type, ngpu = choose_backend(env)
    if dev_type.type == "cuda":
        device = torch.device("cuda", senv.local_rank % ngpu)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    timeout = _dt.timedelta(seconds=timeout_s)
    started_at = time.time() if started_at is None else started_at
    is_master = senv.rank == 0
    rdzv_file = None
    if env.get("MASTER_PORT"):
        addr, port = master_address(senv, env), int(env["MASTER_PORT"])
        # Under torchrun the agent may already host the store on MASTER_PORT (then every rank is a client).
        agent_store = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        store = dist.TCPStore(addr, port, senv.world_size, is_master=is_master and not agent_store,
                              timeout=timeout)
        if env.get("TORCHELASTIC_RUN_ID") is not None:
            # The agent's store outlives a worker restart: keep each attempt's keys apart.
            store = dist.PrefixStore(f"slurm_elastic/{env.get('TORCHELASTIC_RUN_ID')}/"
                                     f"{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
    elif rdzv_dir is not None:
        rdzv_file = rendezvous_path(rdzv_dir, senv)
        if is_master:
            addr = master_address(senv, env, own_node=True)
            store = dist.TCPStore(addr, 0, senv.world_size, is_master=True, timeout=timeout,
                                  wait_for_workers=False)
            port = int(store.port)
            nonce = secrets.token_hex(8)
            store.set(NONCE_KEY, nonce)
            atomic_write_json(rdzv_file, {"addr": addr, "port": port, "nonce": nonce, "job_id": senv.job_id,
                                          "restart_count": senv.restart_count, "step_id": senv.step_id,
                                          "world_size": senv.world_size, "pid": os.getpid(),
                                          "time": time.time()})
        else:
            # Accept only a file written by this start's rank 0: not older than this task (less
            # CLOCK_SKEW_S between nodes) and with a port that accepts connections.
            info = _wait_for_master(rdzv_file, started_at - CLOCK_SKEW_S, time.time() + timeout_s)
            addr, port, nonce = info["addr"], int(info["port"]), info["nonce"]
            if int(info.get("world_size", senv.world_size)) != senv.world_size:
                raise RendezvousError(f"{rdzv_file} is for world size {info.get('world_size')}, "
                                      f"this task has SLURM_NTASKS={senv.world_size}")
            store = dist.TCPStore(addr, port, senv.world_size, is_master=False, timeout=timeout)
            got = store.get(NONCE_KEY).decode()
            if got != nonce:
                raise RendezvousError(f"the store at {addr}:{port} belongs to another job/start ({got} != {nonce})")
    else:
        addr = master_address(senv, env)
        port = derived_port(senv.job_id, senv.restart_count, senv.step_id)
        try:
            store = dist.TCPStore(addr, port, senv.world_size, is_master=is_master, timeout=timeout)
        except Exception as e:  # noqa: BLE001
            raise RendezvousError(
                f"cannot use the derived port {addr}:{port} ({e}); give a shared rendezvous/checkpoint dir "
                "or set MASTER_PORT"
            ) from e
    dist.init_process_group(backend, store=store, rank=senv.rank, world_size=senv.world_size, timeout=timeout)
    return DistContext(senv.rank, senv.local_rank, senv.world_size, backend, device, addr, port, store, rdzv_file)


def leave_process_group() -> None:
    """``dist.destroy_process_group()``, then a short wait before this task may exit.

    Why: destroying the group leaves gloo's worker threads running while a DDP module still holds it,
    and a worker frees a finished collective only after waking the thread that waited for it; freeing a
    tensor Python has seen takes the GIL. Should this thread go straight on to exit, it holds the GIL
    into interpreter finalization, the worker then gets it only to be exited, and the task aborts
    ("terminate called without an active exception", exit 134 where 75 or 0 was due: seen in CI; the
    core dump shows ``~AsyncBarrierWork`` in ``ProcessGroupGloo::runLoop`` taking the GIL during
    ``Py_FinalizeEx``). Sleeping releases the GIL, so the workers finish first;
    ``benchmarks/exit_aborts.py`` counts the aborts with and without the wait (docs/MEASUREMENTS.md).
    """
    dist.destroy_process_group()
    time.sleep(LEAVE_SETTLE_S)
