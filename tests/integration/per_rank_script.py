"""A DDP script whose data is per-rank state, for tests/integration/test_per_rank_state.py: a
torchdata `StatefulDataLoader` over a `DistributedSampler` (each rank reads its own slice of
the epoch's permutation) and a `torch.Generator` seeded by rank (each rank's own noise), and a
model with dropout (its masks come from the global torch RNG, which the loader's iterator also
draws its base seed from when it has no generator of its own: issue 38). Handed to
`dslurm.runtime.Checkpoint` as they are. Writes rank 0's final parameters to --out and every
sample index each rank read to --reads/reads-<rank>-<pid>.txt."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import dslurm.runtime as dr


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--parts", default="loader,gen", help="per-rank state to checkpoint")
    p.add_argument("--out", required=True)
    p.add_argument("--reads", required=True)
    args = p.parse_args()
    parts = set(args.parts.split(","))
    dr.init()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    # find_unused_parameters: DDP keeps its first bucket layout (README, "DDP and bit-identical resumes")
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.3), nn.Linear(16, 1)), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.randn(240, 8, generator=torch.Generator().manual_seed(7))
    ds = TensorDataset(data, torch.arange(240))
    loader = StatefulDataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, world, rank, shuffle=True, seed=0))
    noise = torch.Generator().manual_seed(100 + rank)
    state: dict[str, object] = {"model": model, "optim": opt}
    if "loader" in parts:
        state["data"] = loader
    if "gen" in parts:
        state["noise"] = noise
    ckpt = dr.Checkpoint(**state)
    start = ckpt.restore()
    it = iter(loader)  # after restore(), without a generator: the common way (issue 38)
    reads = Path(args.reads) / f"reads-{rank}-{os.getpid()}.txt"
    for step in range(start, args.steps):
        x, idx = next(it)
        x = x + 0.1 * torch.randn(x.shape, generator=noise)
        with reads.open("a") as f:
            f.write(" ".join(map(str, idx.tolist())) + "\n")
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        dr.log_metrics(step, loss=loss.item())
        if dr.stop_requested(step + 1):
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
