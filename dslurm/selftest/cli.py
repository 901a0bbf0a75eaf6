"""`dslurm selftest --gpu [--dry-run] [--site S] [--out FILE]`: start the in-job self-check,
bound it in time, print its JSON report. Light to import: no torch here.
`dslurm selftest chaos [--minutes M] [--every S] [--seed N] ...`: the chaos soak on the local
cluster (dslurm/selftest/chaos/, docs/chaos.md).

The measuring runs in its own process (`python -m train.selftest`: it drives the trainer, which
the toolkit never imports). That process rewrites its report after every part, so a crash or a
timeout still leaves what it had measured; this side adds how the process ended.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from dslurm.errors import UserError
from dslurm.selftest.chaos.cli import add_arguments as add_chaos_arguments

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SITES = {"gpu": "site-configs/h100-ib.yaml", "dry-run": "site-configs/local.yaml"}
# Steps per trainer part and the time budget: the bound is 8 minutes on one GPU.
GPU_DEFAULTS = {"steps": 10, "warmup": 3, "budget_s": 420.0, "ckpt_gb": 20.0}
DRY_DEFAULTS = {"steps": 2, "warmup": 1, "budget_s": 120.0, "ckpt_gb": 1.0}


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("selftest", help="--gpu: check one GPU end to end (NVML, GEMM, trainer MFU, checkpoint I/O); "
                            "chaos: the chaos soak on the local cluster (docs/chaos.md)",
                       description=__doc__)
    p.add_argument("check", nargs="?", choices=("chaos",),
                   help="chaos: random outside faults against a job on the local cluster, then compared with "
                        "an uninterrupted run (docs/chaos.md)")
    p.add_argument("--gpu", action="store_true", help="the GPU self-check")
    p.add_argument("--dry-run", action="store_true", help="the same code on CPU with tiny sizes (gloo, fp32)")
    p.add_argument("--site", help=f"site config (the peak, NVML thresholds); default {DEFAULT_SITES['gpu']}, "
                                  f"with --dry-run {DEFAULT_SITES['dry-run']}")
    p.add_argument("--out", help="also write the JSON report here")
    p.add_argument("--dir", help="work directory for checkpoints and run dirs (removed afterwards); "
                                 "default a new one under $TMPDIR: the disk whose throughput is measured. "
                                 "chaos: the soak's directory, kept (default ./chaos-SEED)")
    p.add_argument("--steps", type=int, help="measured steps per trainer part (default 10; dry run 2); chaos: the "
                                              "job's training steps (default minutes x 60 / 0.9)")
    p.add_argument("--warmup", type=int, help="steps before measuring, compile included (default 3; dry run 1)")
    p.add_argument("--budget-s", type=float, help="no part starts after this many seconds (default 420)")
    p.add_argument("--ckpt-gb", type=float, help="cap on the checkpoint size that sizes the model (default 20)")
    p.add_argument("--timeout-s", type=float, help="kill the check after this (default budget + 180 s)")
    add_chaos_arguments(p)
    p.set_defaults(func=run)


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The effective numbers; bad values are user errors naming the flag."""
    mode = "dry-run" if args.dry_run else "gpu"
    out: dict[str, Any] = dict(DRY_DEFAULTS if args.dry_run else GPU_DEFAULTS)
    for key in out:
        value = getattr(args, key)
        if value is not None:
            if value < (0 if key == "warmup" else 1):
                raise UserError(f"selftest: --{key.replace('_', '-')}={value} must be "
                                f"{'>= 0' if key == 'warmup' else 'positive'}")
            out[key] = value
    if args.timeout_s is not None and args.timeout_s <= 0:
        raise UserError(f"selftest: --timeout-s={args.timeout_s} must be positive")
    out["timeout_s"] = args.timeout_s or out["budget_s"] + 180.0
    out["mode"] = mode
    out["site"] = args.site or str(ROOT / DEFAULT_SITES[mode])
    return out


