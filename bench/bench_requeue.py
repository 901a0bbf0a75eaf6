"""The requeue chain's cost on the built-in local Slurm, in one run:

    .venv/bin/python bench/bench_requeue.py [--steps 300] [--step-sleep 0.3] [--preemptions 2] [--tiny]

Runs examples/preempt_demo.py (the demo job: 2 nodes x 2 processes, 2x2 FSDP x TP, burn-in
on, interrupted `--preemptions` times while training) and reads its ledger with
`dslurm.observe.report.summarize`. Prints:
  - restart-to-first-step of each restart as a ratio to the cold start's start-to-first-step
    (goal <= 1.3): both measured from the start's begin to its first step done
    (`dslurm.observe.endpoints.start_phases`, the report's rule), burn-in included; a start
    whose phases (job_start, train_start, first step) are out of order fails the bench;
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
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--step-sleep", type=float, default=0.3)
    ap.add_argument("--preemptions", type=int, default=2)
    ap.add_argument("--tiny", action="store_true",
                    help="the suite's smoke run (tests/cluster/test_cluster_benches.py): 12 steps, 1 preemption")
    args = ap.parse_args()
    if args.tiny:
        args.steps, args.step_sleep, args.preemptions = 12, 0.0, 1
    from dslurm import cluster
    from dslurm.observe import endpoints, events
    from dslurm.observe.report import summarize

    if not cluster.is_up():
        cluster.up(nodes=3, accounting=True)
    run_dir = Path(tempfile.mkdtemp(prefix="dslurm-bench-requeue-"))
    subprocess.run([sys.executable, "examples/preempt_demo.py", "--steps", str(args.steps),
                    "--step-sleep", str(args.step_sleep), "--preemptions", str(args.preemptions),
                    "--run-dir", str(run_dir)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    sm = summarize(events.read(run_dir))
    starts = [s for s in sm.starts if s.resumed_from is not None]
    timed = [endpoints.start_phases(s) for s in starts]  # begin -> the start's own first step done
    bad = [(s, b) for s, t in zip(starts, timed) if (b := endpoints.check_order(t))]
    for s, b in bad:
        print(f"REJECTED start {s.index} (restart {s.restart}): phases out of order ({'; '.join(b)})",
              file=sys.stderr, flush=True)
    cold = float(timed[0].first_step or 0)
    print(f"run dir: {run_dir}")
    print(f"cold start -> first step          : {cold:6.1f} s (burn-in {starts[0].burnin_s:.1f} s; "
          f"{endpoints.format_phases(timed[0])})")
    for s, t in zip(starts[1:], timed[1:]):
        back = float(t.first_step or 0)
        print(f"restart {s.restart} -> first step            : {back:6.1f} s "
              f"(burn-in {s.burnin_s:.1f} s)  ratio {back / cold:5.2f}  (goal <= 1.3; {endpoints.format_phases(t)})")
    print(f"training (productive)             : {sm.productive_s:6.1f} s over {sm.final_step} steps")
    print(f"wall (queue wait {sm.queue_wait_s:.1f} s excluded)   : {sm.wall_s:6.1f} s")
    print(f"restarts {sm.restarts}, lost steps {sm.lost_steps}, checkpoint stalls {sm.checkpoint_overhead_s:.1f} s")
    print(f"goodput                           : {sm.goodput:6.3f}  (goal >= 0.9 for >= 180 s of training)")
    if bad:
        raise SystemExit(f"{len(bad)} start(s) rejected: their phases were out of order (see above)")


if __name__ == "__main__":
    main()
