# A DDP script with a DataLoader: docs/ELASTIC-SCRIPT.md shows its diff to examples/ddp_elastic.py.
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

g = torch.Generator().manual_seed(0)
X = torch.randn(4096, 32, generator=g)
ds = TensorDataset(X, (X @ torch.randn(32, 10, generator=g)).argmax(1))

dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
ddp = DDP(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
sampler = DistributedSampler(ds, shuffle=True, seed=0)
loader = DataLoader(ds, batch_size=64, sampler=sampler, num_workers=2)
for epoch in range(5):
    sampler.set_epoch(epoch)
    for x, y in loader:
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
dist.destroy_process_group()
