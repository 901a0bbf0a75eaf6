"""Warm vs cold restart inside the allocation, side by side in one run (docs/recovery.md).

Two jobs on the local Slurm cluster, one after the other, the same but for `recovery.warm`:
1 training node (2 processes, tiny model, tp 2) + 1 spare, a checkpoint every 2 steps, and a
fault on rank 1 before step 9 of the first job step (the pools, started after the first step,
have finished preloading by then) (a kill -9 by default; `--fault crash`: a
Python exception, whose rank cleans up first, ~1 s more before its peers notice). The job step
after it is a warm restart in the first job (workers forked by the node's preloaded pool) and a
cold one (torchrun) in the second. From the ledger (`dslurm report`'s numbers):

  cold start     job start -> first step of the warm job's first job step (phase table total)
  warm restart   failure -> first step of its next job step (Recovery.failed_t -> first step)
  cold restart   the same in the job without the pool

and the ratios warm restart / cold start (the goal: <= 0.35) and warm / cold restart.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_warm_restart.py [--reps 1] [--fault kill9|crash]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from dslurm import cluster, slurm  # noqa: E402
from dslurm.observe import events as ev  # noqa: E402
from dslurm.observe import phases as ph  # noqa: E402
from dslurm.observe.report import summarize  # noqa: E402

KNOB = {"kill9": "DSLURM_FAULT_KILL9", "crash": "DSLURM_FAULT_CRASH"}


def one(tmp: Path, fault: str, warm: bool, env: dict[str, str]) -> tuple[list[ph.StartTable], list[float]]:
    """Run one job; its starts (phase tables) and its recoveries' failure -> first step."""
    run = tmp / f"warm-{warm}"
    job = {"name": "bench-warm", "nodes": 1, "spares": 1, "time": "00:10:00", "model": {"preset": "tiny"},
           "parallel": {"tp": 2}, "preflight": {"enabled": False}, "recovery": {"warm": warm},
           "requeue": {"max_restarts": 4, "no_progress_limit": 0},
           "train": {"steps": 12, "global_batch": 8, "log_every": 1, "step_sleep_s": 0.2},
           "checkpoint": {"run_dir": str(run), "interval": 2}, "env": {KNOB[fault]: "9:1@0.0"}}
    spec = tmp / f"job-{warm}.yaml"
    spec.write_text(yaml.safe_dump(job))
    out = subprocess.run([sys.executable, "-m", "dslurm", "submit", "--site", str(ROOT / "site-configs/local.yaml"),
                          "--job", str(spec)], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr)
    job_id = int(re.search(r"submitted job (\d+)", out.stdout).group(1))  # type: ignore[union-attr]
    state = slurm.wait_job(job_id, timeout=600, env=env)
    evs = ev.read(run)
    starts = ph.tables(evs)
    rec = [float(r.resumed_s or 0) for r in summarize(evs).recoveries]
    if state != "COMPLETED" or len(starts) != 2 or len(rec) != 1 or starts[1].warm != warm:
        raise SystemExit(f"job {job_id} {state}: {len(starts)} starts, recoveries {rec}; see {run}")
    return starts, rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--fault", choices=sorted(KNOB), default="kill9")
    p.add_argument("--keep", type=Path, help="keep the runs under this directory (rep N in DIR/N)")
    args = p.parse_args()
    env = {**os.environ, **cluster.up(nodes=3, accounting=True).env()}
    print(f"{'rep':>3} {'cold start s':>13} {'warm restart s':>15} {'cold restart s':>15} {'warm/cold start':>16} "
          f"{'warm/cold restart':>18}  load")
    for i in range(args.reps):
        with tempfile.TemporaryDirectory(prefix="bench-warm-") as tmp:
            d = args.keep / str(i) if args.keep else Path(tmp)
            d.mkdir(parents=True, exist_ok=True)
            t0 = time.time()
            warm_starts, (warm,) = one(d, args.fault, True, env)
            cold_starts, (again,) = one(d, args.fault, False, env)
            cold = warm_starts[0].startup_s()
            print(f"{i:>3} {cold:>13.2f} {warm:>15.2f} {again:>15.2f} {warm / cold:>16.2f} {warm / again:>18.2f}  "
                  f"{os.getloadavg()[0]:.1f} ({time.time() - t0:.0f} s)", flush=True)
            if i == 0:
                print("warm job:\n" + ph.format_table(warm_starts) + "\ncold job:\n" + ph.format_table(cold_starts),
                      flush=True)


if __name__ == "__main__":
    main()