def check_site(path: str, dry_run: bool) -> None:
    """Load the site here, so a bad one is a clear error before any process starts."""
    from dslurm.config import load_site

    if not Path(path).is_file():
        raise UserError(f"selftest: --site {path}: no such file. Fix: give a site config, e.g. "
                        f"{DEFAULT_SITES['dry-run' if dry_run else 'gpu']}")
    site = load_site(path)
    if not dry_run and site.node.gpus == 0:
        raise UserError(f"selftest: {path}: field 'node.gpus' is 0: site {site.name!r} has no GPUs. "
                        "Fix: give a GPU site (--site site-configs/h100-ib.yaml) or add --dry-run")


def child_command(s: dict[str, Any], out: Path, work: Path) -> list[str]:
    cmd = [sys.executable, "-m", "train.selftest", "--site", s["site"], "--out", str(out), "--dir", str(work),
           "--steps", str(s["steps"]), "--warmup", str(s["warmup"]), "--budget-s", str(s["budget_s"]),
           "--ckpt-gb", str(s["ckpt_gb"])]
    return cmd + (["--dry-run"] if s["mode"] == "dry-run" else [])


def run_child(cmd: list[str], timeout_s: float) -> tuple[int | None, bool]:
    """(exit code, timed out). The child's output goes to our stderr: stdout carries only the
    report. On timeout its whole process group is killed (compile workers included)."""
    env = dict(os.environ)
    # `train` sits next to `dslurm` (a checkout or site-packages): make it importable either way.
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    proc = subprocess.Popen(cmd, stdout=sys.stderr, env=env, start_new_session=True)
    try:
        return proc.wait(timeout=timeout_s), False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait(), True
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def finish(report: dict[str, Any] | None, mode: str, code: int | None, timed_out: bool) -> dict[str, Any]:
    """The child's report (or an empty one when it wrote none) with how the process ended. Pure."""
    from dslurm.selftest.report import judge, new_report

    if report is None:
        report = new_report(mode=mode, chip="unknown (the check wrote no report)", device="", site={},
                            notes=[], env={})
    report["process"] = {"exit_code": code, "timed_out": timed_out}
    for name, part in report["parts"].items():
        if part.get("status") == "not run" and (timed_out or code):
            part["error"] = ("killed at the timeout before this part finished" if timed_out else
                             f"the check's process exited {code} before this part finished")
    report["goals"] = judge(report["parts"])
    return report


def run(args: argparse.Namespace) -> int:
    from dslurm import exitcodes
    from dslurm.preflight.gate import write_report
    from dslurm.selftest.report import failed

    if args.check == "chaos":
        from dslurm.selftest.chaos.cli import run as chaos

        return chaos(args)
    if not args.gpu:
        raise UserError("selftest: say which check: --gpu (add --dry-run to run it on CPU with tiny sizes), "
                        "or chaos")
    s = settings(args)
    check_site(s["site"], args.dry_run)
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="dslurm-selftest-"))
    made = not work.exists()
    work.mkdir(parents=True, exist_ok=True)
    # The check writes its report after every part straight to --out, so even if this process is
    # killed from outside (a job's time limit), --out holds every part that finished.
    child_out = Path(args.out) if args.out else work / "selftest-report.json"
    child_out.unlink(missing_ok=True)  # never read a previous run's report as this one's
    try:
        code, timed_out = run_child(child_command(s, child_out, work / "work"), s["timeout_s"])
        report = json.loads(child_out.read_text()) if child_out.exists() else None
    finally:
        shutil.rmtree(work / "work", ignore_errors=True)
        if not args.out:
            child_out.unlink(missing_ok=True)
        if made or not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    report = finish(report, s["mode"], code, timed_out)
    report["failures"] = failed(report)
    if args.out:
        write_report(args.out, report)
    print(json.dumps(report, indent=2, sort_keys=True))
    if code == exitcodes.USER_ERROR:  # the check's process said why on stderr, and in the report
        return code
    return exitcodes.SELFTEST_FAILED if report["failures"] or code else exitcodes.OK
