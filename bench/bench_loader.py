"""One rank's loader tokens/s with prefetch, against a GPU's consumption and a raw read of the file.

The rank is one data-parallel rank of an 8-GPU 8B run: seq_len 8192, 4 windows per step
(global batch 32 over dp 8). Consumption reference: 8,500 tokens/s per GPU, an 8xH100 Llama-3
8B run's (torchtitan's published float8 figure, a constant: not measured here, so its ratios are
arithmetic on a measured rate); goal: the loader >= 20x that. What is measured instead of a GPU:
the step's `data` wait (below). Raw read: the same token
file read sequentially in 16 MB calls, page-cached as the loader's reads are, two ways: `read`
(a new buffer each call, as `f.read` does) and `readinto` one reused buffer (the fastest a
sequential reader gets); goal: the loader's reader >= 0.5x the raw read.

Phases, checked: the cold section first (the file's pages evicted, checked with RWF_NOWAIT
reads: a cached page answers them, an evicted one refuses), then the whole file read once
untimed and checked cached before any page-cached figure. Each section (all `make_loader`,
`data.prefetch` 2 unless said: a single token file, a 4-shard manifest (windows across shard
boundaries), a mixture 1:3 (manifest, file) with val_fraction 0.01, and the single file with
prefetch 0, reads in the step; then the three prefetch sections again with `data.shuffle_block`
`--block` (4: a rank's 4 windows of a step are one block, one read; the mixture without
val_fraction, whose split scatters a block's windows)) runs `--rounds` times, each round side by side: raw `read`,
raw `readinto`, `next_batch` over `--steps` batches, the reader's own work over `--steps`
batches (`TokenLoader.batches`, what the background thread runs, on a loader of its own), each
after one warm-up batch, each loader fresh; the best of the rounds is kept on both sides
(the least disturbed by the machine's other load), the raw read's over all sections (the
stricter side). The batches read are checked against h5py's. Four sections read with
`data.read: mmap` (a copy per window from the file's memory map: the single file, the manifest,
the mixture, the single file with 2 read threads; each loader maps its page-cached file whole
in its untimed warm-up batch, a one-time cost the mmap floor line reports). Floors: the single
file reader's windows read by nothing but one bare `os.preadv` each; by one slice copy each from a fresh map (mapped as
touched), then again (the pages mapped), with the time to map the file whole; and the call and
the copy from the disk. Then the step's `data` wait:
a consumer that "computes" for 2x a batch's read time per step, with and without prefetch.

    .venv/bin/python bench/bench_loader.py [--steps 300] [--mtokens 64] [--windows 4] [--rounds 3] [--block 4]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
SITE = ROOT / "site-configs" / "local.yaml"

from dslurm.data.tokenize import cached_share  # noqa: E402

SEQ, DP = 8192, 8
LOCAL = 4  # windows per step per rank (--windows)
GPU_TOKENS_S = 8500.0
PER_BATCH = "a batch per read call"  # sections read as before batches were read in groups
KEPT = 0.0  # the share of the file's pages an eviction leaves cached here (a file system may keep them all)
COLD_THREADS = 8  # a from-the-disk section with this many read threads: the queue depth a device serves
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


def _cached(path: Path) -> float:
    """The share of the file's pages in the page cache (sampled: dslurm.data.tokenize.cached_share)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return cached_share(fd)
    finally:
        os.close(fd)


def raw_read(path: Path, reuse: bool) -> tuple[float, float]:
    """(tokens/s wall, tokens/s CPU) of reading the whole file sequentially in 16 MB calls: `read`
    (a new buffer each call) or, with `reuse`, `readinto` one buffer."""
    size, block = path.stat().st_size, 16 << 20
    buf = memoryview(bytearray(block)) if reuse else None
    t0, c0 = time.perf_counter(), time.process_time()
    fd = os.open(path, os.O_RDONLY)
    try:
        if buf is None:
            while os.read(fd, block):
                pass
        else:
            while os.readv(fd, [buf]):
                pass
    finally:
        os.close(fd)
    return size / 2 / (time.perf_counter() - t0), size / 2 / max(1e-9, time.process_time() - c0)


