"""slurm_elastic.train: checkpointed, resizable PyTorch DDP inside a Slurm job (the ``train`` extra).

Importing this package does not import torch; the torch-based parts load on first use, so the daemon
can use :mod:`slurm_elastic.train.protocol` (the files a job leaves for it) without torch installed.
See docs/TRAINING.md.
"""

from __future__ import annotations

import importlib
import time
from typing import Any

from .protocol import EXIT_CHECKPOINTED, read_ack, read_done, read_throughput
from .signals import StopFlag, install_stop_handler

# When this process started using the library (before the slow torch import); a rendezvous file older
# than this is from an earlier attempt (see slurm_elastic.train.dist).
IMPORTED_AT = time.time()

_LAZY = {
    "ElasticJob": ".job",
    "Step": ".job",
    "MicroBatch": ".sampler",
    "ElasticBatchSampler": ".data",
    "ElasticIterableDataset": ".data",
    "StepPlan": ".sampler",
    "epoch_permutation": ".sampler",
    "plan_step": ".sampler",
    "save_checkpoint": ".checkpoint",
    "load_checkpoint": ".checkpoint",
    "CheckpointError": ".checkpoint",
    "init_distributed": ".dist",
    "RendezvousError": ".dist",
}

__all__ = [
    "EXIT_CHECKPOINTED",
    "StopFlag",
    "install_stop_handler",
    "read_ack",
    "read_done",
    "read_throughput",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value
