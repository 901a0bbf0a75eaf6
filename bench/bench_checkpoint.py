"""Checkpoint protocol costs, in one process, on one model of ~270 MB (fp32).

    .venv/bin/python bench/bench_checkpoint.py [--dir /tmp/dslurm-bench] [--mb 268] [--reps 2]

Prints, best of --reps each:
  raw       fsync'd sequential write of the same number of bytes (one file, 8 MiB chunks)
  dcp       plain dcp.save (FileSystemWriter, sync_files=True)
  sync      CheckpointManager sync save: dcp + crc32 manifest + size verify + restore test + pointer
  async     CheckpointManager async save: time until save() returns (training blocked)
  restore   CheckpointManager.restore: full crc32 verify + dcp.load into a fresh model
and the ratios the issue asks for: sync throughput vs raw (goal >= 0.8), async stall vs sync
(goal <= 0.04), protocol overhead vs plain dcp.save.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dslurm.checkpoint_dcp import CheckpointManager  # noqa: E402


def make_model(mb: int) -> nn.Module:
    width = 4096
    layers = max(1, round(mb * 1e6 / (width * width * 4)))
    with torch.no_grad():
        # Biases as in real layers: the restore test loads the smallest tensor, and real training
        # states always have small ones (biases, norms, the optimizer's step counters).
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        for p in model.parameters():  # random bytes, not kaiming: init cost is not what we measure
            p.normal_()
    return model


def nbytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def raw_write(path: Path, size: int) -> float:
    chunk = torch.randn(8 << 18).numpy().tobytes()  # 8 MiB of incompressible bytes
    t = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = size
        while left > 0:
            left -= f.write(chunk[: min(len(chunk), left)])
        os.fsync(f.fileno())
    dt = time.perf_counter() - t
    path.unlink()
    return dt


def plain_dcp(model: nn.Module, path: Path) -> float:
    t = time.perf_counter()
    dcp.save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter(path, sync_files=True),
             no_dist=True)
    dt = time.perf_counter() - t
    shutil.rmtree(path)
    return dt


def mgr_save(model: nn.Module, run: Path, async_mode: bool) -> tuple[float, float]:
    """(seconds until save() returned, seconds until committed), for the second save of a manager:
    steady state, as in training, where the async stager's host buffers already exist."""
    with CheckpointManager(run, async_mode=async_mode) as mgr:
        for step in (1, 2):
            t = time.perf_counter()
            mgr.save(step, {"model": model}, {"tokens_seen": 0})
            returned = time.perf_counter() - t
            mgr.wait()
            committed = time.perf_counter() - t
            assert mgr.last_outcome is not None and mgr.last_outcome.ok, mgr.last_outcome
    return returned, committed


def restore(run: Path, mb: int) -> float:
    fresh = make_model(mb)
    with CheckpointManager(run) as mgr:
        t = time.perf_counter()
        res = mgr.restore({"model": fresh})
        dt = time.perf_counter() - t
    assert res is not None and res.step == 2
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/dslurm-bench"))
    ap.add_argument("--mb", type=int, default=268)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    model = make_model(args.mb)
    size = nbytes(model)
    best: dict[str, float] = {}

    def keep(name: str, value: float) -> None:
        best[name] = min(best.get(name, float("inf")), value)

    for rep in range(args.reps):
        keep("raw", raw_write(args.dir / "raw.bin", size))
        keep("dcp", plain_dcp(model, args.dir / "dcp"))
        run = args.dir / f"sync{rep}"
        _, committed = mgr_save(model, run, async_mode=False)
        keep("sync", committed)
        keep("restore", restore(run, args.mb))
        shutil.rmtree(run)
        returned, _ = mgr_save(model, args.dir / f"async{rep}", async_mode=True)
        keep("async_stall", returned)
        shutil.rmtree(args.dir / f"async{rep}")
    mb = size / 1e6
    print(f"model state: {mb:.0f} MB, best of {args.reps}, dir {args.dir}")
    for name in ("raw", "dcp", "sync", "async_stall", "restore"):
        print(f"  {name:12s} {best[name]:7.3f} s   {mb / best[name]:8.0f} MB/s")
    print(f"sync save throughput / raw fsync'd write: {best['raw'] / best['sync']:.2f}  (goal >= 0.8)")
    print(f"async stall / sync save time:             {best['async_stall'] / best['sync']:.3f} (goal <= 0.04)")
    print(f"protocol overhead over plain dcp.save:    {best['sync'] - best['dcp']:+.3f} s "
          f"({(best['sync'] / best['dcp'] - 1) * 100:+.0f}%)")
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
