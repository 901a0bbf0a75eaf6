"""A plain Hugging Face Trainer script on the chain: the two lines marked `dslurm` are the whole
change (the import, and `dh.run(trainer)` in place of `trainer.train()`). A tiny regression
model with dropout, a shuffled dataset, DDP over gloo on CPUs. Job: examples/integrations/hf.yaml."""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

import dslurm.integrations.hf as dh  # dslurm


class Regressor(nn.Module):
    """Any nn.Module whose forward takes the batch's keys and returns {"loss": ...} trains in HF."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.mse_loss(self.net(x), labels)}


class Points(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 16, generator=g)
        self.y = self.x.sum(dim=1, keepdim=True).sin()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class Slow(TrainerCallback):
    """--step-sleep: seconds per step, to give a test (or you) time to signal the job."""

    def __init__(self, s: float) -> None:
        self.s = s

    def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN201
        time.sleep(self.s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--out", default="hf-final.pt", help="where rank 0 writes the final parameters")
    p.add_argument("--output-dir", default="hf-out")
    a = p.parse_args()
    torch.manual_seed(0)
    model = Regressor()
    args = TrainingArguments(output_dir=a.output_dir, max_steps=a.steps, per_device_train_batch_size=4,
                             learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=3, weight_decay=0.01,
                             logging_steps=1, save_strategy="no", report_to="none", seed=1, use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=Points(512), callbacks=[Slow(a.step_sleep)])
    dh.run(trainer)  # dslurm: in place of trainer.train()
    if trainer.is_world_process_zero():
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, a.out)


if __name__ == "__main__":
    main()
