"""Shared fixtures. The repo root is the working directory of every test that renders
or runs the CLI, because shipped configs use repo-relative paths."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from testkit import run_cli

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


_GUARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


@pytest.fixture(autouse=True)
def _signal_dispositions_restored():
    """Code under test that ignores or traps a signal in-process (requeue-me ignores the TERM
    its own scancel brings, the trainer's handlers) must not leave the pytest process so: a later
    test's children inherit an ignored TERM and can then never be stopped (a stand-in srun hung
    this way). Each test gets the dispositions back as they were."""
    before = {s: signal.getsignal(s) for s in _GUARDED}
    yield
    for s, h in before.items():
        if signal.getsignal(s) is not h and h is not None:
            signal.signal(s, h)


@pytest.fixture
def root() -> Path:
    return ROOT


@pytest.fixture
def cli():
    return run_cli
