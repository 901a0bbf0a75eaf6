"""AdamW per model part, the LR schedule, and gradient clipping that works with DTensors.

Clipping: FSDP2 and TP turn gradients into DTensors, possibly on different meshes (a part
with TP but no FSDP, parameters left out of TP: the "mixed Tensor/DTensor" trap), and with
PP each rank holds only its stages' gradients. So the norm is built from per-mesh partial
norms made global with `full_tensor()`, then the squares are summed across the pipeline
group (as torchtitan's `dist_utils.clip_grad_norm_` does), and the local shards are scaled by
`clip_grads_with_norm_`'s coefficient. The result equals the single-process norm of the unsplit model.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Hashable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from train.lr import lr_lambda

if TYPE_CHECKING:
    from dslurm.config import TrainSpec

# full_tensor() of a norm on a 2-D (dp_shard, tp) mesh logs "2 sequential all_reduce
# operations ... flatten mesh dimensions" on every rank at every step; two tiny all-reduces
# per step are fine here, and the line would bury the training log.
logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)


def build_optimizers(parts: list[nn.Module], train: TrainSpec) -> tuple[list[torch.optim.Optimizer],
                                                                        list[torch.optim.lr_scheduler.LambdaLR]]:
    """One AdamW + LambdaLR per model part (a pipeline rank may hold two stages)."""
    factor = lr_lambda(warmup_steps=train.warmup_steps, total_steps=train.steps,
                       min_lr_ratio=train.min_lr_ratio)
    opts: list[torch.optim.Optimizer] = []
    scheds: list[torch.optim.lr_scheduler.LambdaLR] = []
    for part in parts:
        # foreach (not fused): fused AdamW has no DTensor/CPU path for all placements.
        opt = torch.optim.AdamW(part.parameters(), lr=train.lr, betas=(0.9, 0.95), eps=1e-8,
                                weight_decay=train.weight_decay, foreach=True)
        opts.append(opt)
        scheds.append(torch.optim.lr_scheduler.LambdaLR(opt, factor))
    return opts, scheds


def _group_key(g: torch.Tensor) -> Hashable:
    return (g.device_mesh, ) if isinstance(g, DTensor) else ("local", g.device)


def grad_norm(params: Iterable[nn.Parameter], pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Global L2 norm of all gradients (plain fp32 tensor, same value on every rank)."""
    groups: dict[Hashable, list[torch.Tensor]] = defaultdict(list)
    for p in params:
        if p.grad is not None:
            groups[_group_key(p.grad)].append(p.grad)
    sq = torch.zeros((), dtype=torch.float32)
    for grads in groups.values():
        n = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if isinstance(n, DTensor):
            n = n.full_tensor()  # reduces the Partial norm over the mesh the grads live on
        sq = sq.to(n.device) + n.float() ** 2
    if pp_group is not None:
        dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=pp_group)
    return sq.sqrt()


def clip_grad_norm_(params: list[nn.Parameter], max_norm: float,
                    pp_group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Scale gradients so their global norm is at most `max_norm`; returns the norm before.

    The scaling runs on the local shards: multiplying by one scalar commutes with every
    placement (Shard, Replicate, Partial sum), and a foreach op on DTensors pays DTensor's
    sharding propagation for the whole list on the first step for nothing (demo layout, 4
    processes on 2 cores: 0.16 s CPU / 0.45-0.67 s wall per process, against 0.03 / 0.06-0.09 s
    on the local shards). The coefficient is `clip_grads_with_norm_`'s."""
    total = grad_norm(params, pp_group)
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        by_device: dict[torch.device, list[torch.Tensor]] = defaultdict(list)
        for p in params:
            if p.grad is not None:
                g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                by_device[g.device].append(g)
        with torch.no_grad():
            for device, grads in by_device.items():
                torch._foreach_mul_(grads, coef.to(device))
    return total
