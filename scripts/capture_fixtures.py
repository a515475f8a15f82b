#!/usr/bin/env python3
"""Record real Slurm JSON from a running local cluster into tests/fixtures/slurm-<version>/.

The scenario (each step's output is saved, with what it contains written to MANIFEST.json so that
the parser tests can assert against it):

1. ``idle``: nodes with no jobs.
2. ``mixed``: a requeueable 2-GPU elastic job running, a held 1-GPU elastic job, a pending non-elastic
   job asking for more GPUs than exist on a node (so it stays pending: Resources or
   BadConstraints), and a running non-requeueable 1-GPU job.
3. ``resized``: the 2-GPU job after requeuehold -> update (4 GPUs per node, 2 nodes, admin comment) ->
   release, running again with restart count 1.
4. ``requeue_held``: that job requeue-held again (pending, held, restart count 2).

Usage: ``python scripts/capture_fixtures.py [--state-dir DIR] [--out tests/fixtures]``. It starts its
own cluster on free ports unless ``--state-dir`` names one that is up, and stops what it started.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from slurm_elastic.cluster import ClusterConfig, LocalCluster, find_free_port_block  # noqa: E402

SPEC = "elastic:min_gpus=1,max_gpus=8,min_batch=64,max_batch=1024,max_local_batch=128,batch=256,profile=cifar10"
SCRIPT = "#!/bin/bash\nsleep 600\n"


def os_release() -> str:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    return platform.platform()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state-dir", help="use this running cluster instead of starting one")
    ap.add_argument("--out", default=str(REPO / "tests" / "fixtures"))
    args = ap.parse_args()

    own = args.state_dir is None
    if own:
        state = Path(tempfile.mkdtemp(prefix="se-capture-"))
        cluster = LocalCluster(state, ClusterConfig(ctld_port=find_free_port_block(8, start=23000)))
        cluster.up()
    else:
        cluster = LocalCluster(args.state_dir)
        if not cluster.is_up():
            sys.exit(f"no cluster is up in {args.state_dir}")
    b = cluster.backend
    version = b.version()
    out = Path(args.out) / f"slurm-{'.'.join(version.split('.')[:2])}"
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="se-capture-jobs-"))
    os.chmod(work, 0o755)
    script = work / "job.sh"
    script.write_text(SCRIPT)
    manifest: dict = {
        "slurm_version": version,
        "captured_on": time.strftime("%Y-%m-%d"),
        "os": os_release(),
        "tool": "scripts/capture_fixtures.py",
        "nodes": cluster.config.nodes,
        "gpus_per_node": cluster.config.gpus_per_node,
        "files": {},
    }
    submitted: list[int] = []

    def save(name: str, about: dict) -> None:
        jobs_doc = b.raw_jobs()
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
        big = cluster.sbatch(["--gres=gpu:4", "-N", "5", "-o", "/dev/null", str(script)], cwd=work)
        submitted.append(big)
        norq = cluster.sbatch(["--no-requeue", "--gres=gpu:1", "-o", "/dev/null", str(script)], cwd=work)
        submitted.append(norq)
        wait(norq, lambda j: j is not None and j.is_running)
        time.sleep(1)
        save("mixed", {"jobs": {
            str(elastic): {"state": "RUNNING", "gpus_per_node": 2, "node_count": 1, "elastic": True, "requeue": True,
                           "restart_count": 0},
            str(held): {"state": "PENDING", "held": True, "gpus_per_node": 1, "elastic": True},
            str(big): {"state": "PENDING", "held": False, "gpus_per_node": 4, "node_count": 5, "elastic": False},
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
    finally:
        if submitted:
            subprocess.run(["/usr/bin/scancel", *map(str, submitted)], env=cluster.env, capture_output=True,
                           timeout=30, check=False)
        if own:
            time.sleep(1)
            cluster.down()
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"captured Slurm {version} into {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
