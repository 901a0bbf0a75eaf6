"""Input checks shared by the planner's pure functions.

Every check raises `UserError` naming the field and the value, so `dslurm plan`
turns a bad flag into exit 2 with a readable line instead of a traceback.
"""

from __future__ import annotations

import math

from dslurm.errors import UserError


def _finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise UserError(f"{name}={value!r} must be a finite number")
    return value


def positive(name: str, value: float) -> float:
    """`value` if it is a finite number > 0, else a UserError naming `name`."""
    if _finite(name, value) <= 0:
        raise UserError(f"{name}={value} must be greater than 0")
    return value


def non_negative(name: str, value: float) -> float:
    """`value` if it is a finite number >= 0, else a UserError naming `name`."""
    if _finite(name, value) < 0:
        raise UserError(f"{name}={value} must not be negative")
    return value


def count(name: str, value: int, minimum: int = 1) -> int:
    """`value` if it is an integer >= `minimum` (ranks, stages, layers), else a UserError."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{name}={value!r} must be a whole number")
    if value < minimum:
        raise UserError(f"{name}={value} must be at least {minimum}")
    return value


def fraction(name: str, value: float) -> float:
    """`value` if it lies in [0, 1), else a UserError (a share of memory or time)."""
    if not 0 <= _finite(name, value) < 1:
        raise UserError(f"{name}={value} must be in [0, 1)")
    return value
