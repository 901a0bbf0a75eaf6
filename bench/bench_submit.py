"""Submit-to-COMPLETED of a rendered 2-node job, as a ratio to `sbatch --wrap true`.

    .venv/bin/python bench/bench_submit.py [--runs 5]

On the built-in local real Slurm (brought up if it is not; left running). Both kinds of
job are submitted alternately in one run, 2 nodes each, and timed from submission until
the controller reports COMPLETED:
  - wrap:     sbatch --parsable -N2 --exclusive --wrap true
  - rendered: `dslurm submit` of a 2-node x 2-process job (torchrun + gloo, dslurm.launch.probe
              as the entry, burn-in off): render, freeze, sbatch, srun, dslurm launch,
              torchrun rendezvous, an all-reduce, requeue-me.
The ratio shows what the whole launch chain costs over Slurm's own turnaround.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from dslurm import cluster, slurm

ROOT = Path(__file__).resolve().parent.parent


def time_wrap(tmp: Path) -> float:
    t0 = time.monotonic()
    jid = slurm.sbatch(None, ["-N2", "--exclusive", f"--output={tmp}/wrap-%j.out", "--wrap", "true"])
    state = slurm.wait_job(jid, timeout=120, poll=0.1)
    assert state == "COMPLETED", state
    return time.monotonic() - t0


def time_rendered(tmp: Path, i: int) -> float:
    job = {"name": "bench", "nodes": 2, "time": "00:05:00", "entry": "dslurm.launch.probe",
           "preflight": {"enabled": False}, "checkpoint": {"run_dir": str(tmp / f"run{i}")}}
    spec = tmp / f"job{i}.yaml"
    spec.write_text(yaml.safe_dump(job))
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "dslurm", "submit", "--site", "site-configs/local.yaml",
                          "--job", str(spec)], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    jid = int(re.search(r"submitted job (\d+)", out).group(1))
    state = slurm.wait_job(jid, timeout=300, poll=0.1)
    assert state == "COMPLETED", state
    return time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    if not cluster.is_up():
        cluster.up(nodes=3, accounting=True)
    wrap, rendered = [], []
    with tempfile.TemporaryDirectory(prefix="dslurm-bench-") as d:
        tmp = Path(d)
        for i in range(args.runs):
            wrap.append(time_wrap(tmp))
            rendered.append(time_rendered(tmp, i))
    mw, mr = statistics.median(wrap), statistics.median(rendered)
    print(f"sbatch --wrap true (2 nodes)      : {mw:6.2f} s  median of {args.runs}")
    print(f"rendered 2-node x 2-proc dslurm job: {mr:6.2f} s  median of {args.runs}")
    print(f"ratio                              : {mr / mw:6.1f}x")


if __name__ == "__main__":
    main()
