"""Burn-in all-reduce busbw next to this machine's memcpy bandwidth, as a ratio.

    .venv/bin/python bench/bench_burnin.py [--nproc 2] [--mib 64]

gloo all-reduce between processes on one host moves data through shared memory/loopback, so
memcpy is its ceiling: the ratio says how much of the memory system the collective reaches
(on a GPU node the same comparison would be busbw vs NVLink bandwidth).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def memcpy_gbps(nbytes: int, iters: int = 10) -> dict[str, float]:
    """Copy bandwidth (bytes copied / time) with numpy and torch, best of `iters`."""
    import numpy as np
    import torch

    out = {}
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in before timing
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(iters))
    out["numpy"] = nbytes / best / 1e9
    t_src = torch.ones(nbytes, dtype=torch.uint8)
    t_dst = torch.empty_like(t_src)
    t_dst.copy_(t_src)
    best = min(_timed(lambda: t_dst.copy_(t_src)) for _ in range(iters))
    out["torch"] = nbytes / best / 1e9
    return out


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def burnin_busbw(nproc: int, nbytes: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "burnin.json"
        sizes = ",".join(str(s) for s in (1 << 20, 8 << 20, nbytes))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc-per-node={nproc}", "-m", "dslurm.preflight.run", "--report", str(report),
               "--sizes", sizes, "--iters", "10", "--exit-zero"]
        subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env={**os.environ})
        return json.loads(report.read_text())


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--mib", type=int, default=64, help="largest all-reduce / memcpy buffer")
    args = p.parse_args()
    nbytes = args.mib << 20
    rep = burnin_busbw(args.nproc, nbytes)
    node = rep["nodes"][0]
    mem = memcpy_gbps(nbytes)
    print(f"machine: {os.cpu_count()} cores; {args.nproc} gloo processes, one node")
    print(f"{'size':>10} {'time ms':>9} {'algbw GB/s':>11} {'busbw GB/s':>11}")
    for pt in node["intra"]:
        print(f"{pt['nbytes'] >> 20:>7} MiB {pt['seconds'] * 1e3:>9.2f} "
              f"{pt['algbw_gbps']:>11.3f} {pt['busbw_gbps']:>11.3f}")
    busbw = node["intra_busbw_gbps"]
    for name, bw in mem.items():
        print(f"memcpy ({name}, {args.mib} MiB): {bw:.2f} GB/s")
    best = max(mem.values())
    print(f"busbw / memcpy = {busbw:.3f} / {best:.2f} = {busbw / best:.3f}")
    gemm = min(g["tflops"] for g in node["gemm"]) * 1e3
    print(f"CPU GEMM (fp32 512^3, per process): {gemm:.2f} GFLOP/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
