"""How a training process ends: its own account (the rank report) and the code it exits with.

Torch-free. Every in-job entry that trains (the built-in trainer, a script using
`dslurm.runtime`) reports the same way: the worker code the launcher reads (torchrun folds
every failure into 1, which would hide a requeue request) and the rank report of
dslurm/endings/facts.py -- what kind of ending, its code, the step reached, the error and
when the failure happened -- from which `dslurm requeue-me` classifies the step's ending.
Exit codes are dslurm/exitcodes.py's.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from dslurm.durable import atomic_write_text

# The directory where each worker leaves its exit code for its node's launcher (`dslurm launch`
# sets it, reads `<local rank>.code` after torchrun returns: torchrun folds every failure into 1).
STATUS_DIR_ENV = "DSLURM_STATUS_DIR"


def write_worker_code(code: int) -> None:
    """Called by a training process on its way out (see train/__main__.py)."""
    d = os.environ.get(STATUS_DIR_ENV)
    rank = os.environ.get("LOCAL_RANK", "0")
    if d:
        atomic_write_text(Path(d) / f"{rank}.code", str(code))


def world_from_env() -> tuple[int, int, int, int]:
    """(rank, local_rank, world_size, local_world_size) from torchrun's environment, or one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return (int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")), world, local_world)


class Outcome:
    """How this process is ending, noted where it happens (the time of a failure, not of
    the cleanup after it)."""

    def __init__(self) -> None:
        self.error = ""
        self.t: float | None = None
        self.step: int | None = None
        self.kind: str | None = None  # set by the watchdog: its verdict wins over the code's kind
        self.progress: Any = None  # anything with a `.step` (the trainer): read when a failure is noted
        self.stop: Any = None  # the StopRequest (dslurm/runtime/stop.py), once installed
        self.run_dir: Path | None = None

    def settled(self, t: float, error: str = "") -> None:
        """The ending was settled at `t` (a stop's save committed, a divergence stop agreed): the
        report's time. A TERM that arrives during the cleanup after it (closing checkpoints,
        leaving the process group) is then the teardown it is, not the cause: read as the cause,
        it turns a saved warned stop into Slurm's time limit (no requeue) and a divergence into a
        cancel."""
        if self.t is None:
            self.t, self.error = t, self.error or error

    def failed(self, exc: BaseException) -> None:
        if self.t is None:
            self.t, self.error = time.time(), f"{type(exc).__name__}: {exc}"[:2000]
            if is_oom(exc) and self.kind is None:  # the same layout and batch would fail again
                self.kind = "oom"
        self.step = getattr(self.progress, "step", self.step)


def is_oom(exc: BaseException) -> bool:
    """torch.OutOfMemoryError (torch.cuda.OutOfMemoryError is the same class), by name: torch-free."""
    return any(c.__name__ == "OutOfMemoryError" for c in type(exc).__mro__)


def signal_before_failure(stop: object, failed_t: float | None) -> str | None:
    """The stop signal this process received, unless it came only after the process had
    already failed of its own accord (e.g. the watchdog's verdict, then torchrun's TERM when a
    peer exited): that one is the teardown, not the cause. Each signal is judged by its own
    arrival: a TERM that came after the failure is not dated to an earlier USR2. Pure."""
    signame, times = getattr(stop, "signame", None), getattr(stop, "times", None) or {}
    if signame is None or failed_t is None:
        return signame
    before = [name for name, t in times.items() if t <= failed_t]
    return "SIGTERM" if "SIGTERM" in before else (before[0] if before else None)


def report(outcome: Outcome, code: int, rank: int) -> None:
    """This process's own account of its ending, for the launcher and for requeue-me."""
    from dslurm import exitcodes
    from dslurm.endings import facts

    write_worker_code(code)
    signame = signal_before_failure(outcome.stop, outcome.t)
    kind = outcome.kind or facts.victim_kind(exitcodes.KIND_OF_CODE.get(code, "crash"), outcome.error, signame)
    facts.write_rank_report(facts.RankReport(rank=rank, kind=kind, code=code, step=outcome.step,
                                             error=outcome.error, t=outcome.t or time.time(), signal=signame),
                            run_dir=outcome.run_dir)


def leave(code: int) -> None:
    """Exit with `code` once everything is written, without the interpreter's finalization.

    After a distributed run, torch's C++ threads (gloo's workers, a process group that outlived
    `destroy_process_group` in a reference cycle) can still take or release the GIL while CPython
    finalizes; the process then aborts ("terminate called without an active exception", SIGABRT)
    after it finished, and torchrun tears the other ranks down mid-exit: a completed run reads as
    a crash. Seen once in 1288 tests (tests/integration/test_two_tier_dist.py). Nothing is left
    to finalize by the time this is called: reports are written, files closed, the process group
    left; only the streams and logging's handlers still need their buffers flushed."""
    import logging
    import sys

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can reach it
            pass
    os._exit(code)
