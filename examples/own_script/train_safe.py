"""train_plain.py made preemption-safe with dslurm.runtime (diff the two files): on USR2/TERM all
ranks agree at a step boundary, save and exit 75/143; the requeued job resumes from the verified
checkpoint (model, optimizer, scheduler, RNG). Job: examples/jobs/own-safe.yaml."""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import dslurm.runtime as dr


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
    dr.init()  # the process group, stop handlers, the burn-in when asked
    rank = dist.get_rank()
    torch.manual_seed(1 + rank)  # dropout masks differ per rank
    model = DDP(make_model(), find_unused_parameters=True)  # fixed gradient buckets: README, own script
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)
    ckpt = dr.Checkpoint(model=model, optim=opt, sched=sched)
    start = ckpt.restore()  # 0, or the steps the last checkpoint had done
    for step in range(start, args.steps):
        x, y = batch(step, rank, args.batch)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if rank == 0 and step % 10 == 0:
            print(f"step {step} loss {loss.item():.5f}", flush=True)
        time.sleep(args.step_sleep)
        dr.log_metrics(step, loss=loss.item())
        if dr.stop_requested(step + 1):  # all ranks agree at this step boundary
            ckpt.save(step + 1, final=True)
            dr.exit_for_requeue(step + 1)
        if ckpt.due(step + 1):
            ckpt.save(step + 1)
    ckpt.save(args.steps, final=True)
    if rank == 0:
        torch.save(model.module.state_dict(), args.out)
    dr.finish(args.steps)


if __name__ == "__main__":
    main()
