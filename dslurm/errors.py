"""Errors a person can fix. The CLI prints them without a traceback and exits 2."""

from __future__ import annotations

from pathlib import Path


class UserError(Exception):
    """A mistake in user input (config file, CLI flag, environment).

    The message must name the file or variable, the field, the value and the fix.
    """

    exit_code = 2


class SlurmError(UserError):
    """A Slurm command failed; the message carries Slurm's own reason."""

    exit_code = 1


def check_output_file(out: Path, flag: str, example: str = "script.sbatch") -> None:
    """A file a command is told to write (`flag` names the option): a file to create or replace,
    in a directory that exists. Nothing is created on the way, so a typo in the path leaves no
    directories behind."""
    if out.is_dir():
        raise UserError(f"{flag} {out}: is a directory. Fix: name the file to write, e.g. {flag} {out / example}")
    if not out.parent.is_dir():
        raise UserError(f"{flag} {out}: the directory {out.parent} does not exist. Fix: create it first "
                        f"(mkdir -p {out.parent}) or write the file elsewhere")
