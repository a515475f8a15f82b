#!/usr/bin/env python3
"""A real, small elastic DDP training job: an MLP learns the three-arm spiral classification task.

The dataset is generated locally (nothing is downloaded): 3 interleaved spiral arms in the plane with
Gaussian noise, 1000 points per arm for training and 200 per arm for testing, from a fixed seed. A
2-64-64-3 MLP reaches ~95% test accuracy in a few seconds on one CPU core; it is small on purpose, so
the example runs anywhere, but everything that makes a job resizable is the real thing:

* run it under ``srun`` (one task per GPU, see sbatch_templates/elastic_ddp.sbatch) or plain
  ``python examples/train_elastic_spiral.py --batch 64`` (one process, no Slurm);
* it reads its global batch from the daemon's decision (AdminComment) or the spec (Comment);
* USR2 makes every rank stop after the same step, rank 0 checkpoints, and the job exits with 75;
* a restart with any world size and batch resumes at the exact global sample offset.

``--record-samples DIR`` writes, per rank and start, the sample indices each step consumed (used by the
end-to-end test to check exactly-once coverage). ``--step-delay`` adds a sleep per step to emulate a
bigger model (demos, tests).
"""

from __future__ import annotations

# Install the USR2 flag handler before the slow torch import: a stop request that arrives while torch
# loads must not kill the task.
from slurm_elastic.train import install_stop_handler

install_stop_handler()

import argparse  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from slurm_elastic.train import ElasticJob  # noqa: E402


def spiral_dataset(n_per_class: int, seed: int, classes: int = 3, noise: float = 0.2):
    """``classes`` spiral arms, ``n_per_class`` points each: (X float32 [N,2], y int64 [N])."""
    g = torch.Generator().manual_seed(seed)
    xs, ys = [], []
    for c in range(classes):
        r = torch.linspace(0.05, 1.0, n_per_class)
        t = r * 4.0 + c * (2 * math.pi / classes) + noise * torch.randn(n_per_class, generator=g)
        xs.append(torch.stack([r * torch.sin(t), r * torch.cos(t)], dim=1))
        ys.append(torch.full((n_per_class,), c, dtype=torch.int64))
    X, y = torch.cat(xs), torch.cat(ys)
    order = torch.randperm(len(y), generator=g)
    return X[order], y[order]


