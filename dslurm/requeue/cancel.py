"""`dslurm cancel JOBID|RUN_DIR [--save]`: stop a run on purpose.

A TERM that reaches only the job step is nobody's decision to end the run (a stray stop,
docs/endings.md): the run is requeued. A run is stopped by a signal that reaches the batch
shell, and this command sends one, after recording who asked in the start's facts dir
(`cancel.json`, dslurm/endings/facts.py), so the ending says the user cancelled it:

- plain: `scancel JOB`. Slurm TERMs the batch shell and the step and KILLs what is left after
  KillWait: the ranks save if the save fits in KillWait. Ending `cancelled`; the job CANCELLED.
- `--save`: `scancel --signal=TERM JOB` after the request is on record. The job step gets TERM
  and nothing is killed: the ranks agree, save and exit; `requeue-me` reads the request,
  records `cancelled` (saved) and stops (exit 143: the job ends FAILED 143 in Slurm's
  accounting). Not `--full`: a TERM at the batch step reaches srun too, and srun answers TERM
  with "forcing job termination", killing the launchers before they forward it (seen on the
  local cluster: no launcher report, no save, and torchrun, in a session of its own, left
  training after the job had ended).

A RUN_DIR cancels every job of the run that Slurm still has (a chain's pending links too); the
local handle of a run on a cluster (docs/remote.md) cancels it there, over ssh.
"""

from __future__ import annotations

import argparse
import getpass
from collections.abc import Mapping
from pathlib import Path

from dslurm.errors import UserError
from dslurm.run import RunDir


def run_dir_of(job: str, env: Mapping[str, str] | None = None) -> Path | None:
    """The run directory of a job `dslurm submit` made (its --output lies in RUN_DIR/logs), else None."""
    from dslurm import slurm

    proc = slurm.run_cmd(["scontrol", "-o", "show", "job", job], check=False, env=env)
    recs = slurm.parse_scontrol_records(proc.stdout) if proc.returncode == 0 else []
    out = recs[0].get("StdOut", "") if recs else ""
    run = Path(out).parent.parent if out else None
    return run if run is not None and RunDir(run).is_run() else None


def _record(run_dir: Path | None, job: str, save: bool, env: Mapping[str, str] | None) -> str | None:
    """Write the request into the facts dir of the job's running start; None when there is no
    running start of a dslurm run to write it into."""
    from dslurm import slurm
    from dslurm.endings.facts import STARTS, start_name, write_cancel_request

    if run_dir is None:
        return None
    info = slurm.job_info(job, env=env)
    d = run_dir / STARTS / start_name(job, int(str(info.get("restarts") or 0)))
    if str(info.get("state")) != "RUNNING" or not d.is_dir():  # not started: nothing to classify
        return None
    return f"request recorded in {d}/cancel.json" if write_cancel_request(d, save=save, user=getpass.getuser()) \
        else None


def cancel(target: str, *, save: bool, env: Mapping[str, str] | None = None) -> list[str]:
    """Record the request, then signal; one line per job for the person who asked."""
    from dslurm import slurm
    from dslurm.submission import active_jobs_of_run

    if target.isdigit():
        jobs, run_dir = [target], run_dir_of(target, env)
    else:
        run_dir = Path(target)
        if not RunDir(run_dir).ledger.is_file():
            raise UserError(f"dslurm cancel: {target} is neither a job id nor a run directory (no "
                            f"{RunDir(run_dir).ledger.name} there); pass the job id `dslurm submit` printed, "
                            "or the run's checkpoint.run_dir")
        # later jobs first: a chain's pending link must not start when the running one ends
        jobs = sorted((str(j["job_id"]) for j in active_jobs_of_run(run_dir, dict(env) if env else None)),
                      key=lambda j: [int(x) if x.isdigit() else 0 for x in j.split("_")], reverse=True)
        if not jobs:
            return [f"{run_dir}: no pending or running job"]
    said = []
    for job in jobs:
        note = _record(run_dir, job, save, env)
        # A step-only TERM is a cancel only with the request on record (else: a stray stop, requeued),
        # so without one (not running, not a dslurm run) --save falls back to a plain scancel.
        args = ["scancel", "--signal=TERM", job] if save and note else ["scancel", job]
        slurm.run_cmd(args, env=env)
        said.append(f"job {job}: {' '.join(args)} ({note or 'no running start of a dslurm run: nothing recorded'})")
    return said


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("cancel", help="stop a run on purpose (a TERM sent only to the job step is requeued)")
    p.add_argument("target", metavar="JOBID|RUN_DIR", help="a job id, or a run directory (all its jobs)")
    p.add_argument("--save", action="store_true",
                   help="record the request, then TERM the job step (scancel --signal=TERM), kill nothing: the "
                        "ranks save, then the run stops; without it: scancel (KILL after KillWait)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    from dslurm.remote import handle

    if not args.target.isdigit() and (h := handle.read(args.target)) is not None:  # a run on a cluster
        from dslurm.remote.proxy import passthrough

        return passthrough(h, ["cancel", h.run_dir, *(["--save"] if args.save else [])])
    for line in cancel(args.target, save=args.save):
        print(line)
    return 0
