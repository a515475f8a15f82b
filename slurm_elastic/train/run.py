"""``python -m slurm_elastic.train.run train.py ARGS``: run a training script with the stop handler
already installed (what ``slurm-elastic launch`` starts under ``srun``).

Why: the daemon's USR2 may reach a task while its script is still importing torch (seconds); with
the handler in place before the script starts, that request is kept instead of killing the task, and
the script itself needs no ``install_stop_handler()`` line. Torch-free until the script imports it.
``--torchrun``: run torchrun (standalone) as the agent of a single-node start instead (see launch).
"""

from __future__ import annotations

import os
import runpy
import sys

from slurm_elastic.train.signals import install_stop_handler


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--torchrun"]:
        # ``--torchrun [torchrun options] SCRIPT.py ARGS``: this process becomes a standalone torchrun
        # agent that ignores USR2 (Slurm signals every process of the step; the agent's default
        # action would end the step); the workers inherit the ignore and install the stop handler.
        import signal

        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        from torch.distributed.run import main as torchrun_main

        rest = argv[1:]
        i = next((k for k, x in enumerate(rest) if x.endswith(".py")), len(rest))
        # "--" before the script: torchrun's parser would read a script option like --n as an
        # abbreviation of its own (--nnodes, --nproc-per-node, ...).
        torchrun_main(["--standalone", *rest[:i], "--", *rest[i:]])
        return
    if not argv or not argv[0].endswith(".py"):
        raise SystemExit("usage: python -m slurm_elastic.train.run SCRIPT.py [ARGS...]")
    install_stop_handler()
    sys.argv = argv
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as ``python SCRIPT.py`` would have it
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
