"""How often a task aborts at exit instead of exiting 75, after leaving its gloo process group.

Why: a task that left the group could abort in interpreter finalization ("terminate called without an
active exception", exit 134 / -6) when one of gloo's worker threads freed its last collective only then
(``slurm_elastic.train.dist.leave_process_group``; seen in CI on a 6-task job over 2 nodes). That is rare
per task and racy, so no test can show it; this repeats the ending of the library's stop path and prints
the count.

Each run starts ``--world`` processes on this host (gloo on CPU, a TCPStore as the library makes): a few
DDP steps, the stop flag's all-reduce, the library's two barriers, ``leave_process_group()``, then
``SystemExit(75)`` as ``ElasticJob`` raises it. ``--settle S`` replaces the library's pause before exit
(``none``: ``dist.destroy_process_group()`` alone, the behaviour before the fix); ``--load N`` adds N
busy processes, as a CI machine running two test processes has.

    python benchmarks/exit_aborts.py --world 6 --runs 40 --settle none
    python benchmarks/exit_aborts.py --world 6 --runs 40
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORKER = """\
import datetime, sys
import torch, torch.distributed as dist
import slurm_elastic.train.dist as d
rank, world, port, settle = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
if settle not in ("default", "none"):
    d.LEAVE_SETTLE_S = float(settle)
t = datetime.timedelta(seconds=120)
store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=t)
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=t)
ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 8))
opt = torch.optim.SGD(ddp.parameters(), 0.1)
for _ in range(5):
    opt.zero_grad()
    ddp(torch.randn(8, 64)).sum().backward()
    opt.step()
flag = torch.zeros(2, dtype=torch.int32)
dist.all_reduce(flag)
dist.barrier()  # ElasticJob._stop_and_exit
dist.barrier()  # ElasticJob._teardown
if settle == "none":  # before the fix: no pause (even sleep(0) lets a worker take the GIL)
    dist.destroy_process_group()
else:
    d.leave_process_group()
raise SystemExit(75)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_run(world: int, settle: str, work: Path, timeout: float) -> list[int]:
    """Exit statuses of the ``world`` tasks of one run."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update({"CUDA_VISIBLE_DEVICES": "",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))})
    procs = []
    for r in range(world):
        with open(work / f"rank{r}.log", "wb") as f:
            procs.append(subprocess.Popen([sys.executable, "-c", WORKER, str(r), str(world), str(port), settle],
                                          env=env, stdout=f, stderr=subprocess.STDOUT))
    try:
        return [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:  # only the tasks this run started, by their Popen handles
            if p.poll() is None:
                p.kill()
                p.wait()


def _busy() -> None:
    while True:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=6, help="tasks per run (default 6)")
    ap.add_argument("--runs", type=int, default=20, help="runs (default 20)")
    ap.add_argument("--settle", default="default", help="pause before exit in seconds, or none (default: the library's)")
    ap.add_argument("--timeout", type=float, default=180.0, help="seconds a run may take")
    ap.add_argument("--load", type=int, default=0, help="busy processes beside the runs (default 0)")
    a = ap.parse_args()
    import multiprocessing as mp

    hogs = [mp.Process(target=_busy, daemon=True) for _ in range(a.load)]
    for h in hogs:
        h.start()
    codes: Counter[int] = Counter()
    t0 = time.monotonic()
    try:
        for i in range(a.runs):
            with tempfile.TemporaryDirectory(prefix="exit-aborts-") as tmp:
                rcs = one_run(a.world, a.settle, Path(tmp), a.timeout)
            codes.update(rcs)
            bad = [rc for rc in rcs if rc != 75]
            print(f"run {i + 1}/{a.runs}: exit statuses {rcs}" + (f"  <- {len(bad)} not 75" if bad else ""),
                  flush=True)
    finally:
        for h in hogs:  # only the processes this run started
            h.kill()
            h.join()
    n = sum(codes.values())
    print(f"settle {a.settle}: {n - codes[75]} of {n} task exits were not 75 "
          f"({dict(sorted(codes.items()))}) in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
