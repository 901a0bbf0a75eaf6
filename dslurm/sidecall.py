"""A call run on a daemon thread of its own, waited for with a bound: the one home of what the
trackers' lanes (dslurm/trackers/lane.py) and the trainer's batch reader (train/step.py) both
need -- a call that may block on the outside world (a socket, a stalled file system) must never
hold the thread that asked for it past its bound.

`Caller` runs one call at a time, in order, on its own daemon thread; `submit` hands it a call
and returns its `Box` at once, `run` waits for the box at most `bound_s`. A call still running
when its waiter gives up is left to finish (nothing can interrupt a blocked read in another
thread); the thread is a daemon, so the process never waits for it at exit.

Ground floor: imports nothing of dslurm (tests/package_graph.py).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any


class Box:
    """One call's outcome: `done` once it returned or raised; `value` or `error`."""
    __slots__ = ("done", "value", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class Caller:
    """A daemon thread named `name` that runs the calls handed to it, one at a time, in order."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], Box]] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, box = self._calls.get()
            try:
                box.value = fn()
            except BaseException as exc:  # handed to whoever waits on the box
                box.error = exc
            box.done.set()

    def submit(self, fn: Callable[[], Any]) -> Box:
        """Queue `fn`; returns its box at once."""
        box = Box()
        self._calls.put((fn, box))
        return box

    def run(self, fn: Callable[[], Any], bound_s: float) -> Box:
        """Queue `fn` and wait at most `bound_s` for it (`box.done` says whether it answered)."""
        box = self.submit(fn)
        box.done.wait(bound_s)
        return box
