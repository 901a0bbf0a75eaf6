"""Restore time against a raw read of the same bytes, in one process, one ~270 MB generation.

    .venv/bin/python bench/bench_restore.py [--dir /tmp/dslurm-bench-restore] [--mb 268] [--reps 5]

One generation is saved once (CheckpointManager, sync). Each repetition then runs every
measurement once, in alternating order, each after os.sync() and, for the cold rows, after
posix_fadvise(DONTNEED) on every file of the generation (its pages leave the page cache, so the
bytes come from the disk; no root needed):
  raw          read every file of the generation once, 8 MiB reads, discarded (`cat > /dev/null`)
  restore      CheckpointManager.restore (verify_on_restore="full"): manifest checks, sizes,
               small files' crc32, dcp.load through CrcReader (crc32 of what it reads), the
               shards' crc32 from those reads -- the path under test
  dcp          a plain dcp.load (FileSystemReader) into the same model: DCP's own floor, no checks
  before       the previous path, rebuilt from its parts: crc32 of every file (verify_generation,
               full), then a plain dcp.load (FileSystemReader), i.e. two reads of every shard
  size         CheckpointManager.restore with verify_on_restore="size" (no crc32 at all)
Rows with a `_warm` suffix repeat the same without evicting the pages (the CPU's share).
Ratios are taken per repetition, then the median: restore / raw (goal: near 1), restore / dcp
(what the checks add to DCP's own load), before / raw and before / dcp.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch.distributed.checkpoint as dcp
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dslurm import checkpoint as ck  # noqa: E402
from dslurm.checkpoint.dcp import CheckpointManager  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_checkpoint import evict, files_of, make_model, raw_read  # noqa: E402


def mgr_restore(run: Path, model: nn.Module, mode: str) -> float:
    with CheckpointManager(run, verify_on_restore=mode) as mgr:
        t = time.perf_counter()
        res = mgr.restore({"model": model})
        dt = time.perf_counter() - t
    assert res is not None and not res.fell_back, res
    return dt


def plain(gen: Path, model: nn.Module) -> float:
    t = time.perf_counter()
    dcp.load({"model": model}, storage_reader=dcp.FileSystemReader(gen), no_dist=True)
    return time.perf_counter() - t


def before(gen: Path, model: nn.Module) -> float:
    t = time.perf_counter()
    problems = ck.verify_generation(gen, full=True)
    dcp.load({"model": model}, storage_reader=dcp.FileSystemReader(gen), no_dist=True)
    dt = time.perf_counter() - t
    assert not problems, problems
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/dslurm-bench-restore"))
    ap.add_argument("--mb", type=int, default=268)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    run = args.dir / "run"
    model = make_model(args.mb)
    with CheckpointManager(run) as mgr:
        assert mgr.save(1, {"model": model}, {})
    gen = ck.generations_dir(run) / ck.read_pointer(run).generation
    size = sum(p.stat().st_size for p in files_of(gen))
    target = make_model(args.mb)  # restored into, as a trainer restores into its built model
    ops = {"raw": lambda: raw_read(gen), "restore": lambda: mgr_restore(run, target, "full"),
           "dcp": lambda: plain(gen, target), "before": lambda: before(gen, target),
           "size": lambda: mgr_restore(run, target, "size")}
    rows: list[dict[str, float]] = []
    for rep in range(args.reps):
        row: dict[str, float] = {}
        order = list(ops) if rep % 2 == 0 else list(ops)[::-1]
        for warm in (False, True):
            for name in order:
                if warm:
                    raw_read(gen)  # pages in
                else:
                    evict(gen)
                time.sleep(0.2)
                row[name + ("_warm" if warm else "")] = ops[name]()
        rows.append(row)
        print("  rep %d: %s" % (rep, ", ".join(f"{k} {v:.3f}" for k, v in row.items())), flush=True)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    mb = size / 1e6
    print(f"generation: {mb:.0f} MB in {len(files_of(gen))} files, median of {args.reps} alternating reps")
    for name in med:  # the best rep too: the least disturbed by other jobs on a shared machine
        best = min(r[name] for r in rows)
        print(f"  {name:12s} median {med[name]:6.3f} s {mb / med[name]:6.0f} MB/s   best {best:6.3f} s")
    for suffix, what in (("", "cold (pages evicted)"), ("_warm", "warm (page cache)")):
        r = {n: statistics.median(row[n + suffix] / row["raw" + suffix] for row in rows)
             for n in ("restore", "before", "size", "dcp")}
        d = {n: statistics.median(row[n + suffix] / row["dcp" + suffix] for row in rows)
             for n in ("restore", "before", "size")}
        print(f"{what}: restore / raw read {r['restore']:.2f} (before: {r['before']:.2f}; sizes only: "
              f"{r['size']:.2f}; plain dcp.load: {r['dcp']:.2f})")
        print(f"  {'':{len(what)}}  restore / plain dcp.load {d['restore']:.2f} (before: {d['before']:.2f}; "
              f"sizes only: {d['size']:.2f})")
    shutil.rmtree(args.dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
