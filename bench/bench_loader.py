"""One rank's loader tokens/s with prefetch, against a GPU's consumption and a raw read of the file.

The rank is one data-parallel rank of an 8-GPU 8B run: seq_len 8192, 4 windows per step
(global batch 32 over dp 8). Consumption reference: 8,500 tokens/s per GPU, an 8xH100 Llama-3
8B run's (torchtitan's float8 figure); goal: the loader >= 20x that. Raw read: the same token
file read sequentially with plain `read` calls of 16 MB (page-cached, as the loader's reads
are), measured before and after the loader sections and averaged; goal: the loader >= 0.5x.

Sections (all `make_loader`, `data.prefetch` 2 unless said): a single token file, a 4-shard
manifest (windows across shard boundaries), a mixture 1:3 (manifest, file) with val_fraction
0.01, and the single file with prefetch 0 (reads in the step). Each is timed over `--steps`
batches after one warm-up batch (which opens the files and starts the reader), consumer doing
nothing: the rate the reader sustains. Then the step's `data` wait: a consumer that "computes"
for 2x a batch's read time per step, with and without prefetch (the wait should be ~0 with it).

    .venv/bin/python bench/bench_loader.py [--steps 300] [--mtokens 64] [--windows 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
SITE = ROOT / "site-configs" / "local.yaml"
SEQ, DP = 8192, 8
LOCAL = 4  # windows per step per rank (--windows)
GPU_TOKENS_S = 8500.0
VOCAB = 32000


def _resolved(tmp: Path, *sets: str):
    from dslurm.config import load_job, load_site
    from dslurm.config.resolve import resolve
    from dslurm.config.schema import apply_overrides

    data, _ = apply_overrides({
        "name": "bench-loader", "nodes": 1, "model": {"preset": "tiny", "seq_len": SEQ, "vocab_size": VOCAB},
        "train": {"global_batch": LOCAL * DP, "seed": 1}, "checkpoint": {"run_dir": str(tmp / "run")}}, list(sets))
    return resolve(load_site(SITE), load_job(data=data))


def _corpus(tmp: Path, n_tokens: int) -> tuple[Path, Path]:
    """A single token file and a 4-shard manifest, random uint16 tokens written in 4 Mi-token chunks."""
    from dslurm.data import tokenize as tk

    rng = np.random.default_rng(0)
    step = 1 << 22

    def chunks(n: int):
        for lo in range(0, n, step):
            yield rng.integers(0, VOCAB, min(step, n - lo), dtype=np.uint16)

    single = tk._write_atomic(tmp / "single.h5", chunks(n_tokens), vocab_size=VOCAB, seq_len=SEQ, source="bench")
    folder, q, shards = tmp / "shards", n_tokens // 4, []
    folder.mkdir()
    for i in range(4):
        tk._write_atomic(folder / f"shard-{i}.h5", chunks(q), vocab_size=VOCAB, seq_len=0, source="bench")
        shards.append({"path": f"shard-{i}.h5", "n_tokens": q})
    (folder / "manifest.json").write_text(json.dumps({
        "format": "dslurm-manifest", "version": 1, "vocab_size": VOCAB, "dtype": "uint16",
        "n_tokens": 4 * q, "shards": shards}))
    return single, folder / "manifest.json"


def drop_cache(*paths: Path) -> None:
    """Evict these files' pages from the page cache (theirs only: posix_fadvise DONTNEED), so the
    next read comes from the disk."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_read(path: Path) -> tuple[float, float]:
    """(tokens/s wall, tokens/s CPU) of reading the whole file sequentially in 16 MB `read`s."""
    size = path.stat().st_size
    t0, c0 = time.perf_counter(), time.process_time()
    fd = os.open(path, os.O_RDONLY)
    try:
        while os.read(fd, 16 << 20):
            pass
    finally:
        os.close(fd)
    return size / 2 / (time.perf_counter() - t0), size / 2 / max(1e-9, time.process_time() - c0)


def loader_rate(resolved, steps: int) -> tuple[float, float, float, float]:
    """One rank, the consumer doing nothing: (tokens/s wall, CPU) of `next_batch` (the batch as a
    CPU step gets it: int64 inputs and targets), then (wall, CPU) of the reader's own work (the
    ids and the reads into the staging buffer: what the background thread does per batch; on a
    GPU the widening to int64 is the device's)."""
    from train.data import make_loader

    loader = make_loader(resolved, 3, DP, rank=3)
    loader.next_batch()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        loader.next_batch()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    loader.close()
    t1, c1 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        loader._stage(loader.sampler.next_ids())
    r_wall, r_cpu = time.perf_counter() - t1, time.process_time() - c1
    tokens = steps * loader.local_batch * loader.seq_len
    return tokens / wall, tokens / cpu, tokens / r_wall, tokens / r_cpu


