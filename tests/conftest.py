"""Shared fixtures. The repo root is the working directory of every test that renders
or runs the CLI, because shipped configs use repo-relative paths."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


@pytest.fixture
def root() -> Path:
    return ROOT


def run_cli(*args: str, env: dict | None = None, cwd: Path | None = None, timeout: float = 120,
            input: str | None = None) -> subprocess.CompletedProcess:
    """Run `python -m dslurm ARGS` as a user would, capturing output."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.run([PYTHON, "-m", "dslurm", *args], cwd=cwd or ROOT, env=full_env,
                          capture_output=True, text=True, timeout=timeout, input=input)


@pytest.fixture
def cli():
    return run_cli
