"""One tracker's lane: its queue and its two threads, so nothing a tracker does runs on the
training thread, no tracker call is waited for past its bound, and a tracker that failed heals.

The training thread only `offer`s items (a dict, a string): a queue put that never blocks. A
full queue (QUEUE_MAX items waiting: the tracker is slower than the run) does not queue the
item and counts it as missed. The lane's worker thread takes the items in order and hands
each call (open, log, event, close) to the lane's caller thread (dslurm/sidecall.py), waiting
at most the call's bound.

A call that raised or has not answered by its bound -- a server that accepts and never
answers, a client retrying a 503 for minutes -- puts the lane *down*: reported once per
outage (`fail`), what was queued is counted as missed, and new offers are counted, not
queued. The lane then heals by itself, for the whole start:

- a call that did not answer is still waited for (a frozen server answers what it holds when
  it comes back); once it returns, or after a call that raised, the lane tries again with
  backoff (BACKOFF_S, doubling to BACKOFF_MAX_S): open the backend if it never opened, then
  catch up;
- catching up (`catch_up`, given by dslurm/trackers/__init__.py) reads the ledger and sends,
  in order, every point the tracker lacks: the ledger is the source of truth. The lane takes
  offers again *before* it reads the ledger, so nothing falls between the two; the points
  both carry are sent once (dslurm/trackers/backlog.py `Held`).

An exit never waits on a down lane: `close` is queued, and a lane that is down or whose call
is stalled is left by the start's close (dslurm/trackers/__init__.py); what it could not send
stays in the ledger for the next start or `dslurm trackers sync`.

Torch-free; no tracker package is imported here.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dslurm.sidecall import Box, Caller

log = logging.getLogger(__name__)

QUEUE_MAX = 4096
"""items waiting per tracker before new ones are counted as missed (a step's values are one item)"""
BACKOFF_S = 1.0
"""the first wait before a down lane tries again; doubled after each try that fails"""
BACKOFF_MAX_S = 30.0
CHUNK = 100
"""items a catch-up hands the backend in one bounded call (MLflow sends them as one batch)"""


@dataclass(frozen=True, slots=True)
class Item:
    """One thing for a tracker to do: `log` values at step, an `event` note, or `close`.
    `t`: the ledger event's time (MLflow's timestamp: a point sent twice is the same point)."""
    kind: str
    step: int = 0
    values: dict[str, float] | None = None
    text: str = ""
    ending: str | None = None
    t: float = 0.0


class NoAnswer(TimeoutError):
    """A tracker call that did not answer within its bound."""


class Lane:
    """One tracker of one start.

    `opener(lane)` opens the backend (in the caller thread) and returns it; `send(tracker, item,
    late)` sends one item (False: nothing to send, the tracker holds it already); `catch_up(
    tracker) -> [Item]` says what the tracker lacks from the ledger; `fail(lane, during, exc)`
    reports an outage (once per outage); `healed(lane, down_s, sent)` reports its end."""

    def __init__(self, name: str, opener: Callable[[Lane], Any], *, timeout_s: float, close_s: float,
                 fail: Callable[[Lane, str, BaseException], None],
                 send: Callable[[Any, Item, bool], bool] | None = None,
                 catch_up: Callable[[Any], list[Item]] | None = None,
                 send_many: Callable[[Any, list[Item]], list[bool]] | None = None,
                 healed: Callable[[Lane, float, int], None] | None = None) -> None:
        self.name, self.opener, self.timeout_s, self.close_s, self._fail_cb = name, opener, timeout_s, close_s, fail
        self._send = send or _plain_send
        self._catch_up = catch_up
        self._send_many = send_many or (lambda tracker, items: [self._send(tracker, i, True) for i in items])
        self._healed = healed
        self.what = name
        """what the lane talks to (the backend says: a server's URI, a directory), for the error"""
        self.doing = "open"
        """the call in progress (open, log, event, close) and, where the backend says, its part"""
        self.since = time.monotonic()
        """when the call (or the part of it) in progress began"""
        self.missed_full = self.missed_down = self.delivered = self.backfilled = 0
        """items not queued while the queue was full / while down; items sent live; items sent
        late (a catch-up from the ledger)"""
        self.outages = 0
        self.remote = True
        """it talks to a server (a close leaves it when stalled); False: local files, waited for"""
        self.live_from = 0.0
        """the start's opening event's time: a first catch-up sends items from then on as live"""
        self.down = False
        """offers are counted, not queued (a failed call; until a catch-up begins)"""
        self._late_in_outage = 0
        self.in_outage = False
        """from a failure to the end of the catch-up that healed it (reported once each)"""
        self.down_since = 0.0
        self.closed_ok = False
        """the backend's close answered: the tracker run has its final status"""
        self.opened = threading.Event()
        """set once the backend's open answered"""
        self.finished = threading.Event()
        self.closing = threading.Event()
        self.final_try = False
        """a completed run's close: a lane that is down tries once more at once (nothing is pressing)"""
        self._final_tried = False
        self.stuck = False
        """a call that did not answer is still running: nothing else can go before it"""
        self.abandoned = False
        """the start's close left it: it sends nothing more (the ledger keeps it for the next start)"""
        self.tracker: Any = None
        self._q: queue.SimpleQueue[Item] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._caller = Caller(f"dslurm-tracker-{name}-call")
        threading.Thread(target=self._work, name=f"dslurm-tracker-{name}", daemon=True).start()

    # ------------------------------------------------------------ the training thread's side

    @property
    def missed(self) -> int:
        """items this lane has not sent and no catch-up has covered since"""
        return self.missed_full + self.missed_down

    def offer(self, item: Item) -> None:
        """Queue `item`; never blocks. Counted as missed (the ledger has it) when the lane is down
        or its queue full."""
        if item.kind == "close":
            self.closing.set()
            self._q.put(item)
            return
        if self.down:
            self.missed_down += 1
        elif self._q.qsize() >= QUEUE_MAX:
            self.missed_full += 1
        else:
            self._q.put(item)

    def note(self, part: str) -> None:
        """The backend names the part of its call now waiting (e.g. MLflow's create_run)."""
        self.doing, self.since = f"{self.doing.split(':')[0]}: {part}", time.monotonic()

    def stalled(self, stall_s: float) -> bool:
        """Down, or talking to a server and its call (a part of it) waiting longer than `stall_s`:
        a close leaves it."""
        if self.finished.is_set():
            return False
        if not self.remote:
            return self.down and (not self.final_try or self.stuck)
        if self.down and (not self.final_try or self.stuck):
            return True
        importing = self.doing.endswith(": import")  # loading the package is not waiting on a server
        return not importing and time.monotonic() - self.since > stall_s

    def give_up(self, exc: BaseException) -> None:
        """The start's close leaves this lane: down (reported unless it was already)."""
        self._go_down(self.doing, exc)

    def left_queued(self) -> int:
        return max(0, self._q.qsize() - (0 if self.finished.is_set() else 1))

    # ------------------------------------------------------------ the lane's threads

    def _work(self) -> None:
        try:
            self._run()
        finally:
            self.finished.set()

    def _run(self) -> None:
        backoff = BACKOFF_S
        first = True
        while not self.abandoned:
            if self.tracker is None or self.down:
                if self.closing.is_set() and not first:
                    if not self.final_try or self._final_tried or self.stuck:
                        return  # never hold an exit for a tracker that is down
                    self._final_tried = True
                first = False
                if self._connect():
                    backoff = BACKOFF_S
                    continue
                if self.closing.wait(backoff):
                    continue
                backoff = min(2 * backoff, BACKOFF_MAX_S)
                continue
            if self.missed_full and self._q.empty():  # the queue overflowed: the ledger has what it missed
                self._connect()
                continue
            item = self._q.get()
            if self.abandoned:
                return
            if item.kind == "close":
                if self.missed_full and not self._connect():  # what overflowed, before the run's last word
                    return
                if self._call("close", lambda: self.tracker.close(item.ending), self.close_s):
                    self.closed_ok = True
                return
            if self._call(item.kind, lambda: self._send(self.tracker, item, False), self.timeout_s):
                self.delivered += int(bool(self._result))

    def _connect(self) -> bool:
        """Open the backend if it never opened, then catch up from the ledger. True: up again."""
        if self.tracker is None:
            self._late_ok = False
            if not self._call("open", lambda: self.opener(self), self.timeout_s) and not self._late_ok:
                return False
            self.tracker = self._result
            self.opened.set()
        was_down, down_for = self.in_outage, time.monotonic() - self.down_since
        overflowed = self.missed_full > 0
        if self._catch_up is None:
            self.down = self.in_outage = False
            return True
        self.down = False  # offers queue again from here: the catch-up's ledger read covers the rest
        missed = (self.missed_full, self.missed_down)  # covered once this catch-up has sent everything
        catch_up = self._catch_up
        if not self._call("catch-up", lambda: catch_up(self.tracker), self.timeout_s):
            return False
        late_all = was_down or overflowed
        items = list(self._result or [])
        for at in range(0, len(items), CHUNK):  # a bounded call per chunk: a long catch-up is progress
            if self.abandoned:
                return False
            chunk = items[at:at + CHUNK]
            if not self._call("catch-up", functools.partial(self._send_many, self.tracker, chunk), self.timeout_s):
                return False
            for item, sent in zip(chunk, self._result or [], strict=False):
                if not sent:
                    continue
                if late_all or item.t < self.live_from:
                    self.backfilled += 1
                    self._late_in_outage += 1
                else:
                    self.delivered += 1
        self.missed_full -= missed[0]
        self.missed_down -= missed[1]
        self.in_outage = False
        if was_down and self._healed is not None:
            self._healed(self, down_for, self._late_in_outage)
        self._late_in_outage = 0
        return True

    _result: Any = None
    _late_ok = False

    def _call(self, during: str, fn: Callable[[], Any], bound_s: float) -> bool:
        """Run `fn` in the caller thread, waiting at most `bound_s`. False (the lane down) if it
        raised or did not answer; a call that did not answer is still waited for (until the
        start closes): a server that comes back answers it."""
        self.doing, self.since = during, time.monotonic()
        box: Box = self._caller.run(fn, bound_s)
        if not box.done.is_set():
            self._go_down(self.doing, NoAnswer(self._no_answer(bound_s)))
            self.stuck = True
            while not box.done.wait(0.2):
                if self.closing.is_set():
                    return False
            self.stuck = False
            self._late_ok = box.error is None  # it answered after all: an open's tracker is kept
            self._result = box.value
            return False
        if box.error is not None:
            self._go_down(during, box.error)
            return False
        self._result = box.value
        return True

    def _no_answer(self, bound_s: float) -> str:
        then = ("left unfinished: the next start or `dslurm trackers sync` finishes it" if self.doing == "close"
                else "retrying with backoff")
        return f"no answer within {bound_s:g} s from {self.what} ({self.doing}): {then}"

    def _go_down(self, during: str, exc: BaseException) -> None:
        with self._lock:
            if self.down:
                return
            self.down = True
            first = not self.in_outage
            if first:
                self.in_outage, self.down_since = True, time.monotonic()
                self.outages += 1
        while True:  # what was queued is not sent from the queue: the catch-up sends it
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                break
            if item.kind == "close":
                self._q.put(item)  # the worker still ends on it
                break
            self.missed_down += 1
        if first:
            self._fail_cb(self, during.split(":")[0], exc)


def _plain_send(tracker: Any, item: Item, late: bool) -> bool:
    if item.kind == "log":
        tracker.log(item.step, item.values or {})
    else:
        tracker.event(item.text, item.step)
    return True
