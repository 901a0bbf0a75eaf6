"""`model.init_from` load time against a raw read of the same safetensors bytes, and the peak memory
a rank gains while it loads its slice, in one process, one 629 MB Hugging Face directory.

    .venv/bin/python bench/bench_init_from.py [--dir /tmp/dslurm-bench-init-from] [--reps 3] [--threads 1] [--tiny]

The directory (a Llama of dim 1024, 8 layers, vocab 32768, fp32, 629 MB in 4 safetensors shards
with the index and config.json, written once) is what transformers' save_pretrained writes. Each repetition
runs, in alternating order, after os.sync() and for the cold rows posix_fadvise(DONTNEED) on every
file (the bytes come from the disk):
  raw        read every safetensors file once, 8 MiB reads, discarded (`cat > /dev/null`)
  raw_into   the same bytes pread into one resident buffer the size of the files: what writing
             the model's bytes into RAM costs (any load pays it; `raw` does not)
  init_from  dslurm.checkpoint.init_from.load into the whole model (one process holds all of it):
             header checks, every tensor pread straight into its parameter, q/k rows read
             into a buffer, reordered and copied
Ratios per repetition, then the median: init_from / raw (the issue's goal: <= 1.5) and
init_from / raw_into (init_from's own work beyond the memory it must fill).

Memory: the boxes rank r of an FSDP 4 x TP 2 layout holds (column-parallel weights cut by rows for
tp then for dp, row-parallel ones by columns for tp and rows for dp, as FSDP2 over TP DTensors cuts
them) are read with init_from.read_local into tensors allocated beforehand; VmHWM is reset through
/proc/self/clear_refs before, so the gain is what the reading itself costs beyond the slice.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dslurm.checkpoint import hf_layout, init_from  # noqa: E402
from dslurm.config import families  # noqa: E402
from dslurm.config.models import ModelShape  # noqa: E402
from train.model import build_model  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_checkpoint import evict  # noqa: E402

SHAPE = ModelShape(dim=1024, n_layers=8, n_heads=16, n_kv_heads=4, ffn_dim=2816, vocab_size=32768, seq_len=256)
# --tiny (the suite's run, seconds): the same layout at a few MB, no ratio worth quoting
TINY = ModelShape(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=256, vocab_size=1024, seq_len=64)
_CHUNK = 8 << 20
_ROW_PARALLEL = ("attention.wo.weight", "feed_forward.w2.weight")


def make_dir(d: Path) -> Path:
    if (d / "config.json").is_file():
        return d
    d.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    tensors = {hf_layout.hf_name(n): torch.randn(s) for n, s in hf_layout.full_shapes(SHAPE).items()}
    names = sorted(tensors)
    per = -(-len(names) // 4)
    weight_map = {}
    for i in range(4):
        f = f"model-{i + 1:05d}-of-00004.safetensors"
        group = names[i * per:(i + 1) * per]
        save_file({n: tensors[n] for n in group}, str(d / f), metadata={"format": "pt"})
        weight_map |= {n: f for n in group}
    (d / init_from.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (d / "config.json").write_text(json.dumps(families.hf_config(SHAPE, "float32")))
    return d


def files(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def raw(d: Path) -> float:
    buf = bytearray(_CHUNK)
    t = time.perf_counter()
    for p in files(d):
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buf):
                pass
    return time.perf_counter() - t


def raw_into(d: Path, dest: torch.Tensor) -> float:
    """The same bytes pread into memory that stays (a touched buffer the size of the files): the
    floor of any load, which writes the model's bytes into RAM, where `raw` reuses one 8 MiB buffer."""
    view = dest.numpy().data
    t = time.perf_counter()
    pos = 0
    for p in files(d):
        fd = os.open(p, os.O_RDONLY)
        try:
            size, off = p.stat().st_size, 0
            while off < size:
                off += os.preadv(fd, [view[pos + off:pos + min(size, off + (64 << 20))]], off)
        finally:
            os.close(fd)
        pos += size
    return time.perf_counter() - t


def load(d: Path, model: torch.nn.Module) -> float:
    t = time.perf_counter()
    got = init_from.load(d, SHAPE, [model])
    dt = time.perf_counter() - t
    assert got.bytes_read == sum(p.numel() * 4 for p in model.parameters()), "read more than the model"
    return dt


