"""``python -m slurm_elastic.train.ckptdir``: print this job's checkpoint directory (torch-free).

The daemon looks for a job's stop acknowledgement and throughput report in the directory that
:meth:`ElasticSpec.checkpoint_dir` names: the spec's ``ckpt_dir`` (``%j`` = job id) if the job
declares one, else ``<working dir>/elastic-ckpt/<job id>``. The template calls this module when
``ELASTIC_CKPT_DIR`` is not set, so that the job writes exactly where the daemon reads.
"""

from __future__ import annotations

import os
import sys

from slurm_elastic.spec import SpecError, is_elastic_comment, parse_spec
from slurm_elastic.train.slurm_env import JobRecordError, read_job_record


def checkpoint_dir(job_id: str, work_dir: str, comment: str) -> str:
    if is_elastic_comment(comment):
        spec = parse_spec(comment, job_id)
        return spec.checkpoint_dir(job_id, work_dir)
    return f"{work_dir.rstrip('/')}/elastic-ckpt/{job_id}"


def main() -> int:
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        print("ckptdir: SLURM_JOB_ID is not set (run inside a Slurm job)", file=sys.stderr)
        return 2
    try:
        comment = read_job_record(job_id).comment
    except JobRecordError as e:
        print(f"ckptdir: {e}; using the working directory", file=sys.stderr)
        comment = ""
    try:
        print(checkpoint_dir(job_id, os.getcwd(), comment))
    except SpecError as e:
        print(f"ckptdir: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
