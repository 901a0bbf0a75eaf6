"""`dslurm burnin`: run the pre-flight burn-in. Light to import: no torch here.

For now only `--local` (torchrun on this machine); the standalone sbatch job comes later.
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


def register(sub: argparse._SubParsersAction) -> None:
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
        raise UserError("burnin: only --local is implemented yet (the sbatch job comes later); "
                        "run `dslurm burnin --local [--nproc N]`")
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
