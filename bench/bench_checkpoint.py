"""A checkpoint's save and restore against the disk's own speed, side by side, in one process.

    .venv/bin/python bench/bench_checkpoint.py [--dir /tmp/dslurm-bench] [--mb 268] [--reps 5]

One model of --mb MB (fp32 Linear 4096x4096 layers with biases). Each repetition measures
everything once; each measurement under test is sandwiched between two of its baseline, back to
back (the disk here is shared with other jobs and its speed drifts), every write after os.sync()
and a short pause, so that none pays for the previous one's writeback:
  raw_write     fsync'd sequential write of the same number of bytes (one file, 8 MiB writes);
                the mean of the one before and the one after the sync save
  sync          CheckpointManager sync save as a stop signal's (blocking=True): DCP write with
                the crc32 streamed, the finiteness check, manifest, size verify, restore test,
                pointer, retention (the second save of a manager)
  raw_read      read every file of the sync save's generation once, 8 MiB reads (`cat`); the
                mean of the one before and the one after the restore
  restore       CheckpointManager.restore of that generation, full verification (crc32 of every
                byte read, compared with the manifest) into a model built beforehand
  dcp           plain dcp.save (FileSystemWriter, sync_files=True): no checks at all (context)
  async_stall   CheckpointManager async save: time until save() returns (training blocked)
Cold reads, the same for both: os.sync(), then posix_fadvise(POSIX_FADV_DONTNEED) on every file
of the generation (its pages leave the page cache; no root needed), then the measurement.
Ratios are taken per repetition, then the median (and from the best reps: the least disturbed):
  raw write time / sync save time    (goal >= 0.8)
  restore time / raw read time, cold (goal <= 1.5)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dslurm import checkpoint as ck  # noqa: E402
from dslurm.checkpoint.dcp import CheckpointManager  # noqa: E402
from dslurm.checkpoint.io import raw_write  # noqa: E402

_CHUNK = 8 << 20


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


def settle() -> None:
    """Flush the previous measurement's dirty pages first, so its writeback is not billed to
    the next one (every measured write is fsync'd anyway)."""
    os.sync()
    time.sleep(0.3)


def files_of(gen: Path) -> list[Path]:
    return sorted(p for p in gen.rglob("*") if p.is_file())


def evict(gen: Path) -> None:
    """Drop the generation's pages from the page cache (clean pages only: hence os.sync first)."""
    os.sync()
    for p in files_of(gen):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(gen: Path) -> float:
    buf = bytearray(_CHUNK)
    t = time.perf_counter()
    for p in files_of(gen):
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t


def plain_dcp(model: nn.Module, path: Path) -> float:
    t = time.perf_counter()
    dcp.save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter(path, sync_files=True),
             no_dist=True)
    dt = time.perf_counter() - t
    shutil.rmtree(path)
    return dt


def mgr_save(model: nn.Module, run: Path, async_mode: bool, io_threads: int | None = None
             ) -> tuple[float, dict[str, float]]:
    """(seconds until the second save() of a manager returned, its phases): steady state, as in
    training, where the async stager's host buffers already exist. io_threads None: the manager's
    default."""
    kw = {} if io_threads is None else {"io_threads": io_threads}
    with CheckpointManager(run, async_mode=async_mode, **kw) as mgr:
        for step in (1, 2):
            settle()
            t = time.perf_counter()
            mgr.save(step, {"model": model}, {"tokens_seen": 0}, blocking=not async_mode)
            returned = time.perf_counter() - t
            mgr.wait()
            assert mgr.last_outcome is not None and mgr.last_outcome.ok, mgr.last_outcome
    return returned, mgr.last_outcome.phases


def restore(run: Path, target: nn.Module) -> float:
    with CheckpointManager(run) as mgr:
        t = time.perf_counter()
        res = mgr.restore({"model": target})
        dt = time.perf_counter() - t
    assert res is not None and res.step == 2 and not res.fell_back, res
    return dt


