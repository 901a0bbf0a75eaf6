"""`dslurm burnin`: run the pre-flight burn-in. Light to import: no torch here.

Two ways:
- `dslurm burnin --site S --nodes N [--wait]`: a standalone sbatch job of N whole nodes,
  rendered and submitted like a training job (dslurm/submission/__init__.py), that runs the same gate
  every training job runs first and nothing else. Its report, ledger and blocklist land
  in the run directory (default <storage.durable>/burnin-N); a later training job of the
  same run directory --excludes the bad nodes.
- `dslurm burnin --local [--nproc N]`: torchrun on this machine.
Exit codes are dslurm.preflight.EXIT_* (0 pass, 3 bad nodes, 4 unlocalized, 5 no report).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
from pathlib import Path

from dslurm.errors import UserError
from dslurm.preflight import EXIT_NO_REPORT
from dslurm.preflight.run import PSEUDO_ENV

log = logging.getLogger(__name__)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("burnin", help="pre-flight burn-in: NVML health, GEMM, all-reduce busbw",
                       description=__doc__)
    p.add_argument("--local", action="store_true", help="run on this machine through torchrun")
    p.add_argument("--nproc", type=int, default=2, help="processes (one per GPU), default 2")
    p.add_argument("--pseudo-nodes", type=int, default=0,
                   help=f"split the processes into N pseudo-nodes (sets {PSEUDO_ENV})")
    p.add_argument("--report", default="burnin-report.json", help="JSON report path")
    p.add_argument("--site", help="site config YAML whose burnin section sets the thresholds")
    p.add_argument("--thresholds", help="JSON file with burnin thresholds (instead of --site)")
    p.add_argument("--expected-gpus", type=int, help="GPUs each node must show")
    p.add_argument("--nodes", type=int, help="with --site: nodes of the standalone sbatch job")
    p.add_argument("--run-dir", help="with --nodes: where report, ledger and blocklist go")
    p.add_argument("--time", default="00:15:00", help="with --nodes: time limit of the job")
    p.add_argument("--dry-run", action="store_true", help="with --nodes: write the script, do not submit")
    p.add_argument("--wait", action="store_true", help="with --nodes: wait for the verdict and print it")
    p.set_defaults(func=run)


def torchrun_command(args: argparse.Namespace) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={args.nproc}", "-m", "dslurm.preflight.run",
           "--report", str(args.report), "--exit-zero"]
    for flag in ("site", "thresholds"):
        if getattr(args, flag):
            cmd += [f"--{flag}", str(getattr(args, flag))]
    if args.expected_gpus is not None:
        cmd += ["--expected-gpus", str(args.expected_gpus)]
    return cmd


def run(args: argparse.Namespace) -> int:
    from dslurm.preflight.gate import exit_code, load_report

    if not args.local:
        if not (args.site and args.nodes):
            raise UserError("burnin: give --site FILE --nodes N (a standalone sbatch job) or --local")
        return run_job(args)
    if args.nproc < 1:
        raise UserError(f"burnin: --nproc={args.nproc} must be >= 1")
    report = Path(args.report)
    env = dict(os.environ)
    if args.pseudo_nodes:
        env[PSEUDO_ENV] = str(args.pseudo_nodes)
    # Remove a stale report first, so a crashed run can never be read as this run's verdict.
    report.unlink(missing_ok=True)
    proc = subprocess.run(torchrun_command(args), env=env)
    if not report.exists():
        print(f"dslurm burnin: runner exited {proc.returncode} without writing {report}",
              file=sys.stderr)
        return EXIT_NO_REPORT
    verdict = load_report(report)["verdict"]
    log.info("report: %s", report)
    return exit_code(verdict)


def run_job(args: argparse.Namespace) -> int:
    """Render and submit the standalone burn-in job; with --wait, print its verdict."""
    from dslurm.config import load_job, load_site
    from dslurm.config.resolve import resolve
    from dslurm.submission import submit

    site = load_site(args.site)
    data = {"name": f"burnin-{args.nodes}", "nodes": args.nodes, "time": args.time,
            "entry": "dslurm.preflight.job", "preflight": {"enabled": True},
            "requeue": {"enabled": False}, "train": {"global_batch": args.nodes * site.procs_per_node}}
    if args.run_dir:
        data["checkpoint"] = {"run_dir": args.run_dir}
    r = resolve(site, load_job(data=data), site_path=args.site, job_path="burnin job",
                base_dir=os.getcwd())
    sub = submit(r, dry_run=args.dry_run)
    if args.dry_run:
        print(f"dry run: wrote {sub.script}")
        return 0
    print(f"submitted burn-in job {sub.job_id}; report, ledger and blocklist in {sub.run_dir}")
    return _wait_verdict(sub.job_id, sub.run_dir) if args.wait else 0


def _wait_verdict(job_id: int, run_dir: Path) -> int:
    """The verdict is the job's `preflight` event in the run's ledger; Slurm only says when to
    look. A job Slurm can no longer place (gone from slurmctld, accounting still without it once
    `wait_job` has waited for it) is no verdict either way: the ledger decides."""
    from dslurm import slurm
    from dslurm.errors import SlurmError
    from dslurm.observe import events
    from dslurm.preflight.gate import exit_code, load_report, render_table

    try:
        state = slurm.wait_job(job_id, timeout=3600, poll=1)
    except SlurmError as exc:
        log.warning("%s; reading the verdict from the ledger", exc)
        state = "UNKNOWN"
    mine = [e for e in events.of(events.read(run_dir), events.Preflight) if e.job_id == str(job_id) and e.report]
    if not mine:
        print(f"dslurm burnin: job {job_id} ended {state} without a verdict; see {run_dir}/logs",
              file=sys.stderr)
        return EXIT_NO_REPORT
    report = load_report(str(mine[-1].report))
    print(render_table(report))
    return exit_code(report["verdict"])
