# A DDP script with a DataLoader: docs/ELASTIC-SCRIPT.md shows its diff to examples/ddp_elastic.py.
from slurm_elastic.train import ElasticJob
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

g = torch.Generator().manual_seed(0)
X = torch.randn(4096, 32, generator=g)
ds = TensorDataset(X, (X @ torch.randn(32, 10, generator=g)).argmax(1))

job = ElasticJob.create(seed=0, default_batch=128, lr_scaling="sqrt", clip_grad_norm=1.0)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ddp = job.prepare(model, opt)
loader = job.loader(ds, num_workers=2)
for epoch in job.epochs(5):
    for x, y in loader:
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
job.finish()
