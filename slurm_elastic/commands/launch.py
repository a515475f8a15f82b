"""``slurm-elastic launch [--] train.py ARGS``: the launch logic of an elastic batch script, in Python.

The batch script becomes the spec and one line (``sbatch_templates/elastic.sbatch``)::

    #SBATCH --comment=elastic:...   --requeue --open-mode=append --signal=B:USR2@300 ...
    exec slurm-elastic launch train.py --epochs 20

Run in the batch shell (not under srun), once per start of the job, it

* sets ``ELASTIC_CKPT_DIR`` to the directory the daemon reads (the spec's ``ckpt_dir=``, else
  ``<working dir>/elastic-ckpt/<job>``) unless it is set;
* starts one task per GPU of *this* start with ``srun`` (the daemon changes GPUs and nodes between
  starts; the job's submitted ``--ntasks`` does not follow);
* forwards a USR2 sent to the batch shell (``--signal=B:USR2@T``, ``scancel --batch``) to the tasks
  and leaves ``stop-request.<job>.<restart>`` for tasks that have not installed their handler yet;
* after a checkpointed stop (exit 75, or the stop ack on disk, e.g. torchrun's own exit code),
  keeps the allocation until the daemon requeues the job, then (``ELASTIC_SELF_REQUEUE=1``)
  requeues it itself; and says in the job log that the requeue lines Slurm prints next are a resize,
  not a failure;
* warns when the job started without a daemon decision (submitted without ``--hold`` on a cluster
  without the job_submit plugin: it runs at the submitted size until the daemon resizes it).

Environment: ``ELASTIC_CKPT_DIR``, ``ELASTIC_REQUEUE_WAIT`` (s, default 60), ``ELASTIC_SELF_REQUEUE``
(default 1), ``ELASTIC_PYTHON`` (the interpreter for a ``.py`` script; default this one).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import click

EXIT_CHECKPOINTED = 75


def say(msg: str) -> None:
    job = os.environ.get("SLURM_JOB_ID", "?")
    print(f"elastic: job {job} {msg}", flush=True)


def gpus_on_node(env) -> int:
    """GPUs of this start on each node, from what Slurm gave the batch step."""
    for name in ("SLURM_GPUS_ON_NODE",):
        if env.get(name, "").isdigit():
            return int(env[name])
    for name in ("SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
        if env.get(name):
            return len([x for x in env[name].split(",") if x != ""])
    return 1


def task_layout(env) -> tuple[int, int, list[str]]:
    """``(nodes, tasks, srun args)`` for one task per GPU of this start."""
    gpn = gpus_on_node(env)
    nodes = int(env.get("SLURM_JOB_NUM_NODES", "1") or 1)
    ntasks = gpn * nodes
    args = [f"--ntasks={ntasks}", f"--ntasks-per-node={gpn}"]
    cpus = env.get("SLURM_CPUS_ON_NODE", "")
    if cpus.isdigit() and int(cpus) < gpn:
        args.append("--overcommit")  # fewer CPUs than tasks on this node: share them
    return nodes, ntasks, args


def _explain_requeue(say, restart, ack) -> None:
    say(f"start {restart}: checkpoint is safe ({ack}). A resize by the daemon requeues the job now, and Slurm "
        "then logs 'CANCELLED ... DUE TO JOB REQUEUE' and 'srun: error: ... Terminated': those lines are the "
        "resize, not a failure")


def _resume_must(comment: str | None) -> bool:
    from slurm_elastic.spec import SpecError, parse_spec

    try:
        return (comment or "").strip().startswith("elastic:") and parse_spec(comment).resume == "must"
    except SpecError:
        return False  # the job's own start reports the bad spec


def _ckpt_dir(job_id: str, comment: str | None) -> str:
    from slurm_elastic.train.ckptdir import checkpoint_dir

    return checkpoint_dir(job_id, os.getcwd(), comment or "")


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--srun", "srun_bin", default="srun", show_default=True, help="The srun to start the tasks with.")
@click.option("--torchrun", "use_torchrun", is_flag=True, envvar="ELASTIC_TORCHRUN",
              help="One torchrun agent per node (one worker per GPU) instead of one srun task per GPU; "
                   "single-node starts only.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED, required=True)
def launch(srun_bin, use_torchrun, command):
    """Start the tasks of one start of an elastic job (run in the batch script; see sbatch_templates/)."""
    env = os.environ
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        raise click.ClickException("launch runs inside a Slurm batch job (SLURM_JOB_ID is not set); "
                                   "outside Slurm run the script directly or with torchrun")
    restart = int(env.get("SLURM_RESTART_COUNT", "0") or 0)
    # Catch USR2 from the first moment (the default action would end the batch step); it is acted on
    # once the checkpoint directory and the tasks exist.
    early: list[int] = []
    signal.signal(signal.SIGUSR2, lambda signum, frame: early.append(signum))
    from slurm_elastic.spec import SpecError, is_elastic_comment, parse_decision
    from slurm_elastic.train.protocol import ack_path, stop_request_path
    from slurm_elastic.train.slurm_env import JobRecordError, read_job_record

    try:
        rec = read_job_record(job_id)
    except JobRecordError as e:
        say(f"warning: {e}")
        rec = None
    comment = rec.comment if rec else ""
    if not env.get("ELASTIC_CKPT_DIR"):
        try:
            os.environ["ELASTIC_CKPT_DIR"] = _ckpt_dir(job_id, comment)
        except SpecError as e:
            raise click.ClickException(str(e)) from e
    ckpt = os.environ["ELASTIC_CKPT_DIR"]
    if _resume_must(comment) and not os.path.isdir(ckpt):
        raise click.ClickException(f"resume=must but the checkpoint directory {ckpt} does not exist (a typo in "
                                   "ckpt_dir=? resume=auto starts from scratch)")
    os.makedirs(ckpt, exist_ok=True)
    cmd = list(command)
    python = env.get("ELASTIC_PYTHON") or sys.executable
    if use_torchrun:
        if not cmd[0].endswith(".py"):
            raise click.ClickException("--torchrun runs a Python script: launch --torchrun train.py ARGS")
        # The agent ignores USR2 (its default action would end the step); the workers handle it.
        cmd = [python, "-m", "slurm_elastic.train.run", "--torchrun", f"--nproc-per-node={gpus_on_node(env)}", *cmd]
    elif cmd[0].endswith(".py"):
        # Through the runner: the stop handler is in place before the script's slow imports.
        cmd = [python, "-m", "slurm_elastic.train.run", *cmd]

    if rec is not None and is_elastic_comment(comment):
        try:
            decision = parse_decision(rec.admin_comment, job_id)
        except SpecError:
            decision = None
        if decision is None:
            say("warning: this start has no daemon decision: the job was not held for the daemon (submit with "
                "--hold, or install the job_submit plugin), so it runs at its submitted size and the spec's "
                "batch= until the daemon resizes it")

    nodes, ntasks, srun_args = task_layout(env)
    if use_torchrun:
        if nodes != 1:
            raise click.ClickException(f"--torchrun supports single-node starts; this start has {nodes} nodes "
                                       "(use max_gpus <= GPUs per node in the spec, or one task per GPU)")
        srun_args = ["--ntasks=1", "--ntasks-per-node=1", "--overcommit"]
    say(f"start {restart} on {nodes} node(s) x {ntasks // max(1, nodes)} GPU(s) = {ntasks} tasks "
        f"({env.get('SLURM_JOB_NODELIST', '?')}) at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}")
    proc: list[subprocess.Popen] = []

    def on_usr2(signum, frame):  # noqa: ARG001
        say("USR2 received by the batch shell, asking the tasks to checkpoint")
        try:
            with open(stop_request_path(ckpt, job_id, restart), "a"):
                pass
        except OSError as e:
            say(f"warning: cannot write the stop request file: {e}")
        if proc and proc[0].poll() is None:
            try:
                proc[0].send_signal(signal.SIGUSR2)
            except ProcessLookupError:
                pass

    signal.signal(signal.SIGUSR2, on_usr2)
    proc.append(subprocess.Popen([srun_bin, *srun_args, *cmd]))
    if early:
        on_usr2(signal.SIGUSR2, None)
    # The library's rank 0 explains the requeue lines in the job log before it writes the ack (the
    # daemon's requeue can end this shell before the tasks have exited); said again here when it did not.
    rc = proc[0].wait()
    acked = ack_path(ckpt, job_id, restart).exists()
    say(f"start {restart}: training step ended with exit code {rc} at {time.strftime('%Y-%m-%dT%H:%M:%S%z')}")
    if rc != EXIT_CHECKPOINTED and not acked:
        sys.exit(rc if 0 <= rc < 256 else 1)
    if not acked:  # an ack on disk: the library's rank 0 said it in the job log before writing the ack
        _explain_requeue(say, restart, ack_path(ckpt, job_id, restart))
    say(f"start {restart}: waiting to be requeued")
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    wait_s = int(env.get("ELASTIC_REQUEUE_WAIT", "60") or 60)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        time.sleep(1)
    if env.get("ELASTIC_SELF_REQUEUE", "1") == "1":
        say(f"nobody requeued the job in {wait_s} s; requeueing it")
        subprocess.run(["scontrol", "requeue", job_id], check=False, timeout=60)
        time.sleep(60)
    sys.exit(EXIT_CHECKPOINTED)