def build_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)  # the same initial weights in every process and every run
    return torch.nn.Sequential(
        torch.nn.Linear(2, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3)
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ckpt-dir", default=os.environ.get("ELASTIC_CKPT_DIR"),
                   help="checkpoint directory, shared by all nodes (default: $ELASTIC_CKPT_DIR)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.5, help="learning rate at the base batch")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--lr-scaling", choices=("none", "linear", "sqrt", "adascale"), default="sqrt")
    p.add_argument("--base-batch", type=int, default=None, help="batch the lr is meant for (default: spec batch)")
    p.add_argument("--batch", type=int, default=64, help="global batch without an elastic spec (plain runs)")
    p.add_argument("--max-local-batch", type=int, default=None, help="per-process limit without a spec")
    p.add_argument("--seed", type=int, default=0, help="model init and data order")
    p.add_argument("--data-seed", type=int, default=1234)
    p.add_argument("--n-per-class", type=int, default=1000)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--checkpoint-every-s", type=float, default=60.0)
    p.add_argument("--record-samples", default=None, help="directory for per-rank sample-index logs")
    p.add_argument("--step-delay", type=float, default=0.0, help="seconds to sleep per step (emulated compute)")
    p.add_argument("--no-noise-scale", action="store_true",
                   help="do not measure the gradient noise scale: the daemon then takes the batch's statistical "
                        "efficiency from the job's profile (a paced job standing in for that profile's model)")
    p.add_argument("--loader-workers", type=int, default=0,
                   help="use a torch DataLoader with this many workers (job.batches) instead of job.steps()")
    args = p.parse_args(argv)
    if not args.ckpt_dir:
        p.error("give --ckpt-dir or set ELASTIC_CKPT_DIR")
    dtype = getattr(torch, args.dtype)

    job = ElasticJob(args.ckpt_dir, seed=args.seed, default_batch=args.batch, max_local_batch=args.max_local_batch,
                     lr_scaling=args.lr_scaling, base_batch=args.base_batch,
                     checkpoint_every_s=args.checkpoint_every_s, noise_scale=not args.no_noise_scale)
    job.setup()
    X, y = spiral_dataset(args.n_per_class, args.data_seed)
    Xt, yt = spiral_dataset(args.n_per_class // 5, args.data_seed + 1)
    X, Xt = X.to(dtype), Xt.to(dtype)
    model = build_model(args.seed).to(dtype)
    ddp = job.wrap(model)
    X, y = X.to(job.device), y.to(job.device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    job.register(model=model, optimizer=opt)
    job.restore()

    rec = None
    if args.record_samples:
        os.makedirs(args.record_samples, exist_ok=True)
        name = f"samples.{job.senv.job_id or 'local'}.s{job.senv.restart_count}.r{job.rank}.txt"
        rec = open(os.path.join(args.record_samples, name), "a", encoding="utf-8")

    t0, loss_sum, loss_n = time.time(), 0.0, 0
    if args.loader_workers:
        # The DataLoader way: an ordinary mean loss, opt.step() per loader item; the library scales the
        # gradient, accumulates and stops (docs/ELASTIC-SCRIPT.md).
        from torch.utils.data import DataLoader, TensorDataset

        ds = TensorDataset(X.cpu(), y.cpu(), torch.arange(len(y)))
        loader = DataLoader(ds, batch_sampler=job.batch_sampler(len(y), args.epochs),
                            num_workers=args.loader_workers)
        step_idx, before, epoch = [], job.optimizer_steps, job.epoch
        for xb, yb, ib in job.batches(loader):
            epoch = job.epoch if not step_idx else epoch
            loss = F.cross_entropy(ddp(xb.to(job.device)), yb.to(job.device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            step_idx += ib.tolist()
            if job.optimizer_steps != before:  # the real optimizer step of this global step ran
                before = job.optimizer_steps
                if rec is not None:
                    rec.write(f"{epoch} {job.optimizer_steps - 1} {','.join(map(str, step_idx))}\n")
                    rec.flush()
                step_idx = []
                if args.step_delay:
                    time.sleep(args.step_delay)
        job.finish()
        if job.rank == 0:
            print(f"spiral: {job.samples_seen} samples through a DataLoader with {args.loader_workers} workers",
                  flush=True)
        return 0
    for step in job.steps(dataset_size=len(y), epochs=args.epochs):
        for mb in step.micro_batches():
            idx = mb.indices.to(job.device)
            # Sum of per-sample losses times world/global-count: after DDP's average, the gradient
            # is the mean over the global batch at any world size (see MicroBatch).
            per_sample_sum = F.cross_entropy(ddp(X[idx]), y[idx], reduction="sum")
            (per_sample_sum * mb.scale).backward()
            if not mb.dummy:
                loss_sum, loss_n = loss_sum + per_sample_sum.item(), loss_n + len(mb)
        step.optimizer_step()
        if rec is not None:
            rec.write(f"{step.epoch} {job.optimizer_steps} {','.join(map(str, step.indices.tolist()))}\n")
            rec.flush()
        if args.step_delay:
            time.sleep(args.step_delay)
        if job.rank == 0 and job.optimizer_steps % 100 == 0:
            job.log(f"epoch {job.epoch} step {job.optimizer_steps}: rank-0 train loss {loss_sum / max(1, loss_n):.4f}")
            loss_sum, loss_n = 0.0, 0
    job.finish()
    if job.rank == 0:
        with torch.no_grad():
            acc = (model(Xt.to(job.device)).argmax(1).cpu() == yt).float().mean().item()
        tp = job.throughput()
        print(f"spiral: test accuracy {acc:.3f} after {job.samples_seen} samples "
              f"({time.time() - t0:.1f} s this start, {tp or 0:.0f} samples/s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
