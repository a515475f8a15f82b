#!/usr/bin/env python3
"""Record real Slurm JSON from a running local cluster into tests/fixtures/slurm-<version>/.

The scenario (each step's output is saved, with what it contains written to MANIFEST.json so that
the parser tests can assert against it):

1. ``idle``: nodes with no jobs.
2. ``mixed``: a requeueable 2-GPU elastic job running, a held 1-GPU elastic job, a pending non-elastic
   job asking for every GPU of every node (4 nodes x 4, so it waits for Resources while the elastic
   job runs; 24.11 refuses a job with more nodes than exist at submit time, 22.05 queued it), and a
   running non-requeueable 1-GPU job.
3. ``resized``: the 2-GPU job after requeuehold -> update (4 GPUs per node, 2 nodes, admin comment) ->
   release, running again with restart count 1.
4. ``requeue_held``: that job requeue-held again (pending, held, restart count 2).
5. ``completing``: a 1-GPU job cancelled while its batch script is still ending (it traps SIGTERM and
   sleeps 5 s): 22.05 prints ``"COMPLETING"``, 24.11 ``["CANCELLED", "COMPLETING"]``; both must read
   as an active COMPLETING job.

Usage: ``python scripts/capture_fixtures.py [--slurm host|bookworm|trixie] [--state-dir DIR]
[--out tests/fixtures]``. It starts its own cluster on free ports (with ``--slurm RELEASE``: that
Debian release's Slurm in the project's chroot, built if needed) unless ``--state-dir`` names one
that is up, and stops what it started. ``--slurm all`` captures every version of this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from slurm_elastic.chroot import ChrootRoot, other_release  # noqa: E402
from slurm_elastic.cluster import (  # noqa: E402
    TWO_POOLS,
    ClusterConfig,
    LocalCluster,
    find_free_port_block,
    resolve_release,
)

SPEC = "elastic:min_gpus=1,max_gpus=8,min_batch=64,max_batch=1024,max_local_batch=128,batch=256,profile=cifar10"
SCRIPT = "#!/bin/bash\nsleep 600\n"
SLOW_TO_END = "#!/bin/bash\ntrap 'sleep 5; exit 0' TERM\nsleep 600 &\nwait\n"


def os_release(path: str | Path = "/etc/os-release") -> str:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    return platform.platform()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state-dir", help="use this running cluster instead of starting one")
    ap.add_argument("--out", default=str(REPO / "tests" / "fixtures"))
    ap.add_argument("--slurm", default="host",
                    help="host, a Debian codename (bookworm, trixie: Slurm in a chroot), or 'all' (host + the other)")
    ap.add_argument("--pools", action="store_true",
                    help="capture the two-pool scenario (tests/fixtures/pools-<version>/) instead of the basic one")
    ap.add_argument("--doctor", action="store_true",
                    help="capture 'scontrol show config' of a good and of deliberately broken slurm.conf files "
                         "(tests/fixtures/doctor-<version>/, for slurm-elastic doctor)")
    args = ap.parse_args()
    run = capture_pools if args.pools else capture_doctor if args.doctor else capture
    if args.doctor and args.state_dir:
        sys.exit("--doctor starts its own clusters; it cannot be used with --state-dir")
    if args.pools and args.state_dir:
        sys.exit("--pools starts its own two-pool cluster; it cannot be used with --state-dir")
    if args.slurm == "all":
        if args.state_dir:
            sys.exit("--slurm all starts its own clusters; it cannot be used with --state-dir")
        other = other_release()
        return max(run(None, args.out, None), run(None, args.out, other) if other else 0)
    return run(args.state_dir, args.out, resolve_release(args.slurm))


def _own_cluster(release: str | None, config: ClusterConfig) -> LocalCluster:
    """A cluster on free ports in a scratch state dir (inside the chroot for a release), started."""
    base = None
    if release is not None:  # keep the runtime files inside the root; removed afterwards
        root = ChrootRoot(release)
        root.ensure()
        base = root.path / "srv" / "slurm-elastic"
        base.mkdir(parents=True, exist_ok=True)
    cluster = LocalCluster(Path(tempfile.mkdtemp(prefix="se-capture-", dir=base)), config)
    cluster.up()
    return cluster


def capture_pools(state_dir: None, out_dir: str, release: str | None) -> int:
    """Issue 13's scenario on the two-pool cluster (cluster.TWO_POOLS): node4 drained, reservation
    ``se_maint`` on node2, a typed --constraint --exclusive --time job running, a job in the reservation
    running, a rigid v100:8 x 2 job pending, a held elastic job allowed in both partitions. Saves the job
    and node JSON, and the ``scontrol -o show reservation|partition`` and ``scontrol show config`` text."""
    cluster = _own_cluster(release, ClusterConfig(pools=[dict(p) for p in TWO_POOLS],
                                                  ctld_port=find_free_port_block(6, start=23500), release=release))
    b = cluster.backend
    version = b.version()
    final = Path(out_dir) / f"pools-{'.'.join(version.split('.')[:2])}"
    final.parent.mkdir(parents=True, exist_ok=True)
    out = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    work = cluster.job_dir()
    script = work / "job.sh"
    script.write_text(SCRIPT)
    ids: list[int] = []

    def tool(*args: str) -> str:
        r = cluster.run_tool(*args)
        if r.returncode != 0:
            raise RuntimeError(f"{args}: {r.stderr.strip()}")
        return r.stdout

    try:
        tool("scontrol", "update", "NodeName=node4", "State=DRAIN", "Reason=capture")
        tool("scontrol", "create", "reservation", "ReservationName=se_maint", "Nodes=node2", "StartTime=now",
             "Duration=30", "Users=root")
        typed = cluster.sbatch(["-p", "a100", "--gres=gpu:a100:2", "--constraint=a100", "--exclusive", "--time=30",
                                "-o", "/dev/null", str(script)], cwd=work)
        in_resv = cluster.sbatch(["-p", "a100", "--reservation=se_maint", "--gres=gpu:1", "-o", "/dev/null",
                                  str(script)], cwd=work)
        rigid = cluster.sbatch(["-p", "v100", "--gres=gpu:v100:8", "-N", "2", "-o", "/dev/null", str(script)],
                               cwd=work)
        held = cluster.sbatch(["--hold", "-p", "a100,v100", "--gres=gpu:2", "--time=1-00:00:00", f"--comment={SPEC}",
                               "-o", "/dev/null", str(script)], cwd=work)
        ids += [typed, in_resv, rigid, held]
        for jid in (typed, in_resv):
            cluster.wait_job(jid, lambda j: j is not None and j.is_running, timeout=30)
        time.sleep(1)
        (out / "squeue_pools.json").write_text(json.dumps(b.raw_jobs(), indent=1) + "\n")
        (out / "nodes_pools.json").write_text(json.dumps(b.raw_nodes(), indent=1) + "\n")
        (out / "reservations_pools.txt").write_text(tool("scontrol", "-o", "show", "reservation"))
        (out / "partitions_pools.txt").write_text(tool("scontrol", "-o", "show", "partition"))
        (out / "config_pools.txt").write_text(tool("scontrol", "show", "config"))
        manifest = {
            "slurm_version": version,
            "captured_on": time.strftime("%Y-%m-%d"),
            "tool": "scripts/capture_fixtures.py --pools",
            "cluster": TWO_POOLS,
            "jobs": {
                str(typed): {"state": "RUNNING", "partition": "a100", "gpu_type": "a100", "constraint": "a100",
                             "exclusive": True, "time_limit_s": 1800, "reservation": "", "nodes": ["node1"]},
                str(in_resv): {"state": "RUNNING", "partition": "a100", "gpu_type": "", "reservation": "se_maint",
                               "exclusive": False, "time_limit_s": None, "nodes": ["node2"], "gpus_per_node": 1},
                str(rigid): {"state": "PENDING", "held": False, "partition": "v100", "gpu_type": "v100",
                             "gpus_per_node": 8, "node_count": 2, "time_limit_s": 7200, "exclusive": False},
                str(held): {"state": "PENDING", "held": True, "partitions": ["a100", "v100"], "gpu_type": "",
                            "gpus_per_node": 2, "time_limit_s": 86400},
            },
            "nodes": {
                "node1": {"gpu_type": "a100", "gpus_total": 4, "gpus_used": 4, "features": ["a100"],
                          "partitions": ["a100"], "usable": True, "reservations": []},
                "node2": {"gpu_type": "a100", "gpus_total": 4, "gpus_used": 1, "features": ["a100"],
                          "partitions": ["a100"], "usable": True, "reservations": ["se_maint"]},
                "node3": {"gpu_type": "v100", "gpus_total": 8, "gpus_used": 0, "features": ["v100"],
                          "partitions": ["v100"], "usable": True, "reservations": []},
                "node4": {"gpu_type": "v100", "gpus_total": 8, "gpus_used": 0, "features": ["v100"],
                          "partitions": ["v100"], "usable": False, "reservations": []},
            },
            "partitions": {"a100": {"max_nodes": None, "max_time_s": None, "nodes": ["node1", "node2"]},
                           "v100": {"max_nodes": 2, "max_time_s": 7200, "nodes": ["node3", "node4"]}},
        }
        (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    finally:
        cluster.run_tool("scancel", *map(str, ids))
        cluster.cancel_jobs(timeout=30)
        time.sleep(1)
        cluster.down()
        shutil.rmtree(cluster.state_dir, ignore_errors=True)
    os.chmod(out, 0o755)
    if final.exists():
        shutil.rmtree(final)
    os.replace(out, final)
    print(f"captured the two-pool scenario of Slurm {version} into {final}")
    return 0


PLUGIN = REPO / "plugins" / "job_submit_elastic.lua"
# slurm-elastic doctor's scenarios: extra slurm.conf lines and whether the job_submit plugin is loaded.
# "good" is what the daemon needs; each other one breaks one thing (the key it changes is its name).
DOCTOR_CASES = {
    "good": ([], True),
    "no_requeue": (["JobRequeue=0"], False),  # neither JobRequeue nor the plugin's --requeue rule
    "requeue_by_plugin": (["JobRequeue=0"], True),  # JobRequeue=0, but the plugin requires --requeue
    "preempt": (["PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE"], True),
    "no_root_jobs": (["DisableRootJobs=YES"], True),
}


def capture_doctor(state_dir: None, out_dir: str, release: str | None) -> int:
    """One small cluster (1 node x 4 GPUs) restarted once per case of DOCTOR_CASES: its ``scontrol show
    config`` and ``scontrol -o show partition`` are saved as ``config_<case>.txt`` and
    ``partitions_<case>.txt``. The later of two equal keys in slurm.conf wins (checked in MANIFEST)."""
    from slurm_elastic.backends.dialects import parse_config

    port = find_free_port_block(4, start=23700)
    base = None
    if release is not None:
        root = ChrootRoot(release)
        root.ensure()
        base = root.path / "srv" / "slurm-elastic"
        base.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="se-doctor-", dir=base))
    out, final, version, manifest = None, None, "", {}
    try:
        for case, (extra, plugin) in DOCTOR_CASES.items():
            cluster = LocalCluster(scratch / case, ClusterConfig(
                nodes=1, gpus_per_node=4, ctld_port=port, release=release, extra_conf=list(extra),
                job_submit_lua=str(PLUGIN) if plugin else None))
            cluster.up()
            try:
                version = cluster.backend.version()
                if out is None:
                    final = Path(out_dir) / f"doctor-{'.'.join(version.split('.')[:2])}"
                    final.parent.mkdir(parents=True, exist_ok=True)
                    out = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
                config = cluster.run_tool("scontrol", "show", "config", check=True).stdout
                parts = cluster.run_tool("scontrol", "-o", "show", "partition", check=True).stdout
            finally:
                cluster.down()
            (out / f"config_{case}.txt").write_text(config)
            (out / f"partitions_{case}.txt").write_text(parts)
            seen = parse_config(config)
            manifest[case] = {"extra_slurm_conf": extra, "job_submit_lua": plugin,
                              "read_back": {k.partition("=")[0]: seen.get(k.partition("=")[0]) for k in extra},
                              "JobSubmitPlugins": seen.get("JobSubmitPlugins")}
            print(f"doctor case {case}: Slurm {version}, {len(seen)} keys")
        (out / "MANIFEST.json").write_text(json.dumps({
            "slurm_version": version, "captured_on": time.strftime("%Y-%m-%d"),
            "os": os_release() if release is None else f"Debian {release} packages in a debootstrap chroot on "
                                                       f"{os_release()}",
            "tool": "scripts/capture_fixtures.py --doctor", "plugin": "plugins/job_submit_elastic.lua",
            "cases": manifest}, indent=2) + "\n")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    os.chmod(out, 0o755)
    if final.exists():
        shutil.rmtree(final)
    os.replace(out, final)
    print(f"captured the doctor cases of Slurm {version} into {final}")
    return 0


def capture(state_dir: str | None, out_dir: str, release: str | None) -> int:
    own = state_dir is None
    if own:
        cluster = _own_cluster(release, ClusterConfig(ctld_port=find_free_port_block(8, start=23000), release=release))
    else:
        cluster = LocalCluster(state_dir)
        if not cluster.is_up():
            sys.exit(f"no cluster is up in {state_dir}")
    b = cluster.backend
    version = b.version()
    final = Path(out_dir) / f"slurm-{'.'.join(version.split('.')[:2])}"
    final.parent.mkdir(parents=True, exist_ok=True)
    # Written into a scratch dir and swapped in at the end: a failed run leaves the old capture intact.
    out = Path(tempfile.mkdtemp(prefix=f".{final.name}-", dir=final.parent))
    work = cluster.job_dir()  # where this cluster's sbatch and slurmd see it (inside a chroot)
    script = work / "job.sh"
    script.write_text(SCRIPT)
    manifest: dict = {
        "slurm_version": version,
        "captured_on": time.strftime("%Y-%m-%d"),
        "os": os_release() if cluster.chroot is None else
        f"{os_release(cluster.chroot.path / 'etc/os-release')} (debootstrap chroot on {os_release()})",
        "slurm_from": "host packages" if cluster.chroot is None else
        f"Debian {cluster.config.release} packages in {cluster.chroot.path}",
        "tool": "scripts/capture_fixtures.py",
        "nodes": cluster.config.nodes,
        "gpus_per_node": cluster.config.gpus_per_node,
        "files": {},
    }
    submitted: list[int] = []

    def save(name: str, about: dict, jobs_doc: dict | None = None) -> None:
        jobs_doc = jobs_doc if jobs_doc is not None else b.raw_jobs()
        nodes_doc = b.raw_nodes()
        (out / f"squeue_{name}.json").write_text(json.dumps(jobs_doc, indent=1) + "\n")
        (out / f"nodes_{name}.json").write_text(json.dumps(nodes_doc, indent=1) + "\n")
        manifest["files"][f"squeue_{name}.json"] = {"command": "squeue --json", **about}
        manifest["files"][f"nodes_{name}.json"] = {
            "command": "scontrol show nodes --json" if b.version_tuple() >= (23, 2, 0) else "sinfo --json",
            **about,
        }

    def wait(jid, pred, timeout=30):
        return cluster.wait_job(jid, pred, timeout=timeout)

    try:
        save("idle", {"jobs": {}, "gpus_used": 0})
        elastic = cluster.sbatch(["--requeue", "--gres=gpu:2", f"--comment={SPEC}", "-o", "/dev/null", str(script)],
                                 cwd=work)
        submitted.append(elastic)
        wait(elastic, lambda j: j is not None and j.is_running)
        held = cluster.sbatch(["--hold", "--gres=gpu:1", f"--comment={SPEC}", "-o", "/dev/null", str(script)], cwd=work)
        submitted.append(held)
        big = cluster.sbatch(["--gres=gpu:4", "-N", str(cluster.config.nodes), "-o", "/dev/null", str(script)],
                             cwd=work)
        submitted.append(big)
        norq = cluster.sbatch(["--no-requeue", "--gres=gpu:1", "-o", "/dev/null", str(script)], cwd=work)
        submitted.append(norq)
        wait(norq, lambda j: j is not None and j.is_running)
        time.sleep(1)
        save("mixed", {"jobs": {
            str(elastic): {"state": "RUNNING", "gpus_per_node": 2, "node_count": 1, "elastic": True, "requeue": True,
                           "restart_count": 0},
            str(held): {"state": "PENDING", "held": True, "gpus_per_node": 1, "elastic": True},
            str(big): {"state": "PENDING", "held": False, "gpus_per_node": 4, "node_count": cluster.config.nodes,
                          "elastic": False},
            str(norq): {"state": "RUNNING", "gpus_per_node": 1, "requeue": False, "elastic": False},
        }, "gpus_used": 3})
        b.requeue_hold(elastic)
        decision = "elastic-decision:gpus=8,nodes=2,batch=512,local_batch=64,accum=1,seq=1"
        b.update_job(elastic, gpus_per_node=4, num_nodes=2, num_tasks=8, start_now=True, admin_comment=decision)
        b.release(elastic)
        wait(elastic, lambda j: j is not None and j.is_running and j.node_count == 2)
        time.sleep(1)
        save("resized", {"jobs": {
            str(elastic): {"state": "RUNNING", "gpus_per_node": 4, "gpus_total": 8, "node_count": 2,
                           "restart_count": 1, "admin_comment": decision},
            str(norq): {"state": "RUNNING", "gpus_per_node": 1, "requeue": False},
        }, "gpus_used": 9})
        b.requeue_hold(elastic)
        save("requeue_held", {"jobs": {
            str(elastic): {"state": "PENDING", "held": True, "restart_count": 2, "gpus_per_node": 4, "node_count": 2},
        }, "gpus_used": 1})
        slow = work / "slow_to_end.sh"
        slow.write_text(SLOW_TO_END)
        slow.chmod(0o755)
        ending = cluster.sbatch(["--gres=gpu:1", "-o", "/dev/null", str(slow)], cwd=work)
        submitted.append(ending)
        wait(ending, lambda j: j is not None and j.is_running)
        time.sleep(1)  # let the script reach its trap
        cluster.run_tool("scancel", str(ending), check=True, timeout=30)
        deadline = time.monotonic() + 4
        doc = None
        while time.monotonic() < deadline:  # catch the job while it is still ending (the default squeue view)
            d = b.raw_jobs()
            raw = [j.get("job_state") for j in d["jobs"] if j.get("job_id") == ending]
            if raw and "COMPLETING" in (raw[0] if isinstance(raw[0], list) else [raw[0]]):
                doc = d
                break
            time.sleep(0.05)
        if doc is None:
            raise SystemExit(f"job {ending} was never seen COMPLETING after scancel")
        save("completing", {"jobs": {
            str(ending): {"state": "COMPLETING", "is_active": True, "is_completing": True, "gpus_per_node": 1},
            str(norq): {"state": "RUNNING", "gpus_per_node": 1, "requeue": False},
        }, "gpus_used": 1}, jobs_doc=doc)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)  # the old capture stays as it was
        raise
    finally:
        if submitted:
            cluster.run_tool("scancel", *map(str, submitted), timeout=30)
        if own:
            time.sleep(1)
            cluster.down()
            shutil.rmtree(cluster.state_dir, ignore_errors=True)
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    os.chmod(out, 0o755)
    if final.exists():
        shutil.rmtree(final)
    os.replace(out, final)
    print(f"captured Slurm {version} into {final}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
