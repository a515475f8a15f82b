from slurm_elastic.train import ElasticJob, install_stop_handler
install_stop_handler()  # before the slow torch import: a stop request then must not kill the task
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

g = torch.Generator().manual_seed(0)
X = torch.randn(4096, 32, generator=g)
ds = TensorDataset(X, (X @ torch.randn(32, 10, generator=g)).argmax(1))

job = ElasticJob(seed=0, default_batch=128, lr_scaling="sqrt", clip_grad_norm=1.0)
job.setup()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
ddp = job.wrap(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
job.register(model=model, optimizer=opt)
job.restore()
loader = DataLoader(ds, batch_sampler=job.batch_sampler(len(ds), epochs=5), num_workers=2)
for x, y in job.batches(loader):
    opt.zero_grad()
    loss = F.cross_entropy(ddp(x), y)
    loss.backward()
    opt.step()
job.finish()
