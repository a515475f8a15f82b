"""A job's stop acknowledgement, read from its ckpt_dir as the daemon's enactor asks for it."""

from __future__ import annotations

import logging

from slurm_elastic.daemon.logfmt import event
from slurm_elastic.daemon.userfiles import UserFileError
from slurm_elastic.daemon.userfiles import read_json as read_user_json
from slurm_elastic.spec import SpecError, parse_spec


class CheckpointDirAck:
    """A job acknowledged a stop when its ``stop-ack.<job>.<restart>.json`` is in its ckpt_dir.

    Read through :mod:`userfiles`: a FIFO, symlink or foreign file there is refused at once (the resize
    then times out and the job keeps running), and never blocks the daemon.
    """

    def __init__(self, records, specs=None):
        self.records = records  # callable: job id -> JobRecord of the latest read
        # job id -> the spec the daemon schedules the job by (its last valid one when its Comment turned
        # invalid: the ack is then still read where the job writes it); None: parse the Comment
        self.specs = specs or (lambda job_id: None)
        self._said: dict[int, str] = {}  # job id -> the last problem logged (once per change, not per poll)

    def checkpoint_acked(self, job_id: int) -> bool:
        from slurm_elastic.train.protocol import ack_path

        job = self.records().get(int(job_id))
        if job is None:
            return False
        spec = self.specs(job.job_id)
        if spec is None:
            try:
                spec = parse_spec(job.comment, job.job_id)
            except SpecError:
                return False
        d = spec.checkpoint_dir(job.job_id, job.work_dir)
        if not d:
            return False
        name = ack_path(d, job.job_id, job.restart_count).name
        try:
            data = read_user_json(d, name, job.user_id, max_bytes=64 * 1024)
        except (UserFileError, OSError) as e:
            if self._said.get(int(job_id)) != str(e):
                self._said[int(job_id)] = str(e)
                event(logging.WARNING, "stop-ack not readable", job=job_id, path=f"{d.rstrip('/')}/{name}", error=str(e))
            return False
        return (isinstance(data, dict) and str(data.get("job_id")) == str(job.job_id)
                and data.get("restart_count") == job.restart_count)
