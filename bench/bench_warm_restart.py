"""Warm vs cold restart inside the allocation, side by side in one run (docs/recovery.md).

Two jobs on the local Slurm cluster, one after the other, the same but for `recovery.warm`:
1 training node (2 processes, tiny model, tp 2) + 1 spare, a checkpoint every 2 steps, and a
fault on rank 1 before step 9 of the first job step (a kill -9 by default; `--fault crash`: a
Python exception, whose rank cleans up first, ~1 s more before its peers notice). The job step
after it is a warm restart in the first job (workers forked by the node's preloaded pool) and a
cold one (torchrun) in the second. In the warm job the fault waits until both nodes' pools serve
(DSLURM_FAULT_AWAIT on their ready files, as `dslurm site check`'s warm job does): the pools
start after the first step, and on a loaded machine their preloading outlasts 9 steps, when
supervise rightly starts the next step cold and there is no warm restart to time. From the
ledger (`dslurm report`'s numbers):

  cold start     job start -> first step of the warm job's first job step (phase table total)
  warm restart   failure -> first step of its next job step (Recovery.failed_t -> first step)
  cold restart   the same in the job without the pool

and the ratios warm restart / cold start (the goal: <= 0.35) and warm / cold restart. The
restarts are timed by `dslurm.observe.endpoints` (the report's rule: the next start's own first
step done) and each rep's phases (ending, decided, job_start, train_start, first step) must be in
order, else the rep is rejected on stderr, never counted, and the bench exits non-zero.
`--tiny`: the suite's smoke run (one rep, 10 steps).

    PYTHONPATH=$PWD .venv/bin/python bench/bench_warm_restart.py [--reps 1] [--fault kill9|crash] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

from dslurm import cluster, slurm  # noqa: E402
from dslurm.observe import endpoints  # noqa: E402
from dslurm.observe import events as ev  # noqa: E402
from dslurm.observe import phases as ph  # noqa: E402
from dslurm.observe.report import summarize  # noqa: E402

KNOB = {"kill9": "DSLURM_FAULT_KILL9", "crash": "DSLURM_FAULT_CRASH"}


def one(tmp: Path, fault: str, warm: bool, env: dict[str, str], steps: int = 12
        ) -> tuple[list[ph.StartTable], endpoints.Timed]:
    """Run one job; its starts (phase tables) and its recovery's phases from the failure
    (`Recovery.failed_t`) to the next start's first step done, by the report's rule."""
    run = tmp / f"warm-{warm}"
    job = {"name": "bench-warm", "nodes": 1, "spares": 1, "time": "00:10:00", "model": {"preset": "tiny"},
           "parallel": {"tp": 2}, "preflight": {"enabled": False}, "recovery": {"warm": warm},
           "requeue": {"max_restarts": 4, "no_progress_limit": 0},
           "train": {"steps": steps, "global_batch": 8, "log_every": 1, "step_sleep_s": 0.2},
           "checkpoint": {"run_dir": str(run), "interval": 2},
           "env": {KNOB[fault]: "9:1@0.0", **({"DSLURM_FAULT_AWAIT": f"{run}/warm/*.ready:2:180"} if warm else {})}}
    spec = tmp / f"job-{warm}.yaml"
    spec.write_text(yaml.safe_dump(job))
    out = subprocess.run([sys.executable, "-m", "dslurm", "submit", "--site", str(ROOT / "site-configs/local.yaml"),
                          "--job", str(spec)], cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr)
    job_id = int(re.search(r"submitted job (\d+)", out.stdout).group(1))  # type: ignore[union-attr]
    try:
        state = slurm.wait_job(job_id, timeout=600, env=env)
    finally:  # a TERM or a timeout: the job goes too (a no-op once it completed)
        slurm.run_cmd(["scancel", str(job_id)], env=env, check=False)
    evs = ev.read(run)
    starts = ph.tables(evs)
    recs = list(ev.of(evs, ev.Recovery))
    if state != "COMPLETED" or len(starts) != 2 or len(recs) != 1 or starts[1].warm != warm:
        raise SystemExit(f"job {job_id} {state}: {len(starts)} starts, {len(recs)} recoveries; see {run}")
    timed = endpoints.since(evs, recs[0].failed_t or recs[0].t)
    # the report's own figure for the same recovery: one rule, so they must agree
    (back,) = [r.resumed_s for r in summarize(evs).recoveries]
    if timed.first_step is not None and back is not None and abs(timed.first_step - back) > 0.01:
        raise SystemExit(f"job {job_id}: the endpoint {timed.first_step} s differs from the report's {back} s")
    return starts, timed


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--fault", choices=sorted(KNOB), default="kill9")
    p.add_argument("--keep", type=Path, help="keep the runs under this directory (rep N in DIR/N)")
    p.add_argument("--tiny", action="store_true",
                   help="the suite's smoke run (tests/cluster/test_cluster_benches.py): one rep, the fewest steps")
    args = p.parse_args()
    # A TERM (a timeout, a Ctrl-C'd wrapper) unwinds through the `finally`: the job cancelled.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    env = {**os.environ, **cluster.up(nodes=3, accounting=True).env()}
    steps = 10 if args.tiny else 12
    print(f"{'rep':>3} {'cold start s':>13} {'warm restart s':>15} {'cold restart s':>15} {'warm/cold start':>16} "
          f"{'warm/cold restart':>18}  load")
    rejected = 0
    for i in range(1 if args.tiny else args.reps):
        with tempfile.TemporaryDirectory(prefix="bench-warm-") as tmp:
            d = args.keep / str(i) if args.keep else Path(tmp)
            d.mkdir(parents=True, exist_ok=True)
            t0 = time.time()
            warm_starts, warm_t = one(d, args.fault, True, env, steps)
            cold_starts, cold_t = one(d, args.fault, False, env, steps)
            for name, timed in (("warm", warm_t), ("cold", cold_t)):
                print(f"rep {i} {name} restart: failure -> {endpoints.format_phases(timed)} s", flush=True)
            bad = [f"{n}: {'; '.join(b)}" for n, t in (("warm", warm_t), ("cold", cold_t))
                   if (b := endpoints.check_order(t))]
            if i == 0:
                print("warm job:\n" + ph.format_table(warm_starts) + "\ncold job:\n" + ph.format_table(cold_starts),
                      flush=True)
            if bad:
                print(f"REJECTED rep {i}: phases out of order ({' | '.join(bad)}); not counted",
                      file=sys.stderr, flush=True)
                rejected += 1
                continue
            cold, warm, again = warm_starts[0].startup_s(), float(warm_t.first_step or 0), float(cold_t.first_step or 0)
            print(f"{i:>3} {cold:>13.2f} {warm:>15.2f} {again:>15.2f} {warm / cold:>16.2f} {warm / again:>18.2f}  "
                  f"{os.getloadavg()[0]:.1f} ({time.time() - t0:.0f} s)", flush=True)
    if rejected:
        raise SystemExit(f"{rejected} rep(s) rejected: their phases were out of order (see above)")


if __name__ == "__main__":
    main()
