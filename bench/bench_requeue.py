"""The requeue chain's cost on the built-in local Slurm, in one run:

    .venv/bin/python bench/bench_requeue.py [--steps 300] [--step-sleep 0.3] [--preemptions 2]

Runs examples/preempt_demo.py (the demo job: 2 nodes x 2 processes, 2x2 FSDP x TP, burn-in
on, interrupted `--preemptions` times while training) and reads its ledger with
`dslurm.observe.report.summarize`. Prints:
  - restart-to-first-step of each restart as a ratio to the cold start's start-to-first-step
    (goal <= 1.3): both measured from the start's begin to its first step, burn-in included;
  - goodput (productive training time over wall time, queue wait excluded) with the length
    of training stated (goal >= 0.9 for >= 3 minutes of training with 2 preemptions).
`--step-sleep` stretches each step (the tiny model's step takes ~0.5 s here) so the run
trains for minutes without a bigger model.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--step-sleep", type=float, default=0.3)
    ap.add_argument("--preemptions", type=int, default=2)
    args = ap.parse_args()
    from dslurm import cluster
    from dslurm.observe import events
    from dslurm.observe.report import summarize

    if not cluster.is_up():
        cluster.up(nodes=3, accounting=True)
    run_dir = Path(tempfile.mkdtemp(prefix="dslurm-bench-requeue-"))
    subprocess.run([sys.executable, "examples/preempt_demo.py", "--steps", str(args.steps),
                    "--step-sleep", str(args.step_sleep), "--preemptions", str(args.preemptions),
                    "--run-dir", str(run_dir)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    sm = summarize(events.read(run_dir))
    starts = [s for s in sm.starts if s.resumed_from is not None]
    cold = starts[0].overhead_s
    print(f"run dir: {run_dir}")
    print(f"cold start -> first step          : {cold:6.1f} s (burn-in {starts[0].burnin_s:.1f} s)")
    for s in starts[1:]:
        print(f"restart {s.restart} -> first step            : {s.overhead_s:6.1f} s "
              f"(burn-in {s.burnin_s:.1f} s)  ratio {s.overhead_s / cold:5.2f}  (goal <= 1.3)")
    print(f"training (productive)             : {sm.productive_s:6.1f} s over {sm.final_step} steps")
    print(f"wall (queue wait {sm.queue_wait_s:.1f} s excluded)   : {sm.wall_s:6.1f} s")
    print(f"restarts {sm.restarts}, lost steps {sm.lost_steps}, checkpoint stalls {sm.checkpoint_overhead_s:.1f} s")
    print(f"goodput                           : {sm.goodput:6.3f}  (goal >= 0.9 for >= 180 s of training)")


if __name__ == "__main__":
    main()