def one_rep(args: argparse.Namespace, model: nn.Module, target: nn.Module, rep: int,
            phases: list[dict[str, float]]) -> dict[str, float]:
    """Each measurement under test sandwiched between two of its baseline, back to back, so that
    the disk's load drifts as little as possible between them: raw_write, sync, raw_write; then
    raw_read, restore, raw_read (cold); then plain dcp.save and the async stall for context."""
    size, run, row = nbytes(model), args.dir / f"sync{rep}", {}

    def gen() -> Path:
        ptr = ck.read_pointer(run)
        assert ptr is not None
        return ck.generations_dir(run) / ptr.generation

    def cold(op: Callable[[], float]) -> float:
        evict(gen())
        time.sleep(0.2)
        return op()

    def sync() -> float:
        dt, ph = mgr_save(model, run, async_mode=False)
        phases.append(ph)
        return dt

    settle()
    before = raw_write(args.dir / "raw.bin", size)
    row["sync"] = sync()
    settle()
    after = raw_write(args.dir / "raw.bin", size)
    row["raw_write"] = (before + after) / 2
    if args.threads_too:  # the other writer thread count, sandwiched the same way (context)
        settle()
        row[f"sync_{args.threads_too}t"] = mgr_save(model, args.dir / f"t{rep}", False, args.threads_too)[0]
        settle()
        row["raw_write_t"] = (after + raw_write(args.dir / "raw.bin", size)) / 2
    before = cold(lambda: raw_read(gen()))
    row["restore"] = cold(lambda: restore(run, target))
    row["raw_read"] = (before + cold(lambda: raw_read(gen()))) / 2
    settle()
    row["dcp"] = plain_dcp(model, args.dir / "dcp")
    row["async_stall"] = mgr_save(model, args.dir / f"async{rep}", async_mode=True)[0]
    return row


def report(args: argparse.Namespace, size: int, rows: list[dict[str, float]],
           phases: list[dict[str, float]]) -> None:
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    best = {k: min(r[k] for r in rows) for k in rows[0]}
    mb = size / 1e6
    print(f"model state: {mb:.0f} MB, {args.reps} reps, dir {args.dir}, load average "
          f"{os.getloadavg()[0]:.1f}; raw_write and raw_read: the mean of the two around the measurement")
    for name in ("raw_write", "sync", "dcp", "async_stall", "raw_read", "restore"):
        print(f"  {name:12s} median {med[name]:7.3f} s {mb / med[name]:7.0f} MB/s   best {best[name]:7.3f} s")
    ph = {k: statistics.median(p[k] for p in phases) for k in phases[0]}
    print("  sync save phases (median, s since the save began): "
          + ", ".join(f"{k} {v:.3f}" for k, v in ph.items()))
    ratio = {name: statistics.median(f(r) for r in rows) for name, f in (
        ("save", lambda r: r["raw_write"] / r["sync"]), ("dcp", lambda r: r["raw_write"] / r["dcp"]),
        ("restore", lambda r: r["restore"] / r["raw_read"]), ("stall", lambda r: r["async_stall"] / r["sync"]))}
    print("cold reads: os.sync() + posix_fadvise(DONTNEED) on every file of the generation, before each read")
    print(f"sync save: raw fsync'd write / save {ratio['save']:.2f} (goal >= 0.8; best reps "
          f"{best['raw_write'] / best['sync']:.2f}; plain dcp.save {ratio['dcp']:.2f})   "
          f"restore, cold: restore / raw read {ratio['restore']:.2f} (goal <= 1.5; best reps "
          f"{best['restore'] / best['raw_read']:.2f})")
    print(f"async stall / sync save time: {ratio['stall']:.3f}")
    if args.threads_too:
        k = f"sync_{args.threads_too}t"
        print(f"sync save with io_threads={args.threads_too}: raw fsync'd write / save "
              f"{statistics.median(r['raw_write_t'] / r[k] for r in rows):.2f} (best reps "
              f"{best['raw_write_t'] / best[k]:.2f}); directly, default save / this save "
              f"{statistics.median(r['sync'] / r[k] for r in rows):.2f} (the raw write after it runs third "
              "and came slower here: trust the direct ratio)")
    for row in rows:
        print("  rep: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()))


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/dslurm-bench"))
    ap.add_argument("--mb", type=int, default=268)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads-too", type=int, default=0, metavar="N",
                    help="also a sync save with io_threads=N (DCP writer threads, one file each), side by side")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    args.dir.mkdir(parents=True)
    model, target = make_model(args.mb), make_model(args.mb)  # restored into, as a trainer does
    rows: list[dict[str, float]] = []
    phases: list[dict[str, float]] = []
    for rep in range(args.reps):
        rows.append(one_rep(args, model, target, rep, phases))
        shutil.rmtree(args.dir, ignore_errors=True)
        args.dir.mkdir()
    report(args, nbytes(model), rows, phases)
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
