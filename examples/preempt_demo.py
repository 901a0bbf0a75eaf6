"""Preempt a running 2-node training job and watch it resume: the demo of the requeue chain.

    .venv/bin/python examples/preempt_demo.py [--steps 60] [--preemptions 2] [--run-dir DIR]

Submits examples/jobs/tiny-2node.yaml to the built-in local Slurm cluster (it must be up:
`dslurm cluster up`), waits until it trains, and interrupts it the two ways a cluster does:
`scontrol requeue` (what preemption does: TERM to every process; the trainer saves before
KillWait runs out) and Slurm's time-limit warning (USR2 to the batch shell, here sent with
`scancel --signal=USR2 --batch`). Each time the job requeues itself and resumes from the
checkpoint pointer. At the end it prints `dslurm report`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def wait_for_step(run_dir: Path, restart: int, step: int, timeout: float = 600) -> None:
    from dslurm.observe import events

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(e.restart == restart and e.last is not None and e.last >= step
               for e in events.of(events.read(run_dir), events.Steps)):
            return
        time.sleep(0.5)
    raise TimeoutError(f"no step {step} in start {restart} within {timeout:.0f} s")


def interrupt(job_id: int, how: str) -> None:
    from dslurm import slurm

    if how == "preempt":
        slurm.run_cmd(["scontrol", "requeue", str(job_id)])
    else:
        slurm.run_cmd(["scancel", "--signal=USR2", "--batch", str(job_id)])


def run(steps: int, preemptions: int, run_dir: Path, step_sleep: float, extra: list[str]) -> int:
    from dslurm import slurm
    from dslurm.config.resolve import load
    from dslurm.submission import submit

    overrides = [f"checkpoint.run_dir={run_dir}", f"train.steps={steps}", f"train.step_sleep_s={step_sleep}",
                 "train.log_every=1", *extra]
    r = load(ROOT / "site-configs/local.yaml", ROOT / "examples/jobs/tiny-2node.yaml", overrides,
             base_dir=ROOT)
    job = submit(r).job_id
    print(f"demo: submitted job {job}; run dir {run_dir}", flush=True)
    for k in range(preemptions):
        at = (k + 1) * steps // (preemptions + 1)
        wait_for_step(run_dir, restart=k, step=at)
        how = "preempt" if k % 2 == 0 else "time-limit signal"
        print(f"demo: start {k} reached step {at}: interrupting it ({how})", flush=True)
        interrupt(job, how)
    state = slurm.wait_job(job, timeout=1800, poll=1)
    info = slurm.job_info(job)
    print(f"demo: job {job} ended {state} after {info['restarts']} restart(s)", flush=True)
    return 0 if state == "COMPLETED" else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--preemptions", type=int, default=2)
    ap.add_argument("--step-sleep", type=float, default=0.3, help="seconds of sleep per step (a longer run)")
    ap.add_argument("--run-dir", type=Path,
                    default=ROOT / "checkpoints" / f"demo-{time.strftime('%Y%m%d-%H%M%S')}")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    os.chdir(ROOT)  # the local site activates $SLURM_SUBMIT_DIR/.venv
    rc = run(args.steps, args.preemptions, args.run_dir.resolve(), args.step_sleep, args.overrides)
    subprocess.run([sys.executable, "-m", "dslurm", "report", str(args.run_dir)], check=False)
    return rc


if __name__ == "__main__":
    sys.exit(main())
