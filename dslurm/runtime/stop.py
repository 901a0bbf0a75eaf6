"""Stop requests: the signal handlers of a training process, and the flags they set.

Slurm's time-limit warning (USR2, from `--signal=B:USR2@LEAD`) and TERM (scancel,
preemption) reach the training processes through the batch shell's trap, srun and the
launcher (dslurm/launch/__init__.py). The handler only sets a flag — never save inside a signal
handler — and the ranks agree on the flag at the next step boundary with one SUM all-reduce
of `StopFlags.local()`: the built-in trainer rides it on the all-reduce that already carries
the logged loss (train/loop.py), `dslurm.runtime.stop_requested` on the caller's own values or
on one small collective of its own. Then every rank saves synchronously and exits.

A signal that arrives before this process installed its handler is not lost: the
launcher also leaves a `stop` file in its status directory (DSLURM_STATUS_DIR), which
`install` reads once after the handlers are in place.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from dslurm import faults

STOP_SIGNALS = (signal.SIGUSR2, signal.SIGTERM)


class StopFlags:
    """This process's view of a stop at a step boundary: set by `StopRequest`'s handler, or by
    the DSLURM_FAULT_STOP test knob (dslurm/faults.py). Only read at step boundaries."""

    def __init__(self) -> None:
        self.stop_requested = False
        self.stop_terminated = False  # the stop came from TERM (scancel/preemption): save, do not requeue
        self._fault_stop = faults.step_fault("DSLURM_FAULT_STOP")

    def local(self, done: int) -> list[float]:
        """[stop requested, TERM] of this rank after `done` optimizer steps (1-based, as the
        knob counts): the two numbers every rank adds into one SUM all-reduce."""
        if self._fault_stop is not None and done >= self._fault_stop:
            self.stop_requested = True
        return [float(self.stop_requested), float(self.stop_terminated)]


class StopRequest:
    """Which signal asked this process to stop (None until one did)."""

    def __init__(self) -> None:
        self.signame: str | None = None
        self.times: dict[str, float] = {}  # when each signal first arrived (a TERM after a USR2 has its own)
        self._target: Any = None

    def install(self, target: Any) -> StopRequest:
        """Route stop signals to `target` (a StopFlags, or None: only remember them); pick up
        an earlier request."""
        self._target = target
        for sig in STOP_SIGNALS:
            signal.signal(sig, self._handle)
        early = read_stop_file()
        if early and self.signame is None:
            self._set(early)
        elif self.signame is not None:  # arrived before the target existed: hand it over
            self._set(self.signame)
        return self

    def _handle(self, signum: int, _frame: object) -> None:
        self._set(signal.Signals(signum).name)

    def _set(self, name: str) -> None:
        self.times.setdefault(name, time.time())
        # TERM outranks USR2: a preemption/cancel must not be turned into a requeue.
        if self.signame != "SIGTERM":
            self.signame = name
        if self._target is not None:
            self._target.stop_requested = True
            if self.signame == "SIGTERM":  # agreed across ranks like the stop itself
                self._target.stop_terminated = True


def read_stop_file() -> str | None:
    d = os.environ.get("DSLURM_STATUS_DIR")
    if not d:
        return None
    try:
        return (Path(d) / "stop").read_text().strip() or "SIGUSR2"
    except OSError:
        return None
