"""Issue 13 end to end: the daemon on a real two-pool Slurm (partition a100: 2 nodes x a100:4; partition
v100: 2 nodes x v100:8; the session's ``pools_cluster``), no mocks.

Checked every cycle, from what Slurm runs:

- no job ever runs outside its partition or gres type, and nothing runs on the drained node;
- a job allowed in both partitions runs in the pool the allocator chose for it;

and then: a plain rigid ``--gres=gpu:v100:8`` job submitted while elastic jobs fill the cluster starts
within two daemon cycles plus one rescale (the daemon shrinks the elastic jobs of its pool and grows
nobody into the GPUs it keeps free for it; Slurm's own scheduler starts the rigid job). Each v100 node
holds an elastic job, so one must move: it restarts on the other node, smaller, with the reserved node in
its ``ExcNodeList``.

On the chroot's Slurm version the job directory is bind-mounted on the host at the path Slurm reports,
so the daemon (on the host) reads the jobs' files as on a real site.

The elastic jobs are a few lines of Python under ``srun`` that acknowledge the daemon's stop request the
way the in-job library does (``stop-ack.<job>.<restart>.json``), so the test spends its time on Slurm and
the daemon, not on training.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from slurm_elastic.daemon.config import load_config
from slurm_elastic.daemon.loop import Daemon
from slurm_elastic.demo import write_daemon_config
from slurm_elastic.policies.base import Allocation, JobAllocation, Policy
from slurm_elastic.spec import parse_decision
from tests.chroot_paths import same_path_on_host

pytestmark = [pytest.mark.slurm]

A100, V100 = {"node1", "node2"}, {"node3", "node4"}
DRAINED = "node1"

ACKER = """\
import json, os, signal, time
job, restart = os.environ["SLURM_JOB_ID"], int(os.environ.get("SLURM_RESTART_COUNT", "0"))
rank = int(os.environ.get("SLURM_PROCID", "0"))
ckpt = os.path.join(os.environ["SLURM_SUBMIT_DIR"], "elastic-ckpt", job)

