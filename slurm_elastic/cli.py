"""The ``slurm-elastic`` command: one click group; each subcommand lives in ``slurm_elastic/commands/``.

Subcommands are imported lazily so that ``slurm-elastic status`` on a controller does not pay for
numba or torch imports it does not need.
"""

from __future__ import annotations

import importlib
import importlib.util

import click

# name -> (module under slurm_elastic.commands, attribute, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "cluster": ("cluster", "cluster", "Run a local multi-node Slurm cluster with fake GPUs (demo and tests)."),
    "status": ("status", "status", "Show elastic jobs, squeue-style: GPUs, batch, decisions."),
    "solve": ("solve", "solve", "Solve one allocation problem from a JSON file."),
    "bench": ("bench", "bench", "Benchmarks (allocator speed and memory)."),
    "simulate": ("simulate", "simulate", "Replay a workload through the scheduler in simulated time."),
    "daemon": ("daemon", "daemon", "Run the elastic scheduling daemon against Slurm."),
    "plan": ("daemon", "plan", "Print what the daemon's next cycle would do, without doing it."),
    "launch": ("launch", "launch", "Start one start of an elastic job's tasks (in its batch script)."),
    "stop": ("stop", "stop", "Checkpoint a running elastic job now and end it (checkpoint kept)."),
    "doctor": ("doctor", "doctor", "Check slurm.conf and this machine for what the daemon needs, with the fixes."),
    "check": ("check", "check", "Pre-flight a training script: stop, checkpoint, exact resume at 1 and 2 processes."),
    "report": ("report", "report", "What the daemon decided, from its state DB, with a timeline PNG."),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted(name for name, (mod, _, _) in SUBCOMMANDS.items() if _module_exists(mod))

    def get_command(self, ctx, name):
        if name not in SUBCOMMANDS:
            return None
        mod, attr, _ = SUBCOMMANDS[name]
        if not _module_exists(mod):
            return None
        return getattr(importlib.import_module(f"slurm_elastic.commands.{mod}"), attr)

    def format_commands(self, ctx, formatter):
        rows = [(name, SUBCOMMANDS[name][2]) for name in self.list_commands(ctx)]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def _module_exists(mod: str) -> bool:
    return importlib.util.find_spec(f"slurm_elastic.commands.{mod}") is not None


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="slurm-elastic")
def main():
    """Elastic GPU scheduling for Slurm: GPU count and batch size chosen together."""


if __name__ == "__main__":
    main()
