"""All-reduce bandwidth: the nccl-tests arithmetic (pure) and the size sweep (torch shell).

Definitions follow nccl-tests (doc/PERFORMANCE.md): algbw = bytes / time; for all-reduce,
busbw = algbw * 2(n-1)/n, the per-link traffic of a ring, comparable to the hardware link speed
whatever n is. Fault injection (dslurm/faults.py): DSLURM_FAULT_SLOW_NODE="host:seconds[,host:seconds]" makes the
named node sleep that long before each timed collective or pair exchange it takes part in.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

MiB = 1 << 20
CPU_SIZES = (64 * 1024, 1 * MiB, 8 * MiB)
GPU_SIZES = (1 * MiB, 16 * MiB, 128 * MiB, 1024 * MiB)


def algbw_gbps(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes, as nccl-tests prints)."""
    if seconds <= 0:
        raise ValueError(f"time must be positive, got {seconds}")
    return nbytes / seconds / 1e9


def busbw_gbps(algbw: float, n: int) -> float:
    """All-reduce bus bandwidth; 0 for a single rank (no data moves)."""
    if n < 1:
        raise ValueError(f"ranks must be >= 1, got {n}")
    return algbw * 2 * (n - 1) / n


@dataclass(slots=True)
class SweepPoint:
    nbytes: int
    ranks: int
    seconds: float
    algbw_gbps: float
    busbw_gbps: float


def make_point(nbytes: int, ranks: int, seconds: float) -> SweepPoint:
    alg = algbw_gbps(nbytes, seconds)
    return SweepPoint(nbytes, ranks, seconds, alg, busbw_gbps(alg, ranks))


def peak_busbw(points: list[SweepPoint]) -> float | None:
    """Bus bandwidth at the largest size swept: what big gradient buckets will see."""
    if not points:
        return None
    return max(points, key=lambda p: p.nbytes).busbw_gbps


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allreduce_sweep(group: Any, sizes: tuple[int, ...], device: Any, delay: float = 0.0,
                    iters: int = 5, warmup: int = 1) -> list[SweepPoint]:
    """Time all-reduce of float32 buffers of each size on `group` (every member must call)."""
    import torch
    import torch.distributed as dist

    n = dist.get_world_size(group)
    points = []
    for nbytes in sizes:
        buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
        for _ in range(warmup):
            dist.all_reduce(buf, group=group)
        _sync(device)
        dist.barrier(group=group)
        start = time.perf_counter()
        for _ in range(iters):
            if delay:
                time.sleep(delay)  # fault injection: this node is slow
            dist.all_reduce(buf, group=group)
        _sync(device)
        elapsed = torch.tensor([(time.perf_counter() - start) / iters], device=device)
        # The slowest member defines the collective's time.
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        points.append(make_point(nbytes, n, float(elapsed.item())))
    return points
