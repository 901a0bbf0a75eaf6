"""One tracker's lane: its queue and its two threads, so nothing a tracker does runs on the
training thread and no tracker call is waited for past its bound.

The training thread only `offer`s items (a dict, a string): a queue put that never blocks. A
full queue (QUEUE_MAX items waiting: the tracker is slower than the run) drops the item and
counts it. The lane's worker thread takes the items in order and hands each call (open, log,
event, close) to the lane's caller thread, waiting at most the call's bound. A call that has
not answered by then -- a server that accepts and never answers, a client retrying a 503 for
minutes (MLflow's own HTTP retries alone last ~10 min) -- fails the lane: reported once, with
what it waited for, and the lane is off for the rest of this start: what was queued and what
comes later is counted as dropped, never sent. The caller thread stuck in that call is a
daemon and is left behind (nothing can interrupt a blocked socket read in another thread);
the process exits without waiting for it (dslurm.worker_exit.leave).

Torch-free; no tracker package is imported here.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

QUEUE_MAX = 4096
"""items waiting per tracker before new ones are dropped (a step's values are one item)"""


@dataclass(frozen=True, slots=True)
class Item:
    """One thing for a tracker to do: `log` values at step, an `event` note, or `close`."""
    kind: str
    step: int = 0
    values: dict[str, float] | None = None
    text: str = ""
    ending: str | None = None


class _Caller:
    """A daemon thread that runs one call at a time; `run` waits for it at most `bound_s`."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], _Box]] = queue.SimpleQueue()
        threading.Thread(target=self._loop, name=f"dslurm-tracker-{name}-call", daemon=True).start()

    def _loop(self) -> None:
        while True:
            fn, box = self._calls.get()
            try:
                box.value = fn()
            except BaseException as exc:  # handed to the lane, which reports it
                box.error = exc
            box.done.set()

    def run(self, fn: Callable[[], Any], bound_s: float) -> _Box:
        box = _Box()
        self._calls.put((fn, box))
        box.done.wait(bound_s)
        return box


class _Box:
    __slots__ = ("done", "value", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


class NoAnswer(TimeoutError):
    """A tracker call that did not answer within its bound."""


class Lane:
    """One tracker of one start. `opener()` opens its backend (in the caller thread) and returns
    it; `fail(lane, during, exc)` reports a failure (called once, from whichever thread saw it)."""

    def __init__(self, name: str, opener: Callable[[Lane], Any], *, timeout_s: float, close_s: float,
                 fail: Callable[[Lane, str, BaseException], None]) -> None:
        self.name, self.opener, self.timeout_s, self.close_s, self._fail_cb = name, opener, timeout_s, close_s, fail
        self.what = name
        """what the lane talks to (the backend says: a server's URI, a directory), for the error"""
        self.doing = "open"
        """the call in progress (open, log, event, close) and, where the backend says, its part"""
        self.since = time.monotonic()
        self.dropped_full = self.dropped_off = self.delivered = 0
        """items dropped while the queue was full, items dropped once the lane was off, items sent"""
        self.off = False
        self.opened = threading.Event()
        """set once the backend's open answered"""
        self.finished = threading.Event()
        self._q: queue.SimpleQueue[Item] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._caller = _Caller(name)
        threading.Thread(target=self._work, name=f"dslurm-tracker-{name}", daemon=True).start()

    # ------------------------------------------------------------ the training thread's side

    @property
    def dropped(self) -> int:
        return self.dropped_full + self.dropped_off

    def offer(self, item: Item) -> None:
        """Queue `item`; never blocks. Dropped (and counted) when the lane is off or full."""
        if item.kind != "close" and self.off:
            self.dropped_off += 1
            return
        if item.kind != "close" and self._q.qsize() >= QUEUE_MAX:
            self.dropped_full += 1
            return
        self._q.put(item)

    def note(self, part: str) -> None:
        """The backend names the part of its call now waiting (e.g. MLflow's create_run)."""
        self.doing = f"{self.doing.split(':')[0]}: {part}"

    def give_up(self, waited_s: float) -> None:
        """The start's close could not wait longer: fail the lane if it has not finished."""
        if not self.finished.is_set():
            self._fail(self.doing, NoAnswer(
                f"not done when the start ended (its close waited {waited_s:.1f} s) with {self.what} ({self.doing} "
                f"waiting {time.monotonic() - self.since:.1f} s, {self._q.qsize()} item(s) queued): left unfinished"))

    # ------------------------------------------------------------ the lane's threads

    def _work(self) -> None:
        tracker: Any = None
        try:
            if self._call("open", lambda: self.opener(self), self.timeout_s):
                tracker = self._result
                self.opened.set()
            while True:
                item = self._q.get()
                if item.kind == "close":
                    if tracker is not None and not self.off:
                        self._call("close", lambda: tracker.close(item.ending), self.close_s)
                    return
                if tracker is None or self.off:
                    self.dropped_off += 1
                    continue
                if item.kind == "log":
                    call: Callable[[], Any] = lambda: tracker.log(item.step, item.values or {})  # noqa: E731
                else:
                    call = lambda: tracker.event(item.text, item.step)  # noqa: E731
                if self._call(item.kind, call, self.timeout_s):
                    self.delivered += 1
        finally:
            self.finished.set()

    _result: Any = None

    def _call(self, during: str, fn: Callable[[], Any], bound_s: float) -> bool:
        """Run `fn` in the caller thread, waiting at most `bound_s`; False (and the lane off) if
        it raised or did not answer."""
        self.doing, self.since = during, time.monotonic()
        box = self._caller.run(fn, bound_s)
        if not box.done.is_set():
            self._fail(self.doing, NoAnswer(self._no_answer(bound_s)))
            return False
        if box.error is not None:
            self._fail(during, box.error)
            return False
        self._result = box.value
        return not self.off

    def _no_answer(self, bound_s: float) -> str:
        return f"no answer within {bound_s:g} s from {self.what} ({self.doing}): off for the rest of this start"

    def _fail(self, during: str, exc: BaseException) -> None:
        with self._lock:
            if self.off:
                return
            self.off = True
        while True:  # what was queued will not be sent: counted with the later offers
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if item.kind == "close":
                self._q.put(item)  # the worker still ends on it
                break
            self.dropped_off += 1
        self._fail_cb(self, during.split(":")[0], exc)