def _cut(n: int, parts: int, i: int) -> tuple[int, int]:
    step = -(-n // parts)
    return min(i * step, n), min((i + 1) * step, n) - min(i * step, n)


def box(name: str, shape: tuple[int, ...], dp_r: int, tp_r: int, dp: int = 4, tp: int = 2) -> tuple[tuple, tuple]:
    """(offset, size) of rank (dp_r, tp_r)'s local shard of one parameter."""
    if len(shape) == 1:  # norms: replicated over tp, Shard(0) over dp
        o, s = _cut(shape[0], dp, dp_r)
        return (o,), (s,)
    if name.endswith(_ROW_PARALLEL):
        ro, rs = _cut(shape[0], dp, dp_r)
        co, cs = _cut(shape[1], tp, tp_r)
        return (ro, co), (rs, cs)
    to, ts = _cut(shape[0], tp, tp_r)
    do, ds = _cut(ts, dp, dp_r)
    return (to + do, 0), (ds, shape[1])


def status(key: str) -> int:
    m = re.search(key + r":\s+(\d+) kB", Path("/proc/self/status").read_text())
    return int(m.group(1)) * 1024 if m else 0


def rank_memory(d: Path, dp_r: int, tp_r: int) -> tuple[int, int]:
    """(peak RSS gained while reading, the slice's bytes) for one rank's boxes."""
    entries = init_from.open_dir(d)
    want = init_from.wanted(SHAPE, hf=True)
    full = hf_layout.full_shapes(SHAPE)
    boxes = {n: box(n, full[n], dp_r, tp_r) for n in want}
    locals_ = {n: torch.empty(b[1]) for n, b in boxes.items()}
    for t in locals_.values():
        t.zero_()  # touched: the slice is resident before the measurement starts
    Path("/proc/self/clear_refs").write_text("5")
    before = status("VmRSS")
    for n, (off, size) in boxes.items():
        src, heads = want[n]
        locals_[n].copy_(init_from.read_local(entries[src], off, size, heads))
    gained = status("VmHWM") - before
    return gained, sum(t.numel() * 4 for t in locals_.values())


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/dslurm-bench-init-from"))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1, as each worker of "
                    "the tests runs: OMP_NUM_THREADS=1)")
    ap.add_argument("--tiny", action="store_true", help="a model of a few MB (the suite's check that the bench runs)")
    args = ap.parse_args()
    if args.tiny:
        global SHAPE
        SHAPE = TINY
        args.dir = args.dir.with_name(args.dir.name + "-tiny")
    torch.set_num_threads(args.threads)
    d = make_dir(args.dir)
    mb = sum(p.stat().st_size for p in files(d)) / 1e6
    model = build_model(SHAPE, 0)
    dest = torch.ones(sum(p.stat().st_size for p in files(d)), dtype=torch.uint8)  # touched: resident
    rows: list[dict[str, float]] = []
    for rep in range(args.reps):
        row: dict[str, float] = {}
        order = [("raw", lambda: raw(d)), ("raw_into", lambda: raw_into(d, dest)),
                 ("init_from", lambda: load(d, model))]
        for name, fn in order if rep % 2 == 0 else order[::-1]:
            for cold in (True, False):
                if cold:
                    evict(d)
                row[name + ("" if cold else "_warm")] = fn()
        rows.append(row)
        print("  rep %d: %s" % (rep, ", ".join(f"{k} {v:.3f}" for k, v in row.items())), flush=True)
    print(f"directory: {mb:.0f} MB in {len(files(d))} safetensors files, median of {args.reps} alternating reps")
    for suffix, what in (("", "cold"), ("_warm", "warm")):
        ratio = statistics.median(r["init_from" + suffix] / r["raw" + suffix] for r in rows)
        t_raw = statistics.median(r["raw" + suffix] for r in rows)
        t_load = statistics.median(r["init_from" + suffix] for r in rows)
        into = statistics.median(r["init_from" + suffix] / r["raw_into" + suffix] for r in rows)
        print(f"{what}: raw read {t_raw:.3f} s ({mb / t_raw:.0f} MB/s), init_from {t_load:.3f} s: "
              f"init_from / raw read {ratio:.2f} (goal <= 1.5); init_from / raw read into resident memory "
              f"{into:.2f}")
    model_bytes = sum(p.stat().st_size for p in files(d))
    for dp_r, tp_r in ((0, 0), (3, 1)):
        gained, slice_ = rank_memory(d, dp_r, tp_r)
        print(f"rank (dp {dp_r}, tp {tp_r}) of FSDP 4 x TP 2: peak RSS gained while reading {gained / 2**20:.1f} MiB "
              f"for its slice of {slice_ / 2**20:.1f} MiB ({gained / slice_:.2f}x the slice; the model is "
              f"{model_bytes / 2**20:.0f} MiB)")
        assert args.tiny or gained < model_bytes / 2, "a rank read far more than its slice"
    return 0


if __name__ == "__main__":
    sys.exit(main())
