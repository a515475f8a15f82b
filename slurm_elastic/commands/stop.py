"""``slurm-elastic stop JOBID``: checkpoint a running elastic job now, then end it; the checkpoint stays.

It uses the job's stop protocol (docs/TRAINING.md): USR2 to the job's steps (and the
``stop-request.<job>.<restart>`` file, for tasks that have not installed their handler yet), then it
waits for ``stop-ack.<job>.<restart>.json`` (the checkpoint is on disk) and cancels the job. It
refuses, saying why, when the job is not there, not elastic, not the caller's, or not running (a
pending job has nothing to checkpoint). It prints how to continue in a new submission.

Run as root, it acts on the job's directory only as the job's owner (uid from Slurm): the stop-request
is created by a child that dropped to that user (:mod:`slurm_elastic.daemon.userwrite`), never through a
symlink and never by opening a FIFO or device; the ack is read by the daemon's safe, bounded reader
(:mod:`slurm_elastic.daemon.userfiles`). Anything unsafe there (a symlink, a FIFO, a directory of another
user) is refused, naming the path, before the job is signalled: the job keeps running, untouched.
"""

from __future__ import annotations

import os
import pwd
import time

import click

ACK_MAX_BYTES = 64 * 1024  # the daemon's bound for the same file


def resubmit_hint(comment: str, ckpt_dir: str) -> str:
    """The spec for a new job that continues from ``ckpt_dir`` (ckpt_dir= pinned to that directory, and
    resume=must: a mistyped directory then fails at start instead of training from scratch)."""
    body = comment.strip()[len("elastic:"):]
    items = [i for i in body.split(",") if i.strip() and not i.strip().startswith(("ckpt_dir=", "resume="))]
    return "elastic:" + ",".join([*items, f"ckpt_dir={ckpt_dir}", "resume=must"])


@click.command()
@click.argument("job_id", type=int)
@click.option("--timeout", "timeout_s", type=float, default=600.0, show_default=True,
              help="Seconds to wait for the job's checkpoint acknowledgement.")
def stop(job_id, timeout_s):
    """Checkpoint JOB_ID at its next step and end it; its checkpoint is kept for a new submission."""
    from slurm_elastic.backends.cli import CliBackend

    stop_job(CliBackend(), job_id, timeout_s)


def stop_job(b, job_id: int, timeout_s: float) -> None:
    """What ``stop`` does, over the CLI backend ``b`` (a local chroot cluster's in its tests); a refusal
    raises ``click.ClickException`` with the message the command prints."""
    from slurm_elastic.backends.base import SlurmError
    from slurm_elastic.daemon.userfiles import UserFileError, read_json
    from slurm_elastic.daemon.userwrite import create_file
    from slurm_elastic.spec import SpecError, is_elastic_comment, parse_spec
    from slurm_elastic.train.protocol import ack_path, stop_request_path

    try:
        job = b.get_job(job_id)
        if job is None:
            old = b.get_job(job_id, include_finished=True)
    except SlurmError as e:
        raise click.ClickException(f"job {job_id}: cannot read it from Slurm: {e}") from e
    if job is None:
        state = f"has ended ({old.state})" if old is not None else "is not known to Slurm"
        raise click.ClickException(f"job {job_id} {state}: nothing to stop")
    if not is_elastic_comment(job.comment):
        raise click.ClickException(f"job {job_id} is not an elastic job (its Comment has no 'elastic:' spec), so "
                                   "it cannot checkpoint on request; end it with scancel")
    try:
        spec = parse_spec(job.comment, job.job_id)
    except SpecError as e:
        raise click.ClickException(f"job {job_id}: {e}") from e
    me = pwd.getpwuid(os.geteuid()).pw_name
    if os.geteuid() != 0 and job.user and job.user != me:
        raise click.ClickException(f"job {job_id} belongs to {job.user}, not to {me}")
    ckpt = spec.checkpoint_dir(job.job_id, job.work_dir)
    if not ckpt:
        raise click.ClickException(f"job {job_id}: its checkpoint directory is unknown (no ckpt_dir= in the spec "
                                   "and Slurm does not report its working directory)")
    if not job.is_running:
        why = "held" if job.held else job.state.lower()
        raise click.ClickException(
            f"job {job_id} is not running ({why}): there is nothing to checkpoint. End it with scancel {job_id}; "
            f"its checkpoint directory {ckpt} is kept either way")
    restart = job.restart_count
    uid = job.user_id
    if uid is None:
        raise click.ClickException(f"job {job_id}: Slurm does not report its owner's uid, so its directory {ckpt} "
                                   "is not touched; the job was not signalled and keeps running")
    ack_name = ack_path(ckpt, job_id, restart).name
    untouched = "the job was not signalled and keeps running"

    def read_ack() -> dict | None:
        data = read_json(ckpt, ack_name, uid, max_bytes=ACK_MAX_BYTES)
        if isinstance(data, dict) and str(data.get("job_id")) == str(job_id) and data.get("restart_count") == restart:
            return data
        return None

    try:
        ack = read_ack()
    except UserFileError as e:
        raise click.ClickException(f"job {job_id}: refusing to read stop-ack: {e.describe()}; {untouched}") from None
    if ack is None:
        req = stop_request_path(ckpt, job_id, restart)
        try:
            create_file(ckpt, req.name, uid)
        except FileNotFoundError:
            pass  # no directory yet: the signal is the request; the file only helps tasks that are still starting
        except UserFileError as e:
            raise click.ClickException(f"job {job_id}: refusing to write stop-request: {e.describe()}; "
                                       f"{untouched}") from None
        try:
            b.signal(job_id, "USR2")
        except SlurmError as e:
            raise click.ClickException(f"job {job_id}: cannot signal it: {e}") from e
        click.echo(f"job {job_id}: asked to checkpoint (USR2); waiting for {ckpt}/{ack_name}")
    deadline = time.monotonic() + timeout_s
    problem = ""
    while ack is None:
        time.sleep(0.5)
        try:
            ack = read_ack()
            problem = ""
        except UserFileError as e:  # the job's own atomic write replaces whatever is there; until then, wait
            problem = e.describe()
        if ack is not None:
            break
        try:
            cur = b.get_job(job_id)
        except SlurmError:
            cur = job
        if cur is None or not (cur.is_running or cur.is_completing) or cur.restart_count != restart:
            raise click.ClickException(
                f"job {job_id} ended or was requeued before acknowledging a checkpoint "
                f"({cur.state if cur else 'gone'}); its last periodic checkpoint, if any, is in {ckpt}")
        if time.monotonic() > deadline:
            why = f" ({problem})" if problem else ""
            raise click.ClickException(f"job {job_id}: no checkpoint acknowledgement within {timeout_s:g} s{why}; "
                                       "the job keeps running (is the training script using slurm_elastic.train?)")
    try:
        b._call("scancel", [str(job_id)])
    except SlurmError as e:
        raise click.ClickException(f"job {job_id}: checkpointed ({ack.get('checkpoint')}) but scancel failed: "
                                   f"{e}") from e
    click.echo(f"job {job_id}: stopped after step {ack.get('optimizer_steps')} (epoch {ack.get('epoch')}, "
               f"offset {ack.get('offset')}, {ack.get('samples_seen')} samples); checkpoint {ack.get('checkpoint')} "
               "kept; job cancelled")
    click.echo("to continue in a new job, submit the same batch script with the checkpoint directory pinned:\n"
               f"  sbatch --comment={resubmit_hint(job.comment, ckpt)} <batch script> [args]")
