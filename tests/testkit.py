"""Helpers shared by the test layers (importable as `testkit`: pytest puts tests/ on the path)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def sbatch_flags(text: str) -> dict[str, str | None]:
    """The `#SBATCH --key[=value]` lines of a script as {key: value or None}."""
    out: dict[str, str | None] = {}
    for line in text.splitlines():
        if line.startswith("#SBATCH --"):
            key, _, value = line[len("#SBATCH --"):].partition("=")
            out[key] = value or None
    return out


def wait_for(pred: Callable[[], Any], timeout: float, what: str, poll: float = 0.5) -> Any:
    """Poll `pred` until it returns something truthy; fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(poll)
    raise AssertionError(f"timed out waiting for {what}")
