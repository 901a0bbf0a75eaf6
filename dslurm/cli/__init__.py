"""The `dslurm` command line.

Each subcommand lives in the module of its link of the chain and exposes
`register(subparsers)`, which adds its parser and sets `func=run(args) -> int`.
Those modules must stay light to import (no torch, no matplotlib at module level):
the CLI is meant to answer instantly. A command that logs nothing (render) sets the default
`configure_logging=False`, so it does not pay for importing `logging`.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Any

from dslurm import __version__
from dslurm.errors import UserError

# Command -> the module that registers it. Order is the order `dslurm --help` lists them.
# Only the module of the command being run is imported, so a command pays for its own
# imports alone (`dslurm render` must stay near the cost of starting Python).
COMMANDS = {
    "render": "dslurm.cli.render",
    "submit": "dslurm.cli.submit",
    "status": "dslurm.cli.submit",
    "cancel": "dslurm.requeue.cancel",
    "cluster": "dslurm.cluster",
    "site": "dslurm.site.cli",
    "launch": "dslurm.launch",
    "env": "dslurm.launch",
    "burnin": "dslurm.preflight.cli",
    "ckpt": "dslurm.checkpoint.cli",
    "data": "dslurm.data.cli",
    "plan": "dslurm.plan.cli",
    "doctor": "dslurm.observe.doctor",
    "report": "dslurm.sweep.report",  # the single-run report, extended to sweep directories
    "watch": "dslurm.observe.watch",
    "ctl": "dslurm.observe.ctl",
    "trackers": "dslurm.trackers.sync",
    "requeue-me": "dslurm.requeue",
    "supervise": "dslurm.recover.supervise",
    "selftest": "dslurm.selftest.cli",
}


def _wanted_modules(argv: list[str] | None) -> list[str]:
    args = sys.argv[1:] if argv is None else argv
    first = next((a for a in args if not a.startswith("-")), None)
    if first in COMMANDS:
        return [COMMANDS[first]]
    return list(dict.fromkeys(COMMANDS.values()))  # help, or an unknown command: list them all


class Parser(argparse.ArgumentParser):
    """Every parser of the CLI, subcommands included (add_subparsers makes its own class's):
    no abbreviations, so `--jo` is an error and not `--job`, and a new flag never changes
    what an old abbreviation meant."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = Parser(
        prog="dslurm",
        description="Slurm-native toolkit for distributed PyTorch training.",
    )
    parser.add_argument("--version", action="version", version=f"dslurm {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _wanted_modules(argv):
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if getattr(args, "configure_logging", True):  # a command that never logs skips the import (~8 ms)
        import logging

        logging.basicConfig(
            level=logging.DEBUG if args.verbose else logging.INFO,
            format="%(levelname)s %(name)s: %(message)s",
        )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(f"dslurm {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
