"""`dslurm render` against `python -c pass` (goal <= 2x).

The two commands run alternately, N times each, and the medians are compared, so the
machine's noise hits both sides alike. Reported: wall seconds and the child's CPU seconds
(user + sys: on a shared machine wall time also counts the neighbours). `dslurm` is the
console script next to this interpreter (what a user types); without it, `python -m dslurm`.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_render.py [--runs 21] [--site S --job J]
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(argv: list[str]) -> tuple[float, float]:
    """(wall, CPU) seconds of one run."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=21)
    ap.add_argument("--site", default="site-configs/local.yaml")
    ap.add_argument("--job", default="examples/jobs/tiny-2node.yaml")
    args = ap.parse_args()
    script = shutil.which("dslurm", path=str(Path(sys.executable).parent))
    dslurm = [sys.executable, script] if script else [sys.executable, "-m", "dslurm"]
    render = [*dslurm, "render", "--site", args.site, "--job", args.job]
    baseline = [sys.executable, "-c", "pass"]
    timed(render), timed(baseline)  # warm the page cache and the .pyc files
    r, b = [], []
    for _ in range(args.runs):
        r.append(timed(render))
        b.append(timed(baseline))
    print(f"{' '.join(Path(a).name if a.startswith('/') else a for a in render)}")
    for i, what in ((0, "wall"), (1, "CPU")):
        mr, mb = statistics.median(x[i] for x in r), statistics.median(x[i] for x in b)
        print(f"{what:>4}: python -c pass {mb * 1000:6.1f} ms, dslurm render {mr * 1000:6.1f} ms "
              f"(medians of {args.runs}): {mr / mb:.2f}x (goal <= 2)")


if __name__ == "__main__":
    main()
