"""``ElasticJob``: the in-job side of slurm-elastic for a PyTorch DDP training script.

A script that uses it can be stopped at any step, requeued with another GPU count and global batch,
and resumes exactly where it stopped::

    from slurm_elastic.train import install_stop_handler
    install_stop_handler()                       # first, before the slow torch import
    import torch
    from slurm_elastic.train import ElasticJob

    job = ElasticJob(ckpt_dir, seed=0, lr_scaling="linear")
    job.setup()                                  # process group, this start's batch assignment
    torch.manual_seed(0); model = Net()
    ddp = job.wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    job.register(model=model, optimizer=opt)
    job.restore()                                # no-op on the first start
    for step in job.steps(dataset_size=len(X), epochs=5):
        for mb in step.micro_batches():          # no_sync on all but the last
            out = ddp(X[mb.indices])
            loss = F.cross_entropy(out, Y[mb.indices], reduction="sum") * mb.scale
            loss.backward()
        step.optimizer_step()                    # lr scaling, optimizer (+AMP scaler), zero_grad
    job.finish()

What happens at a stop request (USR2 or the stop-request file, see :mod:`.protocol`): at the next step
boundary every rank learns it through an all-reduce (MAX) of the flag, so all ranks stop after the
same step; rank 0 writes the checkpoint, then the acknowledgement ``stop-ack.<job>.<restart>.json``;
after a barrier every rank exits with :data:`~.protocol.EXIT_CHECKPOINTED` (75).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import oom, protocol
from .assignment import Assignment, AssignmentError, resolve_assignment
from .checkpoint import clean_stale_tmp, load_checkpoint, save_checkpoint
from .dist import DistContext, init_distributed, leave_process_group
from .lock import acquire_rank0_lock, release_rank0_lock
from .lr import LRScaler
from .noise import GradientNoise
from .pacing import Pacer, make_pacer
from .sampler import MicroBatch, StepPlan, epoch_permutation, plan_step
from .schedule import SampleSchedule
from .signals import install_stop_handler
from .slurm_env import JobRecordText, SlurmEnv, read_job_record

CHECKPOINT_FORMAT = 1
_ASSIGN_KEY = "slurm_elastic/assignment"
_CKPT_KEY = "slurm_elastic/checkpoint"


class Step:
    """One global optimizer step of this rank: iterate :meth:`micro_batches`, then :meth:`optimizer_step`."""

    def __init__(self, job: ElasticJob, plan: StepPlan):
        self._job = job
        self.plan = plan
        self.done = False

    @property
    def epoch(self) -> int:
        return self.plan.epoch

    @property
    def offset(self) -> int:
        return self.plan.offset

    @property
    def count(self) -> int:
        """Samples in this global step (over all ranks)."""
        return self.plan.count

    @property
    def indices(self) -> torch.Tensor:
        """This rank's sample indices of the step (without any weight-0 placeholder)."""
        return self.plan.rank_indices

    def micro_batches(self) -> Iterator[MicroBatch]:
        """Yield the micro-batches; gradient sync (DDP) is suppressed on all but the last."""
        mbs = self.plan.micro_batches
        ddp = self._job.ddp
        noise = self._job.noise
        if noise is not None:
            noise.active = self._job.optimizer_steps % self._job.noise_every == 0
            if not noise.active:
                noise = None
        for i, mb in enumerate(mbs):
            last = i == len(mbs) - 1
            ctx = ddp.no_sync() if (ddp is not None and not last) else contextlib.nullcontext()
            if noise is not None:
                noise.begin_micro()
            with ctx:
                yield mb
            if noise is not None:
                noise.end_micro(len(mb), mb.scale, self._job._loss_scale())

    def optimizer_step(self, *, zero_grad: bool = True) -> None:
        self._job._optimizer_step(self.plan.count)
        if zero_grad:
            self._job.optimizer.zero_grad(set_to_none=True)
        self.done = True


