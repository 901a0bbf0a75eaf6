"""Errors a person can fix. The CLI prints them without a traceback and exits 2."""

from __future__ import annotations


class UserError(Exception):
    """A mistake in user input (config file, CLI flag, environment).

    The message must name the file or variable, the field, the value and the fix.
    """

    exit_code = 2


class SlurmError(UserError):
    """A Slurm command failed; the message carries Slurm's own reason."""

    exit_code = 1
