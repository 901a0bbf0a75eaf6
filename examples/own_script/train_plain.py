"""A plain PyTorch DDP training script (CPU, gloo, a tiny MLP, data a pure function of step and rank).
It runs under torchrun or dslurm (examples/jobs/own-plain.yaml), but a preemption loses the run;
train_safe.py is the same script made preemption-safe with dslurm.runtime."""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def get_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch", type=int, default=16, help="samples per rank and step")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds per step (to watch it)")
    p.add_argument("--out", default="final.pt", help="where rank 0 writes the final parameters")
    return p.parse_args()


def make_model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))


def batch(step: int, rank: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of `step`: deterministic, so a resumed run reads the same data."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 16, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def main() -> None:
    args = get_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1 + rank)  # dropout masks differ per rank
    model = DDP(make_model(), find_unused_parameters=True)  # fixed gradient buckets: README, own script
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    for step in range(0, args.steps):
        x, y = batch(step, rank, args.batch)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.5f}", flush=True)
        time.sleep(args.step_sleep)
    if rank == 0:
        torch.save(model.module.state_dict(), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
