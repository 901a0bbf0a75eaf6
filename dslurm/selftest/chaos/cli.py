"""The flags of `dslurm selftest chaos` and their checks (bad values: a clear error naming the flag)."""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING

from dslurm.errors import UserError

if TYPE_CHECKING:
    from dslurm.selftest.chaos.run import Soak

STEP_S = 0.9  # wall seconds per step of the soak's job on 2 busy cores, faults and restarts included
DEFAULT_SITE = "site-configs/local.yaml"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The chaos flags; --steps, --site, --dir and --timeout-s (the soak's job is cancelled then, and
    the run judged as it stands) are shared with --gpu (dslurm/selftest/cli.py)."""
    g = p.add_argument_group("chaos (dslurm selftest chaos)")
    g.add_argument("--minutes", type=float, default=3.0, help="minutes of faults (default 3)")
    g.add_argument("--every", type=float, default=None, help="seconds between faults on average (default 15)")
    g.add_argument("--seed", type=int, default=None, help="the schedule's seed (default: drawn and printed)")
    g.add_argument("--mode", choices=("builtin", "script"), default="builtin",
                   help="builtin: the trainer; script: examples/own_script/train_safe.py on dslurm.runtime")
    g.add_argument("--kinds", default="all", help="comma list of fault kinds (default all; see docs/chaos.md)")
    g.add_argument("--no-spares", action="store_true", help="the job without a spare node (no spare_off faults)")
    g.add_argument("--interval", type=int, default=5, help="steps between checkpoints (default 5)")
    g.add_argument("--step-sleep", type=float, default=0.3, help="seconds slept per step (default 0.3)")
    g.add_argument("--disk-mb", type=int, default=128, help="size of the durable tmpfs (default 128)")


def soak_from(args: argparse.Namespace) -> Soak:
    from dslurm.selftest.chaos import jobs, schedule
    from dslurm.selftest.chaos.run import Soak

    for flag in ("minutes", "every", "steps", "interval", "disk_mb"):
        value = getattr(args, flag)
        if value is not None and value <= 0:
            raise UserError(f"selftest chaos: --{flag.replace('_', '-')}={value} must be positive")
    if args.timeout_s is not None and args.timeout_s <= 0:
        raise UserError(f"selftest chaos: --timeout-s={args.timeout_s} must be positive")
    if args.step_sleep < 0:
        raise UserError(f"selftest chaos: --step-sleep={args.step_sleep} must not be negative")
    every = args.every or schedule.DEFAULT_EVERY_S
    try:
        kinds = schedule.parse_kinds(args.kinds, spares=not args.no_spares)
    except ValueError as exc:
        raise UserError(f"selftest chaos: --kinds {args.kinds}: {exc}") from exc
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    steps = args.steps or max(20, int(args.minutes * 60 / STEP_S))
    plan = jobs.Plan(mode=args.mode, steps=steps, step_sleep_s=args.step_sleep, interval=args.interval,
                     spares=not args.no_spares, minutes=args.minutes)
    site = Path(args.site or jobs.ROOT / DEFAULT_SITE)
    if not site.is_file():
        raise UserError(f"selftest chaos: --site {site}: no such file. Fix: give {DEFAULT_SITE}")
    out = Path(args.dir) if args.dir else Path.cwd() / f"chaos-{seed}"
    return Soak(plan=plan, seed=seed, faults=schedule.draw(seed, args.minutes, every, kinds), kinds=kinds,
                every_s=every, out=out.resolve(), site=site.resolve(), disk_mb=args.disk_mb,
                timeout_s=args.timeout_s, started=time.time())


def run(args: argparse.Namespace) -> int:
    import signal
    import sys

    from dslurm.selftest.chaos.run import soak

    s = soak_from(args)
    # A TERM (a `timeout`, a job's end) unwinds like ^C: the job cancelled, the reference stopped,
    # the tmpfs unmounted, the drained spare resumed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    print(f"chaos: seed {s.seed} (replay with --seed {s.seed}); soak dir {s.out}", flush=True)
    return soak(s)
