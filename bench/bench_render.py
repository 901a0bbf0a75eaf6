"""`dslurm render` wall time as a ratio to `python -c pass` (goal <= 2).

Both commands run alternately in one process, N times each, and the medians are
compared, so machine noise hits both sides alike.

    .venv/bin/python bench/bench_render.py [--runs 15]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(argv: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=15)
    args = ap.parse_args()
    render = [sys.executable, "-m", "dslurm", "render", "--site", "site-configs/h100-ib.yaml",
              "--job", "examples/jobs/llama70b-h100.yaml"]
    baseline = [sys.executable, "-c", "pass"]
    timed(render), timed(baseline)  # warm the page cache
    r, b = [], []
    for _ in range(args.runs):
        r.append(timed(render))
        b.append(timed(baseline))
    mr, mb = statistics.median(r), statistics.median(b)
    print(f"python -c pass : {mb * 1000:7.1f} ms (median of {args.runs})")
    print(f"dslurm render  : {mr * 1000:7.1f} ms (median of {args.runs})")
    print(f"ratio          : {mr / mb:7.2f}x   (goal <= 2)")


if __name__ == "__main__":
    main()