def loader_rate(resolved, steps: int, evict: tuple[Path, ...] = ()) -> tuple[float, float, float, float]:
    """One rank, the consumer doing nothing: (tokens/s wall, CPU) of `next_batch` (the batch as a
    CPU step gets it: int64 inputs and targets), then (wall, CPU) of the reader's own work on a
    fresh loader: `TokenLoader.batches`, what the background thread runs (the ids, the reads into
    the staging buffer), or for prefetch 0 the step's own read; on a GPU the widening to int64 is
    the device's. `evict`: files dropped from the page cache before each part (the cold section)."""
    import dataclasses

    from train.data import make_loader

    _evict(evict)
    loader = make_loader(resolved, 3, DP, rank=3)
    loader.next_batch()
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(steps):
        loader.next_batch()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    loader.close()
    _close(loader)  # a mapped page is not evicted: the cold reader must not find the first pass's pages
    _evict(evict)
    reader = make_loader(resolved, 3, DP, rank=3)
    rows = [0]  # windows read: the reader reads a group of batches per call, handed out one by one
    staged = reader._staged

    def counted(plan, lo: int, hi: int):
        rows[0] += hi - lo
        return staged(plan, lo, hi)

    reader._staged = counted  # type: ignore[method-assign]
    handed = [0]
    if reader.prefetch:
        warm = reader.batches(dataclasses.replace(reader.sampler))
        _check(reader, next(warm))  # the first call's costs, untimed, and the batch checked
        batches = reader.batches(dataclasses.replace(reader.sampler))  # the clock starts at a group's start

        def one() -> None:
            next(batches)
            handed[0] += 1
    else:
        def one() -> None:  # what next_batch reads in the step
            position = int(reader.sampler.stream_position)
            reader._read_in_step(position, reader.sampler.next_ids())
            handed[0] += 1
        one()
    t1, c1, before, handed[0] = time.perf_counter(), time.process_time(), rows[0], 0
    for _ in range(steps):
        one()
    while handed[0] * reader.local_batch < rows[0] - before:  # to the end of the group last read
        one()
    r_wall, r_cpu = time.perf_counter() - t1, time.process_time() - c1
    # every window read inside the clock was handed out inside it, and none read before it was
    assert handed[0] * reader.local_batch == rows[0] - before, (handed[0], rows[0] - before)
    r_tokens = (rows[0] - before) * reader.seq_len
    _close(reader)
    tokens = steps * loader.local_batch * loader.seq_len
    return tokens / wall, tokens / cpu, r_tokens / r_wall, r_tokens / r_cpu


def _evict(paths: tuple[Path, ...]) -> None:
    """drop_cache, checked: a page still mapped (a map not yet gone) stays cached."""
    drop_cache(*paths)
    left = max((_cached(path) for path in paths), default=0.0)
    assert left <= KEPT + 0.05, (f"{left:.0%} of the pages still cached after the eviction ({KEPT:.0%} the first "
                                 "time): the cold part would not be cold")


def _close(loader) -> None:
    """Close the loader's files, its memory maps (`data.read: mmap`) with them: the plans that hold
    a view of a map go first, so that the map (and the pin on its pages) goes."""
    import gc

    loader._step_plans = {}
    gc.collect()
    for source in loader.sources:
        for f in source.files:
            f.close()


def floor_rate(resolved, steps: int, evict: tuple[Path, ...] = ()) -> tuple[float, float, float, float]:
    """The same windows as the single file's reader reads (its first `steps` batches), with nothing
    but the reads, the offsets listed before the clock starts: tokens/s of one bare `os.preadv` per
    window into a reused buffer, then of one bare slice copy per window from a fresh read-only memory
    map of the file (its first touches included), then the same copies again (the pages mapped), and
    the seconds to map the whole file at once (MAP_POPULATE). What random seq_len windows cost this
    machine: the floor under any loader that reads them one at a time. `evict`: from the disk (the
    first two)."""
    import dataclasses
    import mmap

    from train.data import make_loader

    loader = make_loader(resolved, 3, DP, rank=3)
    sampler = dataclasses.replace(loader.sampler)
    plan = loader.plan(np.concatenate([sampler.next_ids() for _ in range(steps)]))
    offsets = np.asarray(plan.offset["tokens"])
    assert (offsets >= 0).mean() > 0.95, "the floor is of the windows the reader reads in one call each"
    off, width = offsets[offsets >= 0].tolist(), (loader.seq_len + 1) * 2
    path = loader.sources[0].files[0].path
    _close(loader)
    buf = memoryview(bytearray(width))
    row = np.empty(width, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        _evict(evict)
        t0 = time.perf_counter()
        for o in off:
            os.preadv(fd, [buf], o)
        called = time.perf_counter() - t0
        _evict(evict)
        t0 = time.perf_counter()
        mm = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
        view = np.frombuffer(mm, dtype=np.uint8)
        for o in off:
            row[:] = view[o:o + width]
        copied = time.perf_counter() - t0
        t0 = time.perf_counter()  # again: every page now mapped (a later epoch over a page-cached corpus)
        for o in off:
            row[:] = view[o:o + width]
        again = time.perf_counter() - t0
        del view
        mm.close()
        t0 = time.perf_counter()  # the whole file mapped at once, as `TokenFile.mapped` does a page-cached one
        mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, prot=mmap.PROT_READ)
        populate = time.perf_counter() - t0
        mm.close()
    finally:
        os.close(fd)
    tokens = len(off) * loader.seq_len
    return tokens / called, tokens / copied, tokens / again, populate


