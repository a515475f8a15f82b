"""Real multi-process DDP on CPU (gloo): each "start" spawns one process per rank with the SLURM_*
variables srun would set, and a stand-in ``scontrol`` on PATH that prints the job's record (Comment =
elastic spec, AdminComment = the daemon's decision), so the library reads its assignment exactly as it
does under Slurm. The stop request is a real SIGUSR2 that one rank sends itself mid-step.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from slurm_elastic.spec import Decision  # noqa: E402
from slurm_elastic.train.protocol import EXIT_CHECKPOINTED, read_ack, read_throughput  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

WORKER = textwrap.dedent(
    '''
    import argparse, os, signal, sys, time
    from slurm_elastic.train import install_stop_handler
    install_stop_handler()
    import torch
    import torch.nn.functional as F
    from slurm_elastic.train import ElasticJob

    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--n", type=int, default=200)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--signal-after", type=int, default=-1)
    p.add_argument("--signal-rank", type=int, default=0)
    p.add_argument("--ckpt-every", type=int, default=None)
    p.add_argument("--hang-in-ckpt", type=int, default=0)
    p.add_argument("--allreduce-check", action="store_true")
    p.add_argument("--blob-mb", type=int, default=0)
    a = p.parse_args()
    rank = int(os.environ["SLURM_PROCID"])
    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    ckpts = [0]

    def progress(nbytes):  # fault injection: stop in the middle of the Nth checkpoint write of this start
        if a.hang_in_ckpt and ckpts[0] == a.hang_in_ckpt and nbytes > (a.blob_mb << 19):
            with open(os.path.join(a.out_dir, "hanging"), "w") as f:
                f.write(str(nbytes))
            time.sleep(600)

    job = ElasticJob(a.ckpt_dir, seed=a.seed, checkpoint_every_steps=a.ckpt_every, checkpoint_progress=progress,
                     timeout_s=90, throughput_warmup_steps=1)
    _ckpt = job.checkpoint
    def counting_checkpoint():
        ckpts[0] += 1
        return _ckpt()
    job.checkpoint = counting_checkpoint
    job.setup()
    if a.allreduce_check:
        import torch.distributed as dist
        t = torch.tensor([float(os.environ["SLURM_JOB_ID"])], dtype=torch.float64)
        dist.all_reduce(t)
        with open(os.path.join(a.out_dir, f"allreduce.{os.environ['SLURM_JOB_ID']}.{rank}"), "w") as f:
            f.write(f"{t.item()} {job.ctx.master_port}")
    g = torch.Generator().manual_seed(1234)
    X = torch.randn(a.n, 8, generator=g)
    Y = (X @ torch.randn(8, 3, generator=g)).argmax(1)
    torch.manual_seed(a.seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    if rank == 0 and restart == 0:
        torch.save(model.state_dict(), os.path.join(a.out_dir, "init.pt"))
    ddp = job.wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    job.register(model=model, optimizer=opt)
    if a.blob_mb:
        job.extra["blob"] = torch.zeros(a.blob_mb << 18)  # float32: blob_mb MB of user state
    job.restore()
    seen = open(os.path.join(a.out_dir, f"seen.s{restart}.r{rank}.txt"), "a")
    n_this = 0
    for step in job.steps(dataset_size=a.n, epochs=a.epochs):
        if n_this == a.signal_after and rank == a.signal_rank:
            os.kill(os.getpid(), signal.SIGUSR2)  # only this rank gets the signal, in the middle of a step
        n_this += 1
        for mb in step.micro_batches():
            loss = F.cross_entropy(ddp(X[mb.indices]), Y[mb.indices], reduction="sum") * mb.scale
            loss.backward()
        step.optimizer_step()
        seen.write(f"{step.epoch} {job.optimizer_steps} {','.join(str(int(i)) for i in step.indices)}\\n")
        seen.flush()
    job.finish()
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(a.out_dir, "final.pt"))
    '''
)

SPEC = "elastic:min_gpus=1,max_gpus=4,min_batch=8,max_batch=96,max_local_batch=24,batch=24,max_accum=2"
FAKE_SCONTROL = textwrap.dedent(
    """\
    #!{python}
    import os, sys
    # Stand-in for `scontrol show job ID`: print the record the test wrote for this job.
    assert sys.argv[1:3] == ["show", "job"], sys.argv
    print(open(os.path.join(os.environ["FAKE_SLURM_DIR"], "job." + sys.argv[3] + ".txt")).read())
    """
)


LAUNCHER = textwrap.dedent(
    """
    # Stands in for srun on one host: imports torch once, then forks one process per rank (as
    # DataLoader workers are forked), each with the SLURM_* variables srun would give that task, its
    # own log and its own pid; waits for them and records each rank's exit status.
    import json, os, runpy, sys, traceback
    import torch, torch.distributed, torch.nn.parallel.distributed, torch._dynamo  # the slow imports
    import slurm_elastic.train.job
    cfg = json.loads(sys.argv[1])
    pids = []
    for rank in cfg["ranks"]:
        pid = os.fork()
        if pid == 0:
            fd = os.open(rank["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            os.environ.update(rank["env"])
            sys.argv = [cfg["worker"], *cfg["args"]]
            code = 0
            try:
                runpy.run_path(cfg["worker"], run_name="__main__")
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        pids.append(pid)
    with open(cfg["pids"] + ".tmp", "w") as f:
        json.dump(pids, f)
    os.replace(cfg["pids"] + ".tmp", cfg["pids"])
    rcs = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    with open(cfg["rcs"], "w") as f:
        json.dump(rcs, f)
    """
)


class Start:
    """One start of a job: the launcher process and its rank processes."""

    def __init__(self, proc: subprocess.Popen, pids_file: Path, rcs_file: Path):
        self.proc, self.pids_file, self.rcs_file = proc, pids_file, rcs_file

    def pids(self, timeout: float = 120) -> list[int]:
        deadline = time.time() + timeout
        while not self.pids_file.exists():
            assert time.time() < deadline and self.proc.poll() is None, "the launcher did not start the ranks"
            time.sleep(0.05)
        return json.loads(self.pids_file.read_text())

    def wait(self, timeout: float = 180) -> list[int]:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            self.kill()
        return json.loads(self.rcs_file.read_text())

    def kill(self) -> None:
        if self.proc.poll() is None:
            if self.pids_file.exists():
                for pid in json.loads(self.pids_file.read_text()):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            self.proc.kill()
            self.proc.wait()


class Harness:
    def __init__(self, root: Path):
        self.root = root
        self.bin = root / "bin"
        self.bin.mkdir(parents=True, exist_ok=True)
        (self.bin / "scontrol").write_text(FAKE_SCONTROL.format(python=sys.executable))
        (self.bin / "scontrol").chmod(0o755)
        self.worker = root / "worker.py"
        self.worker.write_text(WORKER)
        self.launcher = root / "launcher.py"
        self.launcher.write_text(LAUNCHER)

    def set_record(self, job_id: int, comment: str = SPEC, decision: Decision | None = None) -> None:
        admin = decision.to_admin_comment() if decision else ""
        (self.root / f"job.{job_id}.txt").write_text(
            f"JobId={job_id} JobName=elastic\n   UserId=root(0) GroupId=root(0) MCS_label=N/A\n"
            f"   JobState=RUNNING Reason=None Dependency=(null)\n   Comment={comment} \n   AdminComment={admin} \n"
            f"   StdOut=/dev/null\n"
        )

    def start(self, job_id: int, world: int, restart: int, *args: str, nodes: int = 1) -> Start:
        per_node = -(-world // nodes)
        ranks = []
        for r in range(world):
            ranks.append({"log": str(self.root / f"log.{job_id}.s{restart}.r{r}.txt"), "env": {
                "SLURM_JOB_ID": str(job_id), "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r % per_node),
                "SLURM_NTASKS": str(world), "SLURM_JOB_NODELIST": f"node[1-{nodes}]" if nodes > 1 else "node1",
                "SLURM_JOB_NUM_NODES": str(nodes), "SLURM_RESTART_COUNT": str(restart), "SLURM_STEP_ID": "0",
            }})
        tag = f"{job_id}.s{restart}"
        cfg = {"worker": str(self.worker), "args": list(args), "ranks": ranks,
               "pids": str(self.root / f"pids.{tag}.json"), "rcs": str(self.root / f"rcs.{tag}.json")}
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("SLURM_") and k not in ("MASTER_ADDR", "MASTER_PORT")}
        env.update({"PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}", "FAKE_SLURM_DIR": str(self.root),
                    "OMP_NUM_THREADS": "1"})
        proc = subprocess.Popen([sys.executable, str(self.launcher), json.dumps(cfg)], env=env,
                                stdout=subprocess.DEVNULL, stderr=open(self.root / f"launcher.{tag}.txt", "ab"))
        return Start(proc, Path(cfg["pids"]), Path(cfg["rcs"]))

    def run(self, job_id: int, world: int, restart: int, *args: str, timeout: float = 180, **kw) -> list[int]:
        return self.start(job_id, world, restart, *args, **kw).wait(timeout)

    def log(self, job_id: int, restart: int, rank: int = 0) -> str:
        return (self.root / f"log.{job_id}.s{restart}.r{rank}.txt").read_text()


def read_seen(out: Path, restart: int, world: int) -> list[list[tuple[int, int, list[int]]]]:
    """Per rank: [(epoch, step, indices)] of one start."""
    ranks = []
    for r in range(world):
        rows = []
        for line in (out / f"seen.s{restart}.r{r}.txt").read_text().splitlines():
            e, s, idx = line.split(" ", 2) if line.count(" ") >= 2 else (*line.split(" "), "")
            rows.append((int(e), int(s), [int(i) for i in idx.split(",") if i]))
        ranks.append(rows)
    return ranks


def max_param_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run: N=200, 2 epochs, global batch 48 on 2 ranks (job 100)."""
    h = Harness(tmp_path_factory.mktemp("reference"))
    out = h.root / "out"
    out.mkdir()
    h.set_record(100, decision=Decision(gpus=2, nodes=1, batch=48, local_batch=24, accum=1, seq=1))
    t0 = time.time()
    rcs = h.run(100, 2, 0, "--ckpt-dir", str(h.root / "ckpt"), "--out-dir", str(out))
    print(f"reference run: {time.time() - t0:.1f} s")
    assert rcs == [0, 0], h.log(100, 0)
    return {"final": torch.load(out / "final.pt"), "init": torch.load(out / "init.pt")}


def test_exactly_once_across_world_sizes_1_2_4_3_with_batch_changes(tmp_path):
    h = Harness(tmp_path)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    n, job = 206, 7
    common = ("--ckpt-dir", str(ckpt), "--out-dir", str(out), "--n", str(n), "--epochs", "2")
    # (world, decision or None, steps before the self-signal, signalling rank)
    plan = [
        (1, None, 3, 0),  # no decision: the spec's batch 24 on 1 rank
        (2, Decision(gpus=2, nodes=1, batch=48, local_batch=24, accum=1, seq=1), 2, 1),  # crosses the epoch end
        (4, Decision(gpus=4, nodes=1, batch=32, local_batch=4, accum=2, seq=2), 2, 3),  # gradient accumulation
        (3, Decision(gpus=3, nodes=1, batch=36, local_batch=6, accum=2, seq=3), -1, 0),  # to the end; last tail 2 < 3
    ]
    for restart, (world, decision, after, sig_rank) in enumerate(plan):
        h.set_record(job, decision=decision)
        rcs = h.run(job, world, restart, *common, "--signal-after", str(after), "--signal-rank", str(sig_rank))
        last = restart == len(plan) - 1
        assert rcs == [0 if last else EXIT_CHECKPOINTED] * world, h.log(job, restart)
        if not last:
            ack = read_ack(ckpt, job, restart)
            assert ack is not None and ack["world_size"] == world and ack["exit_code"] == EXIT_CHECKPOINTED
        steps = [len(rows) for rows in read_seen(out, restart, world)]
        # All ranks stopped after the same step although only one rank got the signal.
        assert len(set(steps)) == 1, steps
        if after >= 0:
            assert steps[0] == after + 1  # the step in flight finishes, then everyone stops

    # Every sample of each epoch was used exactly once, over all four starts and all ranks.
    per_epoch: dict[int, Counter] = {0: Counter(), 1: Counter()}
    batches = []
    for restart, (world, *_rest) in enumerate(plan):
        ranks = read_seen(out, restart, world)
        for step_rows in zip(*ranks, strict=True):
            epochs = {row[0] for row in step_rows}
            assert len(epochs) == 1  # ranks agree on the step
            idx = [i for row in step_rows for i in row[2]]
            per_epoch[epochs.pop()].update(idx)
            batches.append((world, len(idx)))
    for e, counts in per_epoch.items():
        assert sorted(counts) == list(range(n)), f"epoch {e}: missing {set(range(n)) - set(counts)}"
        assert max(counts.values()) == 1, f"epoch {e}: repeated {[i for i, c in counts.items() if c > 1]}"
    # The batch changed with the starts (24, 48, 32, 36), tails included.
    assert {b for w, b in batches if w == 1} == {24}
    assert {b for w, b in batches if w == 2} == {48, 206 - 96 - 96}
    assert {b for w, b in batches if w == 4} == {32}
    assert {b for w, b in batches if w == 3} == {36, 2}
    # The checkpoint's history records every start; throughput was measured per (world, batch).
    state = torch.load(ckpt / "checkpoint.pt")
    assert [(s["world_size"], s["global_batch"]) for s in state["history"]] == [(1, 24), (2, 48), (4, 32), (3, 36)]
    assert state["epoch"] == 2 and state["offset"] == 0 and state["samples_seen"] == 2 * n
    points = {(p["gpus"], p["batch"]): p["samples_per_s"] for p in read_throughput(ckpt)}
    print("throughput samples/s:", {k: round(v) for k, v in points.items()})
    assert set(points) <= {(1, 24), (2, 48), (4, 32), (3, 36)} and (3, 36) in points
    assert all(v > 0 for v in points.values())


def test_resume_at_other_world_size_matches_uninterrupted_run(tmp_path, reference):
    h = Harness(tmp_path)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    job = 101
    common = ("--ckpt-dir", str(ckpt), "--out-dir", str(out))
    starts = [  # the same global batch 48 as the reference, at other world sizes and splits
        (2, Decision(gpus=2, nodes=1, batch=48, local_batch=24, accum=1, seq=1), 2, 1),
        (3, Decision(gpus=3, nodes=1, batch=48, local_batch=8, accum=2, seq=2), -1, 0),
    ]
    for restart, (world, decision, after, sig_rank) in enumerate(starts):
        h.set_record(job, decision=decision)
        rcs = h.run(job, world, restart, *common, "--signal-after", str(after), "--signal-rank", str(sig_rank))
        assert rcs == [EXIT_CHECKPOINTED if after >= 0 else 0] * world, h.log(job, restart)
    final = torch.load(out / "final.pt")
    diff = max_param_diff(final, reference["final"])
    moved = max_param_diff(reference["final"], reference["init"])
    print(f"max |param difference| elastic 2->3 vs uninterrupted: {diff:.2e} (training moved params by {moved:.2f})")
    assert moved > 0.05  # the comparison is not between two untrained models
    assert diff <= 1e-5


def test_sigkill_during_checkpoint_write_keeps_previous_and_resumes_from_it(tmp_path, reference):
    h = Harness(tmp_path)
    out, ckpt = tmp_path / "out", tmp_path / "ckpt"
    out.mkdir()
    job = 102
    common = ("--ckpt-dir", str(ckpt), "--out-dir", str(out), "--ckpt-every", "3")
    h.set_record(job, decision=Decision(gpus=2, nodes=1, batch=48, local_batch=24, accum=1, seq=1))
    # A 4 MB user blob makes the checkpoint big enough that part of it is on disk when the write stops.
    start = h.start(job, 2, 0, *common, "--hang-in-ckpt", "2", "--blob-mb", "4")
    try:
        pids = start.pids()
        deadline = time.time() + 120
        while not (out / "hanging").exists():
            assert time.time() < deadline and start.proc.poll() is None, h.log(job, 0)
            time.sleep(0.05)
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        rcs = start.wait(60)
    finally:
        start.kill()
    assert rcs == [-signal.SIGKILL] * 2
    partial = list(ckpt.glob(".checkpoint.pt.*.tmp"))
    assert len(partial) == 1, list(ckpt.iterdir())  # the killed write left its temporary file, not checkpoint.pt
    assert partial[0].stat().st_size > 1 << 20  # really killed in the middle of writing
    with pytest.raises(RuntimeError):  # "PytorchStreamReader failed reading zip archive ..."
        torch.load(partial[0])
    state = torch.load(ckpt / "checkpoint.pt")  # weights_only=True, torch's default
    assert state["optimizer_steps"] == 3 and state["offset"] == 3 * 48
    # The next start (at another world size) resumes from that checkpoint and ends where an
    # uninterrupted run ends.
    h.set_record(job, decision=Decision(gpus=1, nodes=1, batch=48, local_batch=24, accum=2, seq=2))
    rcs = h.run(job, 1, 1, *common, "--blob-mb", "4")
    assert rcs == [0], h.log(job, 1)
    assert "resumed from checkpoint.pt: epoch 0, offset 144" in h.log(job, 1)
    first_step = read_seen(out, 1, 1)[0][0][1]
    assert first_step == 3  # steps 4-6 of the killed start are redone, nothing before them
    assert not list(ckpt.glob(".checkpoint.pt.*.tmp"))
    diff = max_param_diff(torch.load(out / "final.pt"), reference["final"])
    print(f"max |param difference| after crash+resume vs uninterrupted: {diff:.2e}")
    assert diff <= 1e-5


def test_two_jobs_at_once_on_one_host_get_distinct_ports(tmp_path):
    h = Harness(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    # 10001 and 20001 share their last four digits, so a "15000 + job_id % 10000" port would collide.
    jobs = (10001, 20001)
    # A stale rendezvous file from an earlier attempt of job 10001, pointing at a port that is alive
    # (someone else's listener): it must be ignored, not joined.
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen()
    squatted = squatter.getsockname()[1]
    rdzv = tmp_path / "ckpt.10001" / "rendezvous"
    rdzv.mkdir(parents=True)
    (rdzv / "10001.0.0.json").write_text(json.dumps({
        "addr": "127.0.0.1", "port": squatted, "nonce": "stale", "world_size": 2,
        "time": time.time() - 3600}))
    starts = []
    try:
        for j in jobs:
            h.set_record(j, decision=Decision(gpus=2, nodes=1, batch=48, local_batch=24, accum=1, seq=1))
            starts.append(h.start(j, 2, 0, "--ckpt-dir", str(tmp_path / f"ckpt.{j}"), "--out-dir", str(out),
                                  "--epochs", "1", "--allreduce-check"))
        rcs = [s.wait(180) for s in starts]
    finally:
        squatter.close()
        for s in starts:
            s.kill()
    assert rcs == [[0, 0], [0, 0]], [h.log(j, 0) for j in jobs]
    ports = {}
    for j in jobs:
        for r in range(2):
            total, port = (out / f"allreduce.{j}.{r}").read_text().split()
            assert float(total) == 2 * j  # each job's all-reduce saw exactly its own two ranks
            ports.setdefault(j, set()).add(int(port))
    assert all(len(p) == 1 for p in ports.values())
    assert ports[10001] != ports[20001]
    assert squatted not in ports[10001]  # the stale file was not followed
