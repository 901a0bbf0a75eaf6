"""Where one worker's start goes: named phases from the process's birth to its first step.

The worker (`train/__main__` then `train.loop.Trainer`) calls `mark(name)` at the end of each
phase; rank 0 writes the phases as one `StartPhases` ledger event right after the first
step (dslurm/observe/events/), and `dslurm.observe.phases` turns them into a table with the
launcher's `job_start` (the spawn phase: job start -> this process exists, which only the
reader can compute, since it needs the launcher's record). Torch-free: the entry imports it
before torch. The phase names and their order have one home: `dslurm.observe.phases.PHASES`.
"""

from __future__ import annotations

import os
import time

from dslurm.observe import events
from dslurm.observe.phases import PHASES


def process_start_time(pid: int | str = "self") -> float | None:
    """Wall time at which the OS created this process (Linux /proc), or None elsewhere.
    Earlier than any line of Python: it includes the interpreter's own start-up."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
        # Field 22 (starttime, clock ticks since boot) counted after the ")" of the command name;
        # its clock is CLOCK_BOOTTIME (/proc's btime is whole seconds: too coarse to add to).
        ticks = int(stat[stat.rindex(b")") + 2:].split()[19])
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class StartClock:
    """Seconds per phase of this process's start, measured at the phase boundaries.

    `t0` is the process's birth (from /proc, else the entry's first line): "interpreter" is
    birth -> the entry's first line. A phase marked twice adds up (e.g. two
    builds); marks after `done()` are ignored, so steps after the first cost nothing."""

    def __init__(self, t_entry: float | None = None, born: float | None = None) -> None:
        """`t_entry`: the entry's first line (default now); `born`: the process's birth
        (`process_start_time()`, given only by the process's own entry point)."""
        t_entry = time.time() if t_entry is None else t_entry
        # /proc's starttime has a resolution of one clock tick (10 ms); never after the entry.
        self.t0 = min(born, t_entry) if born is not None and t_entry - born < 600 else t_entry
        self._last = self.t0
        self.phases: dict[str, float] = {}
        self.finished = False
        if t_entry > self.t0:
            self.phases["interpreter"] = round(t_entry - self.t0, 4)
            self._last = t_entry

    def mark(self, name: str) -> float:
        """End the phase `name` now; returns its seconds."""
        now = time.time()
        if self.finished:
            return 0.0
        took = max(0.0, now - self._last)
        self.phases[name] = round(self.phases.get(name, 0.0) + took, 4)
        self._last = now
        return took

    def done(self) -> float:
        """Stop the clock; seconds from the process's birth to the last mark (the start's total)."""
        self.finished = True
        return round(self._last - self.t0, 4)

    def event(self, *, step: int, generation: str | None) -> events.StartPhases:
        """The ledger event of this start (call after `done()`)."""
        unknown = [n for n in self.phases if n not in PHASES]
        if unknown:  # a typo here would silently drop out of the report's order
            raise ValueError(f"unknown start phase(s) {unknown}; known: {', '.join(PHASES)}")
        return events.StartPhases(t0=round(self.t0, 4), phases=dict(self.phases), total_s=self.done(),
                                  step=step, generation=generation)
