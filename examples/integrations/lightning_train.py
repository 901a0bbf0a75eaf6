"""A plain Lightning script on the chain: the two lines marked `dslurm` are the whole change (the
import, and `dl.run(trainer, model, ...)` in place of `trainer.fit(model, ...)`). A tiny
regression model with dropout, a shuffled loader, DDP over gloo on CPUs, one process per node or
more. Job: examples/integrations/lightning.yaml."""

from __future__ import annotations

import argparse
import os
import time

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import dslurm.integrations.lightning as dl  # dslurm


class Regressor(pl.LightningModule):
    def __init__(self, lr: float, steps: int, sleep: float) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1))
        self.lr, self.steps, self.sleep = lr, steps, sleep

    def training_step(self, batch, batch_idx):  # noqa: ANN001, ANN201
        x, y = batch
        time.sleep(self.sleep)  # --step-sleep: time to signal the job
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):  # noqa: ANN201
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.steps)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--out", default="lightning-final.pt", help="where rank 0 writes the final parameters")
    p.add_argument("--root-dir", default="lightning-out")
    a = p.parse_args()
    pl.seed_everything(1)
    model = Regressor(3e-3, a.steps, a.step_sleep)
    g = torch.Generator().manual_seed(7)
    x = torch.randn(192, 16, generator=g)
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True).sin()), batch_size=4, shuffle=True)
    per_node, world = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), int(os.environ.get("WORLD_SIZE", "1"))
    trainer = pl.Trainer(accelerator="cpu", devices=per_node, num_nodes=world // per_node,
                         strategy="ddp" if world > 1 else "auto",
                         max_steps=a.steps, default_root_dir=a.root_dir, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    dl.run(trainer, model, train_dataloaders=loader)  # dslurm: in place of trainer.fit(model, ...)
    if trainer.is_global_zero:
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, a.out)


if __name__ == "__main__":
    main()