class ElasticJob:
    def __init__(
        self,
        ckpt_dir: str | os.PathLike | None = None,
        *,
        seed: int = 0,
        default_batch: int | None = None,
        max_local_batch: int | None = None,
        lr_scaling: str = "none",
        base_batch: int | None = None,
        warmup_samples: int | None = None,
        lr_schedule: Callable[[int], float] | None = None,
        checkpoint_every_steps: int | None = None,
        checkpoint_every_s: float | None = None,
        throughput_warmup_steps: int = 3,
        noise_scale: bool = True,
        noise_smoothing: float = 0.99,
        noise_every: int = 1,
        report_every_s: float = 30.0,
        timeout_s: float = 300.0,
        stop_signals: tuple[str, ...] = ("USR2",),
        env: Mapping[str, str] | None = None,
        job_record: JobRecordText | None = None,
        checkpoint_progress: Callable[[int], None] | None = None,
        clip_grad_norm: float | None = None,
        lock_wait_s: float = 10.0,
        verbose: bool = True,
        total_samples: int | None = None,
        resume: str = "auto",
    ):
        self.env = dict(os.environ if env is None else env)
        ckpt_dir = ckpt_dir or self.env.get("ELASTIC_CKPT_DIR")
        if not ckpt_dir and not self.env.get("SLURM_JOB_ID"):
            ckpt_dir = "elastic-ckpt"  # a laptop or torchrun run: running the same command again continues
        if not ckpt_dir:
            raise ValueError("give a checkpoint directory (argument or ELASTIC_CKPT_DIR)")
        self.ckpt_dir = Path(ckpt_dir)
        # "must": continuing a run, so a missing checkpoint directory or checkpoint is an error (a typo
        # would otherwise start from scratch without a word); "auto": resume when there is one.
        resume = self.env.get("ELASTIC_RESUME") or resume
        if resume not in ("auto", "must"):
            raise ValueError(f"resume must be 'auto' or 'must', not {resume!r}")
        self.resume = resume
        if resume == "must" and not self.ckpt_dir.is_dir():
            raise FileNotFoundError(f"resume='must' but the checkpoint directory {self.ckpt_dir} does not exist "
                                    "(check the path; resume='auto' starts from scratch)")
        self._total_samples_arg = None if total_samples is None else int(total_samples)
        self.seed = int(seed)
        # `slurm-elastic check` runs the script at other batches and stops it at a given step.
        self.default_batch = int(self.env["ELASTIC_BATCH"]) if self.env.get("ELASTIC_BATCH") else default_batch
        self._stop_at_step = int(self.env["ELASTIC_STOP_AT_STEP"]) if self.env.get("ELASTIC_STOP_AT_STEP") else None
        self.max_local_batch = max_local_batch
        self.lr_scaling = lr_scaling
        self.base_batch = base_batch
        self.warmup_samples = warmup_samples
        self.lr_schedule = lr_schedule
        self.checkpoint_every_steps = checkpoint_every_steps
        self.checkpoint_every_s = checkpoint_every_s
        self.throughput_warmup_steps = max(0, int(throughput_warmup_steps))
        # The gradient noise scale (see .noise): hooks on the model's parameters, one 3-scalar
        # all-reduce per step; reported with the throughput so the daemon knows efficiency(batch).
        self.noise: GradientNoise | None = GradientNoise(1, noise_smoothing) if noise_scale else None
        self.noise_every = max(1, int(noise_every))
        self.report_every_s = float(report_every_s)
        self._last_report = time.time()
        self._stop_time: float | None = None  # when the previous start agreed to stop (from its checkpoint)
        self._first_step_time: float | None = None
        self.timeout_s = float(timeout_s)
        self.job_record = job_record
        self.checkpoint_progress = checkpoint_progress
        self.clip_grad_norm = clip_grad_norm
        self.verbose = verbose
        from . import IMPORTED_AT

        self._started_at = IMPORTED_AT
        self.senv = SlurmEnv.from_environ(self.env)
        if self.senv.job_id is None:
            # Not under Slurm (a laptop, torchrun): Ctrl-C and SIGTERM are stop requests too, so the
            # work since the last checkpoint is kept; a second Ctrl-C aborts.
            stop_signals = (*stop_signals, "INT", "TERM")
        self.flag = install_stop_handler(stop_signals)
        if self.senv.job_id is not None:
            self.flag.watch_file(protocol.stop_request_path(self.ckpt_dir, self.senv.job_id, self.senv.restart_count))
        self.ctx: DistContext | None = None
        self.assignment: Assignment | None = None
        self.model: torch.nn.Module | None = None
        self.ddp: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: Any = None
        self.schedule: SampleSchedule | None = None  # the registered scheduler, counted in samples
        self.schedule_every = "step"  # or "epoch" (a Lightning scheduler with interval="epoch")
        self.schedule_frequency = 1  # scheduler steps every N optimizer steps (Lightning's frequency)
        self._base_lrs: list[float] | None = None  # the lr of each param group at the LR base batch
        self._applied_lrs: list[float] | None = None  # what the library last set
        self.scaler: Any = None
        self.user_objects: dict[str, Any] = {}
        self.extra: dict[str, Any] = {}  # plain user data saved in the checkpoint (weights_only-safe values)
        # Progress (the sampler state) and bookkeeping.
        self.epoch = 0
        self.offset = 0
        self.samples_seen = 0
        self.optimizer_steps = 0
        self.dataset_size: int | None = None
        self.planned_epochs: int | None = None  # the epochs the loop was asked for (progress reports)
        self.micro_tag = None  # the DataLoader path's current micro-batch (data.MicroTag: epoch, samples, ...)
        self.history: list[dict] = []
        self.lr: LRScaler | None = None
        self.restored_from: Path | None = None
        self._start_index = 0
        self._tp_steps = 0
        self._tp_samples = 0
        self._tp_seconds = 0.0
        self._tp_flushed = (0, 0, 0.0)
        self._steps_this_start = 0
        self._last_ckpt_time = time.time()
        self._lr_state: dict | None = None
        self._requested_batch: int | None = None
        self._lock_fd: int | None = None
        self.lock_wait_s = lock_wait_s
        self.pacer: Pacer | None = None  # emulated GPUs: the spec's pace= (see .pacing)
        self.min_local_batch: int | None = None  # the spec's, for .oom: no smaller batch to learn below it

    @classmethod
    def create(cls, ckpt_dir: str | os.PathLike | None = None, **kwargs) -> ElasticJob:
        """``ElasticJob(...)`` and :meth:`setup` in one call (process group, this start's batch).

        Outside Slurm and without ``ELASTIC_CKPT_DIR`` the checkpoint directory is ``./elastic-ckpt``
        (a laptop or torchrun run; running the same command again continues from it)."""
        env = kwargs.get("env")
        env = os.environ if env is None else env
        if ckpt_dir is None and not env.get("ELASTIC_CKPT_DIR") and not env.get("SLURM_JOB_ID"):
            ckpt_dir = "elastic-ckpt"
        job = cls(ckpt_dir, **kwargs)
        job.setup()
        return job

    # ---------------------------------------------------------------- setup
    @property
    def rank(self) -> int:
        return self.senv.rank

    @property
    def world_size(self) -> int:
        return self.senv.world_size

    @property
    def device(self) -> torch.device:
        return self.ctx.device if self.ctx else torch.device("cpu")

    def log(self, msg: str, *, all_ranks: bool = False) -> None:
        if self.verbose and (all_ranks or self.rank == 0):
            job = self.senv.job_id or "local"
            print(f"slurm-elastic[job {job} restart {self.senv.restart_count} rank {self.rank}]: {msg}", flush=True)

    def setup(self) -> Assignment:
        """Init the process group, then agree on this start's batch assignment (read by rank 0)."""
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        if self.rank == 0 and self._lock_fd is None:
            self._lock_fd = acquire_rank0_lock(self.ckpt_dir, wait_s=self.lock_wait_s,
                                               what=f"{self.senv.job_id or 'local'} via {self.senv.launcher}")
        self.ctx = init_distributed(self.senv, rdzv_dir=self.ckpt_dir / "rendezvous", timeout_s=self.timeout_s,
                                    env=self.env, started_at=self._started_at)
        store = self.ctx.store
        if self.rank == 0:
            try:
                a = self._resolve_assignment()
                payload = {"ok": True, **{k: getattr(a, k) for k in
                                          ("global_batch", "local_batch", "accum", "source", "seq")},
                           "requested_batch": a.spec.requested_batch if a.spec is not None else None,
                           "resume": getattr(a.spec, "resume", None) if a.spec is not None else None,
                           "pace": a.spec.pace if a.spec is not None else None,
                           "min_local_batch": a.spec.min_local_batch if a.spec is not None else None}
            except Exception as e:
                store.set(_ASSIGN_KEY, json.dumps({"ok": False, "error": str(e)}))
                raise
            store.set(_ASSIGN_KEY, json.dumps(payload))
            self.assignment = a
            self._requested_batch = payload["requested_batch"]
            pace = payload["pace"]
        else:
            info = json.loads(store.get(_ASSIGN_KEY).decode())
            if not info["ok"]:
                raise RuntimeError(f"rank 0 could not choose the batch: {info['error']}")
            self.assignment = Assignment(info["global_batch"], info["local_batch"], info["accum"], self.world_size,
                                         info["source"], info["seq"], None)
            self._requested_batch = info["requested_batch"]
            pace = info.get("pace")
        self.min_local_batch = (payload if self.rank == 0 else info).get("min_local_batch")
        if (payload if self.rank == 0 else info).get("resume") == "must":
            self.resume = "must"  # the spec's resume=must (the resubmit line `slurm-elastic stop` prints)
        a = self.assignment
        try:
            self.pacer, why = make_pacer(pace, gpus=self.world_size, nodes=max(1, self.senv.num_nodes or 1),
                                         local_batch=a.local_batch, accum=a.accum, device_type=self.device.type)
        except KeyError as e:
            raise AssignmentError(str(e.args[0]), job_id=self.senv.job_id, field="pace") from None
        if why:
            self.log(why)
        self.log(f"world size {self.world_size} on {self.senv.num_nodes} node(s), backend {self.ctx.backend}, "
                 f"master {self.ctx.master_addr}:{self.ctx.master_port}; global batch {a.global_batch} = "
                 f"{self.world_size} x {a.local_batch} x {a.accum} accum (from {a.source})")
        return a

    def _resolve_assignment(self) -> Assignment:
        rec = self.job_record
        if rec is None and self.senv.job_id is not None:
            rec = read_job_record(self.senv.job_id, env=self.env)
        return resolve_assignment(
            job_id=self.senv.job_id,
            world_size=self.world_size,
            num_nodes=self.senv.num_nodes if self.senv.job_id is not None else None,
            comment=rec.comment if rec else None,
            admin_comment=rec.admin_comment if rec else None,
            default_batch=self.default_batch,
            max_local_batch=self.max_local_batch,
        )

    def wrap(self, model: torch.nn.Module, **ddp_kwargs) -> torch.nn.Module:
        """Move ``model`` to this rank's device and wrap it in DistributedDataParallel."""
        if self.ctx is None:
            raise RuntimeError("call setup() first")
        model.to(self.device)
        self.model = model
        ids = [self.device.index] if self.device.type == "cuda" else None
        self.ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, **ddp_kwargs)
        if self.noise is not None:
            self.noise.attach(model)
        return self.ddp

    def register(self, *, model: torch.nn.Module | None = None, optimizer=None, scheduler=None, scaler=None,
                 **user_objects) -> None:
        """Objects whose state goes into the checkpoint; user objects need state_dict/load_state_dict."""
        if model is not None:
            self.model = model.module if hasattr(model, "module") and isinstance(
                model, torch.nn.parallel.DistributedDataParallel) else model
        if optimizer is not None:
            self.optimizer = optimizer
        if scheduler is not None:
            self.schedule = SampleSchedule(scheduler)  # refuses one it cannot count in samples
            self.scheduler = scheduler
        if scaler is not None:
            self.scaler = scaler
        for name, obj in user_objects.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"user object {name!r} needs state_dict() and load_state_dict()")
            self.user_objects[name] = obj

    # ---------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        if self.model is None or self.optimizer is None:
            raise RuntimeError("register(model=..., optimizer=...) before checkpointing")
        self._update_history()
        return {
            "format": CHECKPOINT_FORMAT,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": None,  # counted in samples (schedule.py): its position is samples_seen
            "base_lrs": list(self._base_lrs) if self._base_lrs is not None else None,
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "epoch": self.epoch,
            "offset": self.offset,
            "samples_seen": self.samples_seen,
            "optimizer_steps": self.optimizer_steps,
            "dataset_size": self.dataset_size,
            "seed": self.seed,
            "lr": self.lr.state_dict() if self.lr else None,
            "noise": self.noise.state_dict() if self.noise is not None else None,
            "history": [dict(h) for h in self.history],
            "user": {k: v.state_dict() for k, v in self.user_objects.items()},
            "extra": dict(self.extra),
            "job": {"job_id": self.senv.job_id, "restart_count": self.senv.restart_count,
                    "world_size": self.world_size, "time": time.time()},
        }

    def restore(self) -> bool:
        """Load the newest readable checkpoint into the registered objects; False if there is none."""
        if self.ctx is None:
            raise RuntimeError("call setup() first")
        store = self.ctx.store
        key = _CKPT_KEY
        if self.rank == 0:
            clean_stale_tmp(self.ckpt_dir)
            found = load_checkpoint(self.ckpt_dir)
            store.set(key, "" if found is None else str(found[1]))
        else:
            p = store.get(key).decode()
            found = load_checkpoint(self.ckpt_dir, path=p) if p else None
        # The lr each param group is written for (the scheduler's base lrs, else the script's lr), taken
        # before the checkpoint's optimizer state overwrites it with the lr last applied.
        self._applied_lrs = None  # the checkpoint's optimizer state brings the lr it last applied
        if self.schedule is not None:
            self._base_lrs = list(self.schedule.base_lrs)
            self.schedule.neutralize(self._current_lrs)
        else:
            self._base_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        if found is None:
            if self.resume == "must":
                raise FileNotFoundError(f"resume='must' but there is no checkpoint in {self.ckpt_dir}")
            self._begin_start()
            return False
        state, path = found
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None and state.get("scaler") is not None:
            self.scaler.load_state_dict(state["scaler"])
        for name, obj in self.user_objects.items():
            if name in state.get("user", {}):
                obj.load_state_dict(state["user"][name])
        if state.get("seed") != self.seed:
            raise RuntimeError(f"the checkpoint was trained with seed {state.get('seed')}, this run has {self.seed}")
        self.epoch, self.offset = int(state["epoch"]), int(state["offset"])
        self.samples_seen, self.optimizer_steps = int(state["samples_seen"]), int(state["optimizer_steps"])
        self.dataset_size = state.get("dataset_size")
        self.history = [dict(h) for h in state.get("history", [])]
        self.extra = dict(state.get("extra", {}))
        self._lr_state = state.get("lr")
        if self.noise is not None:
            self.noise.load_state_dict(state.get("noise"))
        if self.history:
            self._stop_time = self.history[-1].get("stop_time")
        self.restored_from = Path(path)
        # Every rank loaded the same file, so the DDP replicas agree without a broadcast.
        self._begin_start()
        self.log(f"resumed from {path.name}: epoch {self.epoch}, offset {self.offset}, "
                 f"{self.samples_seen} samples seen, {self.optimizer_steps} steps")
        return True

    def _begin_start(self) -> None:
        a = self.assignment
        # The lr in the user's optimizer is meant for base_batch: by default the spec's requested batch
        # (the same on every rank: rank 0 shared it with the assignment), else this start's batch.
        # The checkpoint's base wins over the spec's batch: changing batch= on a resubmit must not move
        # the lr base under a running schedule (pass base_batch= to change it on purpose).
        prev = self._lr_state
        kept = int(prev["base_batch"]) if prev and prev.get("base_batch") else None
        base = self.base_batch or kept or self._requested_batch or a.global_batch
        if kept and not self.base_batch and self._requested_batch and self._requested_batch != kept:
            self.log(f"the lr base stays at the checkpoint's batch {kept} (the spec now asks batch "
                     f"{self._requested_batch}); pass base_batch= to change it")
        warm = self.warmup_samples
        if warm is None:
            warm = 20 * a.global_batch if self.lr_scaling == "linear" else 0
        self.lr = LRScaler(self.lr_scaling, int(base), int(warm))
        if self.noise is not None:
            self.noise.base_batch = int(base)
            self.lr.noise_scale = self.noise.noise_scale
        if prev:
            self.lr.load_state_dict(prev)
        self.lr.set_batch(a.global_batch, self.samples_seen)
        self.apply_lr()
        # From here on (the checkpoint loaded, training next) an out-of-memory error is reported as this
        # start's batch limit; one while loading the checkpoint is not the batch's doing.
        oom.register(self)
        self._start_index = len(self.history)
        self.history.append({"restart_count": self.senv.restart_count, "job_id": self.senv.job_id,
                             "world_size": self.world_size, "global_batch": a.global_batch,
                             "local_batch": a.local_batch, "accum": a.accum, "source": a.source,
                             "decision_seq": a.seq,
                             "start_samples": self.samples_seen, "samples_per_s": None, "steps": 0,
                             "time": time.time()})

    def checkpoint(self) -> Path | None:
        """Write a checkpoint now (rank 0 writes; all ranks must call this at the same step)."""
        path = None
        if self.rank == 0:
            t0 = time.time()
            path = save_checkpoint(self.ckpt_dir, self.state_dict(), on_progress=self.checkpoint_progress)
            self._flush_throughput()
            self.log(f"checkpoint {path.name} written in {time.time() - t0:.2f} s at epoch {self.epoch}, "
                     f"offset {self.offset} ({self.samples_seen} samples seen)")
        self._last_ckpt_time = time.time()
        dist.barrier()
        return path

    # ---------------------------------------------------------------- training loop
    def steps(self, dataset_size: int, epochs: int) -> Iterator[Step]:
        """Global steps from the resumed position to the end of ``epochs``; handles stop and checkpoints."""
        if self.assignment is None or self.lr is None:
            raise RuntimeError("call setup() and restore() before steps()")
        if self.dataset_size is not None and self.dataset_size != dataset_size:
            raise RuntimeError(f"the checkpoint is for a dataset of {self.dataset_size} samples, not {dataset_size}")
        self.dataset_size = int(dataset_size)
        self.planned_epochs = int(epochs)
        a = self.assignment
        flag_t = torch.zeros(2, dtype=torch.int32, device=self.device if self.ctx.backend == "nccl" else "cpu")
        while self.epoch < epochs:
            perm = epoch_permutation(dataset_size, self.seed, self.epoch)
            while self.offset < dataset_size:
                t0 = time.perf_counter()
                stop, due = self._agree(flag_t)
                if stop:
                    self._stop_and_exit()
                if due:
                    self.checkpoint()
                    t0 = time.perf_counter()
                plan = plan_step(perm, self.epoch, self.offset, a.global_batch, self.rank, self.world_size,
                                 a.local_batch, a.accum)
                step = Step(self, plan)
                yield step
                if not step.done:
                    raise RuntimeError("call step.optimizer_step() inside the loop body")
                self.offset += plan.count
                self._count_step(plan.count, time.perf_counter() - t0)
            self.epoch += 1
            self.offset = 0

    def batch_sampler(self, dataset_size: int, epochs: int, *, shuffle: bool = True):
        """A ``batch_sampler`` for a map-style ``DataLoader``; iterate the loader with :meth:`batches`."""
        from .data import ElasticBatchSampler

        self.planned_epochs = int(epochs)
        return ElasticBatchSampler(self, dataset_size, epochs, shuffle=shuffle)

    def iterable(self, stream, epochs: int, *, size: int | None = None, collate_fn=None):
        """Wrap an iterable dataset for ``DataLoader(..., batch_size=None)``; iterate with :meth:`batches`."""
        from .data import ElasticIterableDataset

        self.planned_epochs = int(epochs)
        return ElasticIterableDataset(self, stream, epochs, size=size, collate_fn=collate_fn)

    def batches(self, loader) -> Iterator:
        """The loader's micro-batches, with mean-loss gradient scaling, accumulation and stop handling
        done by the library: the loop body is ``loss = criterion(ddp(x), y); loss.backward();
        opt.step(); opt.zero_grad()`` (see :mod:`.data`)."""
        from .data import elastic_batches

        return elastic_batches(self, loader)

    def prepare(self, model: torch.nn.Module, optimizer, *, scheduler=None, scaler=None,
                **ddp_kwargs) -> torch.nn.Module:
        """:meth:`wrap`, :meth:`register` and :meth:`restore` in one call; returns the DDP model.

        After it the model and optimizer hold the checkpoint's state (if any) and the job its position;
        iterate :meth:`loader` inside :meth:`epochs`. An AMP ``scaler`` registered here is stepped and
        updated by the library once per global step (see docs/ELASTIC-SCRIPT.md)."""
        ddp = self.wrap(model, **ddp_kwargs)
        self.register(model=model, optimizer=optimizer, scheduler=scheduler, scaler=scaler)
        self.restore()
        return ddp

    def loader(self, dataset, *, shuffle: bool = True, size: int | None = None, **loader_kwargs):
        """An epoch loader over ``dataset`` (map-style or iterable; any ``DataLoader`` keyword except the
        batch and sampler ones): each ``iter()`` gives this rank's micro-batches of the rest of the
        current epoch, with mean-loss gradient scaling, accumulation and stop handling (see .data)."""
        from .data import EpochLoader

        return EpochLoader(self, dataset, shuffle=shuffle, size=size, **loader_kwargs)

    def epochs(self, epochs: int) -> Iterator[int]:
        """The data epochs still to train, from the resumed one to ``epochs - 1``; iterate the
        :meth:`loader` once inside each. A stop request exits with 75 from inside the loader."""
        if self.assignment is None or self.lr is None:
            raise RuntimeError("call prepare() (or setup() and restore()) before epochs()")
        self.planned_epochs = int(epochs)
        while self.epoch < epochs:
            e = self.epoch
            yield e
            if self.epoch == e:
                raise RuntimeError(f"epoch {e} did not advance: iterate the job's loader once per epoch")

    def _agree(self, flag_t: torch.Tensor) -> tuple[bool, bool]:
        due = False
        if self.rank == 0:
            if self.checkpoint_every_steps and self._steps_this_start and \
                    self.optimizer_steps % self.checkpoint_every_steps == 0:
                due = True
            if self.checkpoint_every_s and time.time() - self._last_ckpt_time >= self.checkpoint_every_s:
                due = True
        flag_t[0] = 1 if self.flag.is_set() else 0
        flag_t[1] = 1 if due else 0
        dist.all_reduce(flag_t, op=dist.ReduceOp.MAX)
        return bool(flag_t[0].item()), bool(flag_t[1].item())

    def _loss_scale(self) -> float:
        return float(self.scaler.get_scale()) if self.scaler is not None and self.scaler.is_enabled() else 1.0

    def _optimizer_step(self, count: int | None = None, step_fn: Callable[[], Any] | None = None) -> None:
        """The real optimizer step: the noise-scale measurement (on the unclipped gradient; ``count`` None
        discards this step's), gradient clipping on the whole step's gradient, lr factor, step."""
        opt = self.optimizer
        if self.noise is not None:
            if count is None or not self.noise.active:
                self.noise.discard()
            else:
                params = [p for g in opt.param_groups for p in g["params"]]
                self.noise.step(params, self.assignment.global_batch, count, self.device, self._loss_scale())
                self.lr.noise_scale = self.noise.noise_scale
        if self.clip_grad_norm is not None:
            if self.scaler is not None:
                self.scaler.unscale_(opt)
            params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
            torch.nn.utils.clip_grad_norm_(params, self.clip_grad_norm)
        self.lr_for_step()
        if step_fn is not None:
            step_fn()
        elif self.scaler is not None:
            self.scaler.step(opt)
            self.scaler.update()
        else:
            opt.step()

    # ---------------------------------------------------------------- lr
    def _schedule_step(self) -> float:
        """The registered scheduler's step, from progress: a step is ``base_batch`` samples (x its
        frequency), so the schedule ends where it would have at the submitted batch."""
        if self.schedule_every == "epoch":
            return float(self.epoch)
        return self.samples_seen / (self.lr.base_batch * self.schedule_frequency)

    def lr_factors(self) -> list[float]:
        """Per param group: the lr the next step applies over the group's base lr (the batch-size
        rule x ``lr_schedule(samples)`` x the registered scheduler's factor)."""
        f = self.lr.factor(self.samples_seen) if self.lr else 1.0
        if self.lr_schedule is not None:
            f *= float(self.lr_schedule(self.samples_seen))
        n = len(self.optimizer.param_groups) if self.optimizer is not None else 1
        if self.schedule is None or self.lr is None:
            return [f] * n
        return [f * x for x in self.schedule.factors(self._schedule_step())]

    @property
    def lr_factor(self) -> float:
        """The factor of the first param group (the lr applied / the lr written for the base batch)."""
        return self.lr_factors()[0]

    def _current_lrs(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def apply_lr(self) -> None:
        """Set every param group's lr to the one the next step applies; it stays there between steps,
        so loggers and ``get_last_lr()`` read the lr actually used."""
        if self.optimizer is None or self._base_lrs is None:
            return
        self._check_lr_unchanged()
        groups = self.optimizer.param_groups
        if len(groups) != len(self._base_lrs):
            raise RuntimeError(f"the optimizer has {len(groups)} param groups, it had {len(self._base_lrs)} at "
                               "restore(): add param groups before registering the optimizer")
        lrs = [b * f for b, f in zip(self._base_lrs, self.lr_factors(), strict=True)]
        for g, lr in zip(groups, lrs, strict=True):
            if isinstance(g["lr"], torch.Tensor):
                g["lr"].fill_(lr)
            else:
                g["lr"] = lr
        self._applied_lrs = lrs
        if self.schedule is not None:
            self.schedule.scheduler._last_lr = list(lrs)

    def lr_for_step(self) -> None:
        """Before each optimizer step (every path): this step's lr (the noise scale may have moved it)."""
        self.apply_lr()

    def _check_lr_unchanged(self) -> None:
        """Refuse an lr changed behind the library's back: an unregistered scheduler stepping per optimizer
        step would silently end early or late at a batch change."""
        if self._applied_lrs is not None:
            for i, (g, want) in enumerate(zip(self.optimizer.param_groups, self._applied_lrs, strict=False)):
                have = float(g["lr"])
                if abs(have - want) > 1e-9 * max(abs(want), 1e-12):
                    raise RuntimeError(
                        f"the lr of param group {i} changed outside slurm-elastic between steps ({want:.6g} -> "
                        f"{have:.6g}): an lr scheduler stepping per optimizer step would end early or late once "
                        "the batch changes. Register it (job.prepare(..., scheduler=sched) / "
                        "job.register(scheduler=sched)) so that it is counted in samples, or use lr_schedule=")

    # ---------------------------------------------------------------- throughput, stop, finish
    def throughput(self) -> float | None:
        """Samples/s of this start so far, warm-up steps dropped (None before any measured step)."""
        return self._tp_samples / self._tp_seconds if self._tp_seconds > 0 else None

    def _update_history(self) -> None:
        if self.history:
            h = self.history[-1]
            h["samples_per_s"] = self.throughput()
            h["steps"] = self._steps_this_start
            h["measured_steps"] = self._tp_steps

    def _count_step(self, count: int, seconds: float) -> None:
        """One optimizer step of ``count`` samples done, on every path (``steps()``, the DataLoader path,
        the framework integrations): counters, throughput after warm-up, and rank 0's report (the
        daemon plans nothing for a start before its first-step record, so every path must write it).
        A paced job (emulated GPUs) first sleeps the rest of the profile's step time, on every rank."""
        if self.pacer is not None:
            seconds = self.pacer.wait(seconds)
        self.samples_seen += count
        self.optimizer_steps += 1
        self._steps_this_start += 1
        self.apply_lr()
        if self._stop_at_step is not None and self.optimizer_steps >= self._stop_at_step:
            self.flag.request("ELASTIC_STOP_AT_STEP")  # taken at the next step boundary, as a USR2 would be
        if self._steps_this_start > self.throughput_warmup_steps:
            self._tp_steps += 1
            self._tp_samples += count
            self._tp_seconds += seconds
        if self.rank == 0:
            self._maybe_report()

    def _maybe_report(self) -> None:
        """Rank 0: write the report after this start's first step (its restart-cost record), once the
        first measured steps are in, and every ``report_every_s`` after that."""
        now = time.time()
        if self._steps_this_start == 1:
            self._first_step_time = now
            self._flush_throughput()
        elif self._tp_steps == 5 or now - self._last_report >= self.report_every_s:
            self._flush_throughput()

    @property
    def total_samples(self) -> int | None:
        """The samples the whole run trains on (dataset size x epochs, or ``total_samples=`` where the
        loader has no length), reported with the samples seen so far, so the daemon can rank jobs by the
        work they have left."""
        if self._total_samples_arg is not None:
            return self._total_samples_arg
        if self.dataset_size is None or self.planned_epochs is None:
            return None
        return int(self.dataset_size) * int(self.planned_epochs)

    def _flush_throughput(self) -> None:
        steps, samples, secs = self._tp_steps, self._tp_samples, self._tp_seconds
        fs, fn, ft = self._tp_flushed
        self._last_report = time.time()
        start = None
        if self._first_step_time is not None and self.senv.job_id is not None:
            start = {"restart_count": self.senv.restart_count, "first_step": self._first_step_time,
                     "stop": self._stop_time, "world_size": self.world_size,
                     "global_batch": self.assignment.global_batch}
        ns = self.noise.noise_scale if self.noise is not None else None
        if steps > fs or ns is not None or start is not None:
            p = protocol.merge_throughput(self.ckpt_dir, self.senv.job_id, self.world_size,
                                          self.assignment.global_batch, samples - fn, secs - ft, steps - fs,
                                          noise_scale=ns, base_batch=self.lr.base_batch if self.lr else None,
                                          start=start, samples_seen=self.samples_seen,
                                          total_samples=self.total_samples)
            self._tp_flushed = (steps, samples, secs)
            if p:
                self.log(f"throughput at {self.world_size} x batch {self.assignment.global_batch}: "
                         f"{p['samples_per_s']:.1f} samples/s over {p['steps']} steps")

    def _stop_and_exit(self) -> None:
        self.log(f"stop requested; all ranks stop after step {self.optimizer_steps}")
        if self.pacer is not None:
            self.log(self.pacer.summary())
        if self.history:
            self.history[-1]["stop_time"] = time.time()
        path = self.checkpoint()
        if self.rank == 0:
            ack = {"format": protocol.FORMAT, "job_id": self.senv.job_id, "restart_count": self.senv.restart_count,
                   "step_id": self.senv.step_id, "checkpoint": str(path), "epoch": self.epoch,
                   "offset": self.offset, "samples_seen": self.samples_seen,
                   "optimizer_steps": self.optimizer_steps, "world_size": self.world_size,
                   "global_batch": self.assignment.global_batch, "time": time.time(),
                   "exit_code": protocol.EXIT_CHECKPOINTED}
            if self.senv.job_id is not None:
                # Before the ack: the daemon requeues the job as soon as it reads it, which can end the
                # batch shell (and `launch`) before they print anything.
                self.log("checkpointed for a stop: if the daemon resizes the job it requeues it now, and Slurm "
                         "then logs 'CANCELLED ... DUE TO JOB REQUEUE' and 'srun: error: ... Terminated': those "
                         "lines are the resize, not a failure")
                protocol.atomic_write_json(
                    protocol.ack_path(self.ckpt_dir, self.senv.job_id, self.senv.restart_count), ack)
                self.log(f"checkpoint-safe: {path}; exiting with {protocol.EXIT_CHECKPOINTED}")
            else:
                self.log(f"checkpoint-safe: {path}; exiting with {protocol.EXIT_CHECKPOINTED}. Run the same "
                         "command again (same checkpoint directory) to continue from here")
        dist.barrier()
        self._teardown()
        sys.stdout.flush()
        raise SystemExit(protocol.EXIT_CHECKPOINTED)

    def finish(self) -> Path | None:
        """After the last step: final checkpoint, ``done.<job>.json``, process group torn down."""
        path = self.checkpoint()
        if self.rank == 0:
            protocol.atomic_write_json(protocol.done_path(self.ckpt_dir, self.senv.job_id or "local"), {
                "format": protocol.FORMAT, "job_id": self.senv.job_id, "restart_count": self.senv.restart_count,
                "epochs_done": self.epoch, "samples_seen": self.samples_seen,
                "optimizer_steps": self.optimizer_steps, "checkpoint": str(path), "time": time.time()})
            self.log(f"finished: {self.epoch} epochs, {self.samples_seen} samples, {self.optimizer_steps} steps")
            if self.pacer is not None:
                self.log(self.pacer.summary())
        self._teardown()
        return path

    def _teardown(self) -> None:
        # From here on a stop request changes nothing; ignore it so it cannot kill the exiting task.
        self.flag.quiesce()
        oom.unregister(self)
        if dist.is_initialized():
            dist.barrier()
            if self.rank == 0 and self.ctx and self.ctx.rdzv_file is not None:
                with contextlib.suppress(OSError):
                    self.ctx.rdzv_file.unlink()
            leave_process_group()
        release_rank0_lock(self._lock_fd)
        self._lock_fd = None

    # ---------------------------------------------------------------- helpers
    def fetch(self, dataset, indices: torch.Tensor):
        """Collate ``dataset[i]`` for ``indices`` with torch's default collate (map-style datasets)."""
        from torch.utils.data import default_collate

        return default_collate([dataset[int(i)] for i in indices])
