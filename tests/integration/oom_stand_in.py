"""A tiny DDP job that stands in for one that runs out of GPU memory (tests/integration/test_oom_live.py).

A step whose local batch is above ``--oom-above`` raises ``torch.OutOfMemoryError`` (what a CUDA
allocation failure raises), after ``--after`` steps of its start, so that a checkpoint was written first
(``checkpoint_every_steps=2``). Rank 0 prints one JSON line per start: restart count, steps restored,
local batch and accumulation of the start.
"""

import argparse
import json
import os

from slurm_elastic.train import install_stop_handler

install_stop_handler()

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from slurm_elastic.train import ElasticJob  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--oom-above", type=int, required=True)
p.add_argument("--after", type=int, default=2)
p.add_argument("--samples", type=int, default=768)
a = p.parse_args()

job = ElasticJob(seed=0, checkpoint_every_steps=2, noise_scale=False, throughput_warmup_steps=0, verbose=False)
job.setup()
torch.manual_seed(0)
model = torch.nn.Linear(4, 2)
ddp = job.wrap(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
job.register(model=model, optimizer=opt)
job.restore()
gen = torch.Generator().manual_seed(1)
X = torch.randn(a.samples, 4, generator=gen)
Y = (X[:, 0] > 0).long()
if job.rank == 0:
    print(json.dumps({"restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
                      "restored_steps": job.optimizer_steps, "local_batch": job.assignment.local_batch,
                      "accum": job.assignment.accum}), flush=True)
done_here = 0
for step in job.steps(dataset_size=a.samples, epochs=1):
    if job.assignment.local_batch > a.oom_above and done_here >= a.after:
        raise torch.OutOfMemoryError(f"CUDA out of memory (stand-in at local batch {job.assignment.local_batch})")
    for mb in step.micro_batches():
        loss = F.cross_entropy(ddp(X[mb.indices]), Y[mb.indices], reduction="sum") * mb.scale
        loss.backward()
    step.optimizer_step()
    done_here += 1
job.finish()
