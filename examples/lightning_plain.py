# A Lightning script: docs/INTEGRATIONS.md shows its diff to examples/lightning_elastic.py.
import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

g = torch.Generator().manual_seed(0)
X = torch.randn(512, 32, generator=g)
ds = TensorDataset(X, (X @ torch.randn(32, 10, generator=g)).argmax(1))


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):  # a schedule over 40 steps at batch 64 (8 steps per epoch)
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: max(0.0, 1 - step / 40))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


torch.manual_seed(0)
model = Net()
trainer = L.Trainer(max_epochs=5, logger=False, enable_progress_bar=False, accelerator="cpu", devices=2)
trainer.fit(model, DataLoader(ds, batch_size=32, shuffle=True, num_workers=2))