def _check(loader, item) -> None:
    """The reader's batch is the windows h5py reads for its ids (the figure is of real reads)."""
    import h5py

    _, ids, batch = item
    src, sample = (np.zeros(len(ids), np.int64), ids) if loader.space is None else loader.space.locate(ids)
    for k in (0, len(ids) - 1):
        source, start = loader.sources[int(src[k])], int(sample[k]) * loader.seq_len
        f = int(np.searchsorted(source.starts, start, side="right")) - 1
        if start + loader.seq_len + 1 > source.starts[f + 1]:
            continue  # across two shards: the loader's own tests cover it
        with h5py.File(source.files[f].path, "r") as h:
            want = h["tokens"][start - source.starts[f]:start - source.starts[f] + loader.seq_len + 1]
        assert np.array_equal(batch["tokens"][k], want), "the reader's batch is not the file's windows"


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
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000, help="batches timed per section")
    p.add_argument("--mtokens", type=int, default=256, help="corpus size in Mi tokens (uint16; default 256: an "
                   "epoch of 1,024 steps holds the reader's whole plan of ~4,096 windows, as a real corpus does)")
    p.add_argument("--windows", type=int, default=4, help="windows of seq_len per step per rank (default 4)")
    p.add_argument("--rounds", type=int, default=3, help="side-by-side rounds per section, best kept")
    p.add_argument("--block", type=int, default=4, help="data.shuffle_block of the block sections (1: none)")
    p.add_argument("--threads", type=int, default=1,
                   help="data.read_threads of every section that does not say (default 1, the default)")
    args = p.parse_args()
    global LOCAL
    LOCAL = args.windows
    import torch  # loaded before any clock starts, as in a rank

    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="bench-loader-"))
    atexit.register(shutil.rmtree, tmp, True)  # the corpora (0.5-1 GB) go with the bench, whatever its end
    single, manifest = _corpus(tmp, args.mtokens << 20)
    shards = sorted(manifest.parent.glob("*.h5"))
    # cold: from the disk, checked evicted (a file system that keeps it cached is said so)
    drop_cache(single)
    evicted = 1 - _cached(single)
    global KEPT
    KEPT = 1 - evicted
    raw_cold = raw_read(single, reuse=True)
    colds = {k: loader_rate(_resolved(tmp, f"data.path={single}", f"data.read_threads={k}"), args.steps,
                            evict=(single,)) for k in (args.threads, 2, COLD_THREADS)}
    # data.read: mmap from the disk by its bare floor only: a loader section with a map failed its
    # eviction check (the pages stayed mapped between the parts; the cause is not pinned down)
    cold_floor = floor_rate(_resolved(tmp, f"data.path={single}"), args.steps, evict=(single,))
    # page-cached from here on: every file read once, untimed, and checked
    for path in (single, *shards):
        raw_read(path, reuse=True)
    cached = min(_cached(path) for path in (single, *shards))
    assert cached == 1.0, f"the files are not all page-cached ({cached:.0%}): the warm figures would read the disk"
    threads = f"data.read_threads={args.threads}"
    sections = {
        "single file, prefetch 2": (f"data.path={single}",),
        f"single file, prefetch 2, {PER_BATCH}": (f"data.path={single}",),
        "4-shard manifest, prefetch 2": (f"data.path={manifest}",),
        "mixture 1:3 (manifest, file), val_fraction 0.01, prefetch 2": (
            f"data.sources=[{{path: {manifest}, weight: 1}}, {{path: {single}, weight: 3}}]",
            "data.val_fraction=0.01"),
        "single file, prefetch 0 (reads in the step)": (f"data.path={single}", "data.prefetch=0"),
        "single file, read_threads 2, prefetch 2": (f"data.path={single}", "data.read_threads=2"),
        # data.read: mmap, a copy per window from the file's memory map instead of a call
        "single file, mmap, prefetch 2": (f"data.path={single}", "data.read=mmap"),
        "4-shard manifest, mmap, prefetch 2": (f"data.path={manifest}", "data.read=mmap"),
        "mixture 1:3 (manifest, file), val_fraction 0.01, mmap, prefetch 2": (
            f"data.sources=[{{path: {manifest}, weight: 1}}, {{path: {single}, weight: 3}}]",
            "data.val_fraction=0.01", "data.read=mmap"),
        "single file, mmap, read_threads 2, prefetch 2": (f"data.path={single}", "data.read=mmap",
                                                          "data.read_threads=2"),
    }
    if args.block > 1:  # blocks of adjacent windows: a rank's block is one read (data.shuffle_block)
        k = args.block
        sections |= {
            f"single file, shuffle_block {k}, prefetch 2": (f"data.path={single}", f"data.shuffle_block={k}"),
            f"single file, shuffle_block {k}, prefetch 2, {PER_BATCH}": (
                f"data.path={single}", f"data.shuffle_block={k}"),
            f"single file, shuffle_block {k}, read_threads 2, prefetch 2": (
                f"data.path={single}", f"data.shuffle_block={k}", "data.read_threads=2"),
            f"4-shard manifest, shuffle_block {k}, prefetch 2": (f"data.path={manifest}", f"data.shuffle_block={k}"),
            f"mixture 1:3 (manifest, file), shuffle_block {k}, prefetch 2": (
                f"data.sources=[{{path: {manifest}, weight: 1}}, {{path: {single}, weight: 3}}]",
                f"data.shuffle_block={k}"),
        }
    rates, raws = {}, {}
    import train.reader as reader

    for name, sets in sections.items():
        # "a batch per read call": the reader as it was before it read groups of batches (READ_GROUP_BYTES)
        group = 1 if name.endswith(PER_BATCH) else reader.READ_GROUP_BYTES
        rounds = []
        for _ in range(args.rounds):
            reader.READ_GROUP_BYTES, kept = group, reader.READ_GROUP_BYTES
            try:
                rounds.append((raw_read(single, reuse=False), raw_read(single, reuse=True),
                               loader_rate(_resolved(tmp, threads, *sets), args.steps)))
            finally:
                reader.READ_GROUP_BYTES = kept
        raws[name] = tuple(tuple(max(r[i][j] for r in rounds) for j in range(2)) for i in range(2))
        rates[name] = tuple(max(r[2][j] for r in rounds) for j in range(4))
        if name == "single file, prefetch 2":
            floors = [floor_rate(_resolved(tmp, *sets), args.steps) for _ in range(args.rounds)]
            floor, mapped_floor, remapped = (max(f[i] for f in floors) for i in range(3))
            populate_s = min(f[3] for f in floors)
    read_s = LOCAL * SEQ / rates["single file, prefetch 0 (reads in the step)"][0]
    wait_steps = max(20, args.steps // 10)
    waits = {k: data_wait(_resolved(tmp, f"data.path={single}", f"data.prefetch={k}"), wait_steps, 2 * read_s)
             for k in (0, 2)}
    plain = max(r[0][0] for r in raws.values()), max(r[0][1] for r in raws.values())
    reuse = max(r[1][0] for r in raws.values()), max(r[1][1] for r in raws.values())
    print(f"one rank of dp {DP}: seq_len {SEQ}, {LOCAL} windows per step ({LOCAL * SEQ:,} tokens); corpus "
          f"{args.mtokens} Mi tokens uint16 ({single.stat().st_size / 1e6:.0f} MB), {args.steps} steps per section, "
          f"best of {args.rounds} rounds")
    print(f"raw sequential read of the file, page-cached (best over all sections' rounds; every ratio below is "
          f"against it, the stricter side): `read` {plain[0]:,.0f} "
          f"tokens/s wall ({plain[1]:,.0f} CPU), `readinto` one buffer {reuse[0]:,.0f} wall ({reuse[1]:,.0f} CPU); "
          f"from the disk ({evicted:.0%} of the pages evicted first): {raw_cold[0]:,.0f} wall, {raw_cold[1]:,.0f} CPU")
    print(f"consumption reference (published, not measured): {GPU_TOKENS_S:,.0f} tokens/s per GPU "
          "(8xH100 Llama-3 8B, torchtitan float8)")
    print("| data section | next_batch tokens/s wall / CPU | x published GPU rate (wall) | reader tokens/s wall / CPU "
          "| reader x raw `read`, wall / CPU | reader x raw `readinto`, wall / CPU |")
    print("|---|---|---|---|---|---|")
    for name, (wall, cpu, r_wall, r_cpu) in rates.items():
        (pw, pc), (uw, uc) = plain, reuse
        print(f"| {name} | {wall:,.0f} / {cpu:,.0f} | **{wall / GPU_TOKENS_S:,.0f}x** | {r_wall:,.0f} / {r_cpu:,.0f} "
              f"| **{r_wall / pw:.2f}x** / {r_cpu / pc:.2f}x | **{r_wall / uw:.2f}x** / {r_cpu / uc:.2f}x |")
    for k, cold in colds.items():
        print(f"| single file from the disk ({evicted:.0%} evicted first), read_threads {k}, prefetch 2 | "
              f"{cold[0]:,.0f} / {cold[1]:,.0f} | **{cold[0] / GPU_TOKENS_S:,.0f}x** | {cold[2]:,.0f} / {cold[3]:,.0f} "
              f"| (against the disk read, `readinto`) | **{cold[2] / raw_cold[0]:.2f}x** / "
              f"{cold[3] / raw_cold[1]:.2f}x |")
    uw = reuse[0]
    print(f"floor, the single file reader's windows with nothing but one bare `os.preadv` each (page-cached): "
          f"{floor:,.0f} tokens/s, **{floor / uw:.2f}x** raw `readinto`; the reader ({args.threads} read thread(s)) is "
          f"**{rates['single file, prefetch 2'][2] / floor:.2f}x** the floor, with 2 "
          f"**{rates['single file, read_threads 2, prefetch 2'][2] / floor:.2f}x**")
    print(f"mmap floor, the same windows with nothing but one slice copy each from a fresh memory map, mapped as "
          f"touched: "
          f"{mapped_floor:,.0f} tokens/s, **{mapped_floor / uw:.2f}x** raw `readinto`, **{mapped_floor / floor:.2f}x** "
          f"the call floor; the same copies again, the pages mapped: **{remapped / floor:.2f}x** the call floor, "
          f"which the mmap reader is at (the file page-cached, `TokenFile.mapped` maps it whole at its start: "
          f"{populate_s * 1e3:.0f} ms, {populate_s * reuse[0] * 2 / single.stat().st_size:.2f}x a sequential read "
          f"of it), **{rates['single file, mmap, prefetch 2'][2] / remapped:.2f}x**; "
          f"from the disk ({evicted:.0%} evicted first) a copy per window is "
          f"**{cold_floor[1] / cold_floor[0]:.2f}x** a call per window ({cold_floor[0]:,.0f} vs {cold_floor[1]:,.0f} "
          f"tokens/s)")
    print(f"step's data wait, the step computing {2 * read_s * 1e3:.2f} ms (2x a batch's read): "
          f"prefetch 0 {waits[0] * 1e3:.3f} ms, prefetch 2 {waits[2] * 1e3:.3f} ms per step")
    worst = min(r[0] for name, r in rates.items() if "prefetch 2" in name)
    goal = {name: (rates[name][2] / reuse[0], rates[name][3] / reuse[1]) for name in sections if "prefetch 2" in name}
    print(f"goal >= 20x the published consumption (arithmetic, not measured): "
          f"{'met' if worst / GPU_TOKENS_S >= 20 else 'NOT met'} "
          f"(worst {worst / GPU_TOKENS_S:,.0f}x); goal >= 0.5x raw read (reader, page-cached, against `readinto`), "
          f"wall / CPU: " + "; ".join(f"{what.removesuffix(', prefetch 2')} {a:.2f}x / {b:.2f}x"
                                      for what, (a, b) in goal.items()))


if __name__ == "__main__":
    main()