def stop(signum, frame):
    if rank == 0:
        os.makedirs(ckpt, exist_ok=True)
        path = os.path.join(ckpt, f"stop-ack.{job}.{restart}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"job_id": job, "restart_count": restart}, f)
        os.replace(path + ".tmp", path)

signal.signal(signal.SIGUSR2, stop)
while True:
    time.sleep(0.5)
"""


STEPPED = """\
if rank == 0:
    os.makedirs(ckpt, exist_ok=True)
    with open(os.path.join(ckpt, "throughput.json.tmp"), "w") as f:
        json.dump({"job_id": job, "points": [], "starts": [{"restart_count": restart, "first_step": time.time()}]}, f)
    os.replace(os.path.join(ckpt, "throughput.json.tmp"), os.path.join(ckpt, "throughput.json"))
"""


def _submit(c, work: Path, name: str, sbatch_args: list[str], spec: str) -> int:
    d = work / name
    d.mkdir(parents=True, exist_ok=True)
    script = d / "job.sh"
    script.write_text(f"#!/bin/bash\nexec srun python3 {c.inside(work / 'acker.py')}\n")
    return c.sbatch(["--hold", "--requeue", f"--job-name=pools-{name}", "-o", str(d / "job.out"),
                     f"--comment={spec}", *sbatch_args, str(script)], cwd=d)


def _scontrol(c, *args: str) -> None:
    r = c.run_tool("scontrol", *args)
    assert r.returncode == 0, (args, r.stderr)


def test_daemon_places_in_pools_never_on_a_drained_node_and_lets_a_rigid_job_start(pools_cluster, tmp_path):
    c = pools_cluster
    work = c.job_dir("pools-daemon")
    with same_path_on_host(c, work):
        _run(c, work)


def _run(c, work: Path) -> None:
    work.chmod(0o755)
    (work / "acker.py").write_text(ACKER)
    cfg_path = work / "elastic.toml"
    write_daemon_config(cfg_path, work / "state", 9788)
    cfg_path.write_text(cfg_path.read_text().replace("cooldown_s = 8", "cooldown_s = 2").replace(
        "restart_cost_s = 5", "restart_cost_s = 2") + 'metrics_address = ""\npartitions = ["a100", "v100"]\n')
    d = Daemon(load_config(cfg_path), backend=c.backend)
    ids: list[int] = []
    _scontrol(c, "update", f"NodeName={DRAINED}", "State=DRAIN", "Reason=pools-test")
    d.open()
    allowed: dict[int, set[str]] = {}
    chosen: dict[int, set[str]] = {}  # job -> nodes of the pool the allocator chose at its last start

    def cycle_and_check():
        res = d.cycle()
        assert res is not None
        pools = {p.name: {n for n, _ in p.node_capacity} for p in res.snapshot.problem.pools}
        assert len(pools) == 2, pools  # a100 (node2 only, node1 drained) and v100
        for p in pools.values():
            assert DRAINED not in p
        for a in res.plan.actions:
            if a.kind == "start" and a.job_id in allowed:
                chosen[a.job_id] = pools[res.allocation.jobs[a.job_id].pool]
        for r in c.backend.list_jobs():
            if not r.is_running:
                continue
            assert DRAINED not in r.nodes, r
            if r.job_id in allowed:
                assert set(r.nodes) <= allowed[r.job_id], (r.job_id, r.nodes, allowed[r.job_id])
                if r.job_id in chosen:
                    assert set(r.nodes) <= chosen[r.job_id], (r.job_id, r.nodes, chosen[r.job_id])
        return res

    try:
        spec = "elastic:min_gpus=1,max_gpus={},min_batch=32,max_batch=256,max_local_batch=64,batch=64"
        both = _submit(c, work, "both", ["-p", "a100,v100", "--gres=gpu:1"], spec.format(8))
        v100 = _submit(c, work, "v100", ["-p", "v100", "--gres=gpu:v100:1"], spec.format(16))
        a100 = _submit(c, work, "a100", ["-p", "a100", "--gres=gpu:a100:1"], spec.format(4))
        ids += [both, v100, a100]
        allowed.update({both: A100 | V100, v100: V100, a100: A100})
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            res = cycle_and_check()
            assert not res.snapshot.errors, {j: str(e) for j, e in res.snapshot.errors.items()}
            running = {r.job_id: r for r in c.backend.list_jobs() if r.is_running}
            if all(j in running for j in (both, v100, a100)):
                break
            time.sleep(1)
        running = {r.job_id: r for r in c.backend.list_jobs() if r.is_running}
        assert all(j in running for j in (both, v100, a100)), (running, d.db.decisions())
        assert chosen[both] in (A100 - {DRAINED}, V100), chosen
        for j in (both, v100, a100):
            print(f"job {j}: {running[j].gpus_total} GPUs on {','.join(running[j].nodes)} "
                  f"(partition {running[j].partition}, type {running[j].gpu_type or '-'})")

        # Let the daemon fill the cluster (it grows the jobs into the free GPUs), then a rigid 8-GPU job.
        for _ in range(20):
            cycle_and_check()
            used = sum(r.gpus_total for r in c.backend.list_jobs() if r.is_running)
            if used >= 4 + 16 - 2:
                break
            time.sleep(1)
        busy = {n for r in c.backend.list_jobs() if r.is_running for n in r.nodes}
        assert V100 <= busy, busy  # no whole v100 node is free: the rigid job needs the daemon
        # A whole v100 node, while an elastic job sits on each: one of them must leave its node (restart on
        # the other one, which Slurm is told by ExcNodeList) -- shrinking in place cannot free a node.
        rigid = c.sbatch(["-p", "v100", "--gres=gpu:v100:8", "-N1", "--job-name=pools-rigid", "-o", "/dev/null",
                          "--wrap", "sleep 300"], cwd=work)
        ids.append(rigid)
        t0, cycles, grew, reserved = time.monotonic(), 0, [], None
        started = None
        while time.monotonic() - t0 < 180:
            before = {r.job_id: r.gpus_total for r in c.backend.list_jobs() if r.is_running}
            res = cycle_and_check()
            cycles += 1
            if rigid in res.snapshot.kept_for_rigid.jobs and not reserved:
                reserved = res.snapshot.kept_for_rigid.jobs[rigid]
            grew += [a for a in res.plan.actions
                     if a.job_id in (both, v100) and a.kind in ("start", "resize") and a.gpus > before.get(a.job_id, 0)
                     and chosen.get(a.job_id) == V100]
            r = c.backend.get_job(rigid)
            if r is not None and r.is_running:
                started = time.monotonic() - t0
                break
            time.sleep(1)
        log = d.db.decisions()
        assert started is not None, ("rigid job never started", c.backend.get_job(rigid), log[-10:])
        resizes = [x for x in log if x["action"] == "resize" and x["status"] == "done" and x["ts"] >= t0 - 5]
        print(f"reservation {reserved}; rigid job {rigid} started {started:.1f} s after submission, after {cycles} daemon cycles "
              f"(poll interval 2 s) and {len(resizes)} resizes: "
              f"{[(x['job_id'], x['gpus_from'], x['gpus_to']) for x in resizes]}")
        assert not grew, grew  # nobody grew into the v100 GPUs kept for the rigid job
        r = c.backend.get_job(rigid)
        assert set(r.nodes) <= V100 and r.gpus_total == 8
        assert reserved is not None and set(reserved[1]) <= V100, reserved  # the daemon kept GPUs for it
        # Two cycles to see the job and enact the shrink, plus one rescale (signal, ack, requeue, restart):
        # on this cluster a rescale takes well under 60 s; allow that.
        assert cycles <= 2 + 30, cycles
    finally:
        d.close()
        for j in ids:
            c.run_tool("scancel", str(j))
        _scontrol(c, "update", f"NodeName={DRAINED}", "State=RESUME")


def _stepping_daemon(c, work, extra: str = "") -> Daemon:
    """A daemon over both pools, with short cooldown and restart cost, whose jobs run the acker that also
    reports its first step at each start (the planner moves no job before one); ``extra``: more config."""
    work.chmod(0o755)
    (work / "acker.py").write_text(ACKER.replace("signal.signal(", STEPPED + "signal.signal(", 1))
    cfg_path = work / "elastic.toml"
    write_daemon_config(cfg_path, work / "state", 9789)
    cfg_path.write_text(cfg_path.read_text().replace("cooldown_s = 8", "cooldown_s = 2").replace(
        "restart_cost_s = 5", "restart_cost_s = 2") + 'metrics_address = ""\npartitions = ["a100", "v100"]\n' + extra)
    return Daemon(load_config(cfg_path), backend=c.backend)


def test_daemon_moves_a_job_to_the_fast_type_when_it_frees(pools_cluster):
    """Issue 23 live: a job allowed on both types, started on the slow one (a100 here: the site says v100
    runs 3x faster, ``gpu_speed``) while a rigid job fills the fast one, is moved to the fast one once it
    frees: a restart in the other partition, its gres left untyped as submitted (22.05 never retypes a
    typed request), at that type's per-GPU batch limit (``local_batch_by_type``: 16 on a100, so 2 x 16 x 2
    accumulation there and 2 x 32 x 1 on v100)."""
    c = pools_cluster
    work = c.job_dir("pools-move")
    with same_path_on_host(c, work):
        d = _stepping_daemon(c, work, "gpu_speed = {a100 = 1.0, v100 = 3.0}\n")
        ids: list[int] = []
        d.open()
        try:
            blocker = c.sbatch(["-p", "v100", "--gres=gpu:v100:8", "-N2", "--job-name=pools-blocker", "-o",
                                "/dev/null", "--wrap", "sleep 300"], cwd=work)
            ids.append(blocker)
            spec = ("elastic:min_gpus=2,max_gpus=2,min_batch=64,max_batch=64,max_local_batch=32,batch=64,"
                    "max_accum=2,local_batch_by_type=a100:16")
            job = _submit(c, work, "mover", ["-p", "a100,v100", "--gres=gpu:1"], spec)
            ids.append(job)

            def wait(pred, what, limit=120):
                t0 = time.monotonic()
                while time.monotonic() - t0 < limit:
                    d.cycle()
                    r = c.backend.get_job(job)
                    if r is not None and pred(r):
                        return r
                    time.sleep(1)
                raise AssertionError((what, c.backend.get_job(job), d.db.decisions()[-6:]))

            first = wait(lambda r: r.is_running and set(r.nodes) <= A100, "started on a100")
            d1 = parse_decision(first.admin_comment, job)
            assert (d1.gpus, d1.local_batch, d1.accum) == (2, 16, 2) and d1.parts == ("a100", "v100")
            assert first.partition == "a100" and first.gpu_type == ""
            t0 = time.monotonic()
            c.run_tool("scancel", str(blocker))
            moved = wait(lambda r: r.is_running and set(r.nodes) <= V100, "moved to v100", limit=180)
            d2 = parse_decision(moved.admin_comment, job)
            print(f"job {job}: a100 {first.nodes} {d1} -> v100 {moved.nodes} {d2} in {time.monotonic() - t0:.0f} s "
                  f"(partition {moved.partition}, gres type {moved.gpu_type or 'untyped'}, restarts {moved.restart_count})")
            assert (d2.gpus, d2.local_batch, d2.accum) == (2, 32, 1)
            assert moved.partition == "v100" and moved.gpu_type == "" and moved.restart_count >= 1
            moves = [x for x in d.db.decisions() if x["job_id"] == job and x["action"] == "resize"]
            assert moves and "moved from a100:a100" in moves[-1]["reason"], moves
        finally:
            d.close()
            for j in ids:
                c.run_tool("scancel", str(j))


class _Targets(Policy):
    """The test's own decisions: each named job at 8 GPUs in the pool of the GPU type the test gives it (what
    is under test here is the planner, the enactor and Slurm carrying a cycle of moves out, not a policy's
    choice of one; a policy choosing such a swap is in tests/unit/test_planner.py and the heterogeneous
    simulator)."""

    name = "targets"

    def __init__(self):
        self.where: dict[int, str] = {}

    def allocate(self, problem):
        out = {}
        for r in problem.jobs:
            pool = next((p for p in problem.pools if p.gpu_type == self.where.get(int(r.job_id))), None)
            out[r.job_id] = (JobAllocation(r.job_id, 8, batch=64, local_batch=8, pool=pool.name, reason="test: swap")
                             if pool is not None else JobAllocation(r.job_id, 0, reason="test: not now"))
        return Allocation(out, policy=self.name)


def test_two_jobs_that_swap_gpu_types_are_moved_together(pools_cluster):
    """Issue 23 live: a cycle of moves. Job X runs on the two a100 nodes (2 x 4), job Y on one v100 node (8),
    a rigid job holds the other v100 node; then X is to run on v100 and Y on a100, so each move needs the GPUs
    the other leaves. One at a time neither is ever placed (the planner left both 'no placement' while
    GPUs idled: found on Sia's cluster in the simulator); made together, Slurm requeues both and starts
    each in its new partition once the other has left, gres untyped as submitted, on 22.05 and 24.11."""
    c = pools_cluster
    work = c.job_dir("pools-swap")
    with same_path_on_host(c, work):
        d = _stepping_daemon(c, work)
        ids: list[int] = []
        d.open()
        targets = _Targets()
        d.policy.inner = targets
        try:
            spec = "elastic:min_gpus=8,max_gpus=8,min_batch=64,max_batch=64,max_local_batch=8,batch=64"
            x = _submit(c, work, "swap-x", ["-p", "a100,v100", "--gres=gpu:1"], spec)
            y = _submit(c, work, "swap-y", ["-p", "a100,v100", "--gres=gpu:1"], spec)
            ids += [x, y]
            targets.where = {x: "a100", y: "v100"}

            def wait(pred, what, limit=120):
                t0 = time.monotonic()
                while time.monotonic() - t0 < limit:
                    d.cycle()
                    r = {j: c.backend.get_job(j) for j in (x, y)}
                    if all(v is not None for v in r.values()) and pred(r):
                        return r
                    time.sleep(1)
                raise AssertionError((what, {j: c.backend.get_job(j) for j in (x, y)}, d.db.decisions()[-8:]))

            first = wait(lambda r: r[x].is_running and set(r[x].nodes) == A100 and r[y].is_running
                         and set(r[y].nodes) <= V100, "x on both a100 nodes, y on a v100 node")
            free_v100 = sorted(V100 - set(first[y].nodes))
            blocker = c.sbatch(["-p", "v100", "--gres=gpu:v100:8", "-w", free_v100[0], "--job-name=pools-swap-blocker",
                                "-o", "/dev/null", "--wrap", "sleep 300"], cwd=work)
            ids.append(blocker)
            t_block = time.monotonic()
            while not (b := c.backend.get_job(blocker)) or not b.is_running:
                assert time.monotonic() - t_block < 60, ("blocker never ran", b)
                time.sleep(1)
            t0 = time.monotonic()
            targets.where = {x: "v100", y: "a100"}
            moved = wait(lambda r: r[x].is_running and set(r[x].nodes) <= V100 and r[y].is_running
                         and set(r[y].nodes) == A100, "x on v100 and y on a100", limit=180)
            print(f"swap: x {first[x].nodes} -> {moved[x].nodes}, y {first[y].nodes} -> {moved[y].nodes} in "
                  f"{time.monotonic() - t0:.0f} s (restarts {moved[x].restart_count} / {moved[y].restart_count})")
            assert moved[x].partition == "v100" and moved[y].partition == "a100"
            assert moved[x].gpu_type == "" and moved[y].gpu_type == ""  # gres left untyped, as submitted
            assert set(moved[x].nodes) == set(first[y].nodes)  # each took the GPUs the other left
            swaps = [r for r in d.db.decisions() if r["job_id"] in (x, y) and r["action"] == "resize"]
            assert {r["job_id"] for r in swaps} == {x, y}, swaps
            assert all("made with the moves that free its GPUs" in r["reason"] for r in swaps), swaps
        finally:
            d.close()
            for j in ids:
                c.run_tool("scancel", str(j))
