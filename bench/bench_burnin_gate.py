"""The burn-in gate's cost inside the demo job, on the built-in local Slurm, in one run:

    .venv/bin/python bench/bench_burnin_gate.py [--steps 20]

Runs the demo job (examples/jobs/tiny-2node.yaml: 2 nodes x 2 processes, 2x2 FSDP x TP,
burn-in on) and reads its ledger and burn-in report. Prints the burn-in's duration as a
ratio to one training step of the same job (median step time), and the inter-node busbw
it measured next to this machine's memcpy bandwidth (the ceiling of a gloo all-reduce
between processes on one host). bench/bench_burnin.py measures the same busbw outside Slurm.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    from bench_burnin import memcpy_gbps

    from dslurm import cluster, slurm
    from dslurm.config.resolve import load
    from dslurm.observe import events as ev
    from dslurm.submission import submit

    if not cluster.is_up():
        cluster.up(nodes=3, accounting=True)
    run = Path(tempfile.mkdtemp(prefix="dslurm-bench-burnin-"))
    r = load(ROOT / "site-configs/local.yaml", ROOT / "examples/jobs/tiny-2node.yaml",
             [f"checkpoint.run_dir={run}", f"train.steps={args.steps}", "train.log_every=1"], base_dir=ROOT)
    import os

    os.chdir(ROOT)
    job = submit(r).job_id
    state = slurm.wait_job(job, timeout=600, poll=1)
    history = ev.read(run)
    pre = next(ev.of(history, ev.Preflight))
    steps = [e.step_time_s for e in ev.of(history, ev.Steps) if e.step_time_s is not None][1:]  # 1st warms up
    step = statistics.median(steps)
    report = json.loads(Path(str(pre.report)).read_text())
    busbw = report["inter"]["busbw_gbps"]
    mem = max(memcpy_gbps(64 << 20).values())
    print(f"job {job} {state}, run dir {run}")
    print(f"burn-in (in the training processes): {pre.duration_s:.2f} s; median training step {step:.3f} s; "
          f"ratio {pre.duration_s / step:.1f} steps")
    print(f"inter-node all-reduce busbw {busbw:.3f} GB/s; memcpy {mem:.2f} GB/s; ratio {busbw / mem:.3f}")


if __name__ == "__main__":
    main()
