"""``slurm-elastic check SCRIPT [ARGS]``: a pre-flight of an elastic training script, on a login node or a
laptop (CPU, gloo), before it meets the daemon.

Why: the mistakes that hurt under the daemon (a missing integration call, a loader that is not the
elastic one, a schedule in steps, anything random outside the job's seed) only show at the first resize,
hours into a run. Here the script runs for a few steps in 1 and 2 local processes, is stopped the way
the daemon stops it, and resumes from its checkpoint at another world size (same global batch: the
result must equal an uninterrupted run) and at another batch; what is wrong is said in plain words.

Each run is a fresh process tree started with an argv list (no shell): ``python SCRIPT ARGS`` for one
process, ``python -m torch.distributed.run --standalone --nproc-per-node 2 SCRIPT ARGS`` for two; the
batch comes from ``ELASTIC_BATCH`` and the stop from ``ELASTIC_STOP_AT_STEP`` (read by ``ElasticJob``).
The uninterrupted reference runs beside the first run (a pre-flight's time is mostly process start-up),
each with its own checkpoint directory in the same working directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import click

HINTS = (  # (text in the output, what to tell the user)
    ("cannot be counted in samples", "the lr scheduler cannot follow a batch change; the error above says what "
                                     "to use instead"),
    ("not slurm-elastic's", "the training DataLoader is not the elastic one (Lightning: elastic.dataloader(ds); "
                            "HF: ElasticTrainer builds it; plain: job.loader(ds))"),
    ("never restored the job", "the framework trained without slurm-elastic's hooks (no checkpoint, stops "
                               "ignored); the error above names the call to add"),
    ("callback is missing", "the framework runs without the library's callback: pass **elastic.trainer_kwargs() "
                            "to L.Trainer (Lightning) or use ElasticTrainer (HF)"),
    ("changed outside slurm-elastic", "an lr scheduler that the library does not know steps the lr; register it "
                                      "(job.prepare(..., scheduler=sched)) or use lr_schedule="),
    ("randperm()", "the DataLoader's sampler is not the elastic one"),
)


@dataclass
class Run:
    rc: int
    out: str
    state: dict | None  # the checkpoint after the run

    @property
    def steps(self) -> int | None:
        return None if self.state is None else int(self.state["optimizer_steps"])


def _load(ckpt: Path) -> dict | None:
    import torch

    p = ckpt / "checkpoint.pt"
    return torch.load(p, weights_only=True, map_location="cpu") if p.is_file() else None


def _start(script: str, args: tuple[str, ...], ckpt: Path, *, procs: int, batch: int,
           stop_at: int | None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_",
                                "TORCHELASTIC_", "ELASTIC_"))}
    env.update(ELASTIC_CKPT_DIR=str(ckpt), ELASTIC_BATCH=str(batch), SLURM_ELASTIC_BACKEND="gloo",
               CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"))
    if stop_at is not None:
        env["ELASTIC_STOP_AT_STEP"] = str(stop_at)
    if procs == 1:
        cmd = [sys.executable, script, *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}", script,
               *args]
    # Its own session: a run given up on (timeout, or not needed after an earlier failure) is ended with
    # its DataLoader workers and torchrun's ranks.
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _kill(p: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(p.pid, signal.SIGKILL)


def _wait(p: subprocess.Popen, ckpt: Path, timeout_s: float) -> Run:
    try:
        out, _ = p.communicate(timeout=timeout_s)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        _kill(p)
        out, _ = p.communicate()
        rc, out = 124, f"{out or ''}\n(timed out after {timeout_s:g} s)"
    return Run(rc, out or "", _load(ckpt))


def _run(script: str, args: tuple[str, ...], ckpt: Path, *, procs: int, batch: int, stop_at: int | None,
         timeout_s: float) -> Run:
    return _wait(_start(script, args, ckpt, procs=procs, batch=batch, stop_at=stop_at), ckpt, timeout_s)


def _explain(run: Run) -> str:
    tail = "\n".join(run.out.strip().splitlines()[-12:])
    for needle, hint in HINTS:
        if needle in run.out:
            return f"{hint}\n--- last lines of the run ---\n{tail}"
    return f"--- last lines of the run ---\n{tail}"


def _max_diff(a: dict, b: dict) -> float:
    return max((float((a[k].double() - b[k].double()).abs().max()) for k in a if hasattr(a[k], "double")
                and a[k].numel()), default=0.0)


def check_script(script: str, args: tuple[str, ...], *, batch: int = 8, steps: int = 3, tol: float = 1e-4,
                 timeout_s: float = 600.0, say=click.echo) -> list[str]:
    """Run the pre-flight; return the problems found (empty: the script is ready)."""
    problems: list[str] = []
    work = Path(tempfile.mkdtemp(prefix="slurm-elastic-check-"))
    try:
        say(f"1. one process, batch {batch}, stopped after step {steps} as the daemon would stop it")
        say(f"2. uninterrupted reference: one process, batch {batch}, to step {2 * steps} (meanwhile)")
        # The reference needs nothing from run 1: both at once (a pre-flight's time is mostly start-up).
        ref_p = _start(script, args, work / "r", procs=1, batch=batch, stop_at=2 * steps)
        try:
            a = _run(script, args, work / "a", procs=1, batch=batch, stop_at=steps, timeout_s=timeout_s)
        except BaseException:
            _kill(ref_p)
            ref_p.communicate()
            raise
        if a.state is None or a.steps != steps or a.rc != 75:
            _kill(ref_p)  # the first run already says what is wrong
            ref_p.communicate()
        if a.state is None:
            problems.append("no checkpoint after the stop: the script does not use slurm_elastic.train, or the "
                            "integration is not wired (Lightning: **elastic.trainer_kwargs(); HF: ElasticTrainer); "
                            + _explain(a))
            return problems
        if a.steps != steps or a.rc != 75:
            problems.append(f"the stop was not taken at step {steps} (exit {a.rc}, checkpoint at step {a.steps}): "
                            "is the stop request reaching the loop? " + _explain(a))
            return problems
        say(f"   ok: exit 75, checkpoint at step {a.steps}, {a.state['samples_seen']} samples")
        shutil.copytree(work / "a", work / "b")
        ref = _wait(ref_p, work / "r", timeout_s)
        say(f"3. resume at 2 processes, same batch {batch}, to step {2 * steps}")
        two = _run(script, args, work / "b", procs=2, batch=batch, stop_at=2 * steps, timeout_s=timeout_s)
        for name, r in (("reference", ref), ("2-process resume", two)):
            if r.steps != 2 * steps:
                problems.append(f"the {name} run did not reach step {2 * steps} (checkpoint at step {r.steps}, "
                                f"exit {r.rc}): " + _explain(r))
        if problems:
            return problems
        if two.state["history"][-1].get("world_size") != 2:
            problems.append("the resumed run did not run at world size 2: does the script honour torchrun's "
                            "RANK/WORLD_SIZE (ElasticJob does)?")
        diff = _max_diff(ref.state["model"], two.state["model"])
        say(f"   weights after the resume at 2 processes vs uninterrupted: max difference {diff:.2e}")
        if not diff <= tol:
            problems.append(f"the resume is not exact: after the same steps at the same global batch, 1 process "
                            f"uninterrupted and 1 -> 2 processes differ by {diff:.2e} (tolerance {tol:g}). "
                            "Something decides the data order or the math outside the job's seed: a sampler or "
                            "shuffle of your own (use the elastic loader), unseeded augmentation, dropout (its "
                            "random state is per process: a resume cannot repeat it; p=0 for this check, or a "
                            "larger --tolerance), or a model built before seeding.")
        say(f"4. resume at 2 processes, batch {2 * batch}, one more step")
        grow = _run(script, args, work / "b", procs=2, batch=2 * batch, stop_at=2 * steps + 1, timeout_s=timeout_s)
        if grow.steps != 2 * steps + 1:
            problems.append(f"the resume at batch {2 * batch} did not train a step (checkpoint at step "
                            f"{grow.steps}, exit {grow.rc}): " + _explain(grow))
        else:
            got = grow.state["samples_seen"] - two.state["samples_seen"]
            if grow.state["epoch"] == two.state["epoch"] and got != 2 * batch:
                problems.append(f"at batch {2 * batch} one step trained {got} samples")
        return problems
    finally:
        shutil.rmtree(work, ignore_errors=True)


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--batch", type=int, default=8, show_default=True, help="Global batch of the first runs.")
@click.option("--steps", type=int, default=3, show_default=True, help="Steps before each stop.")
@click.option("--tolerance", "tol", type=float, default=1e-4, show_default=True,
              help="Largest weight difference accepted between the resumed and the uninterrupted run.")
@click.option("--timeout", "timeout_s", type=float, default=600.0, show_default=True, help="Seconds per run.")
@click.argument("script", type=click.Path(exists=True, dir_okay=False))
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def check(batch, steps, tol, timeout_s, script, args):
    """Pre-flight SCRIPT: stop, checkpoint and exact resume at 1 and 2 local processes (CPU, gloo)."""
    problems = check_script(script, tuple(args), batch=batch, steps=steps, tol=tol, timeout_s=timeout_s)
    if problems:
        for p in problems:
            click.echo(f"PROBLEM: {p}", err=True)
        raise SystemExit(1)
    click.echo(f"{script}: ready for the daemon (stop, checkpoint, exact resume at another world size and batch)")