def data_wait(resolved, steps: int, compute_s: float) -> float:
    """Mean seconds a step waits in `next_batch` when each step computes for `compute_s`."""
    from train.data import make_loader

    loader = make_loader(resolved, 3, DP, rank=3)
    loader.next_batch()
    waited = 0.0
    for _ in range(steps):
        time.sleep(compute_s)  # the forward/backward: the reader runs meanwhile
        t0 = time.perf_counter()
        loader.next_batch()
        waited += time.perf_counter() - t0
    loader.close()
    return waited / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="batches timed per section")
    p.add_argument("--mtokens", type=int, default=64, help="corpus size in Mi tokens (uint16)")
    p.add_argument("--windows", type=int, default=4, help="windows of seq_len per step per rank (default 4)")
    args = p.parse_args()
    global LOCAL
    LOCAL = args.windows
    import torch  # loaded before any clock starts, as in a rank

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="bench-loader-"))
    single, manifest = _corpus(tmp, args.mtokens << 20)
    shards = sorted(manifest.parent.glob("*.h5"))
    drop_cache(single)
    raw_cold = raw_read(single)  # from the disk
    drop_cache(single)
    cold = loader_rate(_resolved(tmp, f"data.path={single}"), args.steps)  # from the disk, prefetch 2
    raw_before = raw_read(single)  # page-cached from here on (the loader's pass and this one read it)
    sections = {
        "single file, prefetch 2": (f"data.path={single}",),
        "4-shard manifest, prefetch 2": (f"data.path={manifest}",),
        "mixture 1:3 (manifest, file), val_fraction 0.01, prefetch 2": (
            f"data.sources=[{{path: {manifest}, weight: 1}}, {{path: {single}, weight: 3}}]",
            "data.val_fraction=0.01"),
        "single file, prefetch 0 (reads in the step)": (f"data.path={single}", "data.prefetch=0"),
    }
    rates = {name: loader_rate(_resolved(tmp, *sets), args.steps) for name, sets in sections.items()}
    raw_after = raw_read(single)
    raw, raw_cpu = (raw_before[0] + raw_after[0]) / 2, (raw_before[1] + raw_after[1]) / 2
    assert shards and raw_cold[0] > 0
    read_s = LOCAL * SEQ / rates["single file, prefetch 0 (reads in the step)"][0]
    wait_steps = max(20, args.steps // 10)
    waits = {k: data_wait(_resolved(tmp, f"data.path={single}", f"data.prefetch={k}"), wait_steps, 2 * read_s)
             for k in (0, 2)}
    print(f"one rank of dp {DP}: seq_len {SEQ}, {LOCAL} windows per step ({LOCAL * SEQ:,} tokens); corpus "
          f"{args.mtokens} Mi tokens uint16 ({single.stat().st_size / 1e6:.0f} MB), {args.steps} steps per section")
    print(f"raw sequential read of the file, page-cached: {raw:,.0f} tokens/s wall (before {raw_before[0]:,.0f}, "
          f"after {raw_after[0]:,.0f}), {raw_cpu:,.0f} CPU; from the disk (evicted first): {raw_cold[0]:,.0f} "
          f"wall, {raw_cold[1]:,.0f} CPU")
    print(f"consumption reference: {GPU_TOKENS_S:,.0f} tokens/s per GPU (8xH100 Llama-3 8B, torchtitan float8)")
    print("| data section | next_batch tokens/s wall / CPU | x GPU consumption (wall) | reader tokens/s wall / CPU "
          "| reader x raw read, wall / CPU |")
    print("|---|---|---|---|---|")
    for name, (wall, cpu, r_wall, r_cpu) in rates.items():
        print(f"| {name} | {wall:,.0f} / {cpu:,.0f} | **{wall / GPU_TOKENS_S:,.0f}x** | {r_wall:,.0f} / {r_cpu:,.0f} "
              f"| **{r_wall / raw:.2f}x** / **{r_cpu / raw_cpu:.2f}x** |")
    print(f"| single file from the disk (evicted first), prefetch 2 | {cold[0]:,.0f} / {cold[1]:,.0f} | "
          f"**{cold[0] / GPU_TOKENS_S:,.0f}x** | (next_batch against the disk read) | "
          f"**{cold[0] / raw_cold[0]:.2f}x** / **{cold[1] / raw_cold[1]:.2f}x** |")
    print(f"step's data wait, the step computing {2 * read_s * 1e3:.2f} ms (2x a batch's read): "
          f"prefetch 0 {waits[0] * 1e3:.3f} ms, prefetch 2 {waits[2] * 1e3:.3f} ms per step")
    worst = min(r[0] for name, r in rates.items() if "prefetch 2" in name)
    single_r = rates["single file, prefetch 2"]
    print(f"goal >= 20x consumption: {'met' if worst / GPU_TOKENS_S >= 20 else 'NOT met'} "
          f"(worst {worst / GPU_TOKENS_S:,.0f}x); goal >= 0.5x raw read (single file's reader, page-cached): "
          f"wall {single_r[2] / raw:.2f}x, CPU {single_r[3] / raw_cpu:.2f}x "
          f"({'met' if max(single_r[2] / raw, single_r[3] / raw_cpu) >= 0.5 else 'NOT met'})")


if __name__ == "__main__":
    main()
