"""Experiment trackers that follow the run across requeues: TensorBoard, W&B, MLflow.

Chosen in the job (`metrics.trackers`), written by rank 0 from the ledger's own numbers: the
ledger calls `Trackers.on_event` after each append (dslurm/observe/ledger.py `listeners`), and
dslurm/trackers/feed.py says what each event becomes. The built-in trainer and
`dslurm.runtime.log_metrics` feed them the same way.

Never on the training path: `on_event` only queues (dslurm/trackers/lane.py: one lane per
tracker, its own threads, a bounded queue). Opening, logging, annotating and closing run in
the lane; a call that has not answered within `metrics.tracker_timeout_s` (a server that
accepts and never answers, a client retrying for minutes) is a `tracker_failed` naming what it
waited for, and that tracker is off for the rest of the start. The start's end waits at most
`metrics.tracker_close_s` for the lanes to drain and close (inside Slurm's KillWait on a stop);
items a lane could not take (its queue full, or the lane off) are counted in `tracker_dropped`.

One tracker run per dslurm run: the ids live in `<run_dir>/trackers.json` (written through
dslurm.durable, before the backend is opened when the id is ours to choose), so every start --
a requeue, a spare swap, a shrink, a resubmission -- appends to the same run, even after a
node failure that ran no callback (Lightning #13524 lost it there). A trackers.json that exists
but cannot be read is refused by name: opening new runs would split the run's curves in two,
silently. The steps a start trains again after a crash replace the earlier points from
`feed.purge_from(resumed)` on.

A tracker that fails (its package missing, a full disk, a server down or silent) is reported
once, to the log and as a `tracker_failed` ledger event, and is off for the rest of the start;
training never stops for it. Credentials stay in the user's environment: nothing here reads or
writes them (the packages read WANDB_API_KEY / MLFLOW_TRACKING_TOKEN themselves).

Torch-free, and no tracker package is imported until a lane opens (the CLI stays instant).
"""

from __future__ import annotations

import importlib
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dslurm.durable import atomic_write_text
from dslurm.observe import events
from dslurm.run import TRACKERS
from dslurm.trackers import lane as lanes
from dslurm.trackers.feed import feed, purge_from, resumed_step
from dslurm.trackers.lane import Item, Lane

if TYPE_CHECKING:
    from dslurm.config import MetricsSpec

log = logging.getLogger(__name__)
STATE_FILE = TRACKERS  # the run directory's name for it (dslurm/run.py)
BACKENDS = {"tensorboard": "dslurm.trackers.to_tensorboard", "wandb": "dslurm.trackers.to_wandb",
            "mlflow": "dslurm.trackers.to_mlflow"}
"""tracker name -> the module whose `open_run(Start) -> Tracker` opens it (imported when opened) and
whose `describe(Start) -> str` names what it talks to"""


class Tracker(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def event(self, text: str, step: int) -> None: ...

    def close(self, ending: str | None) -> None:
        """`ending`: the exit reason when the start ended (None: closed without an exit event)."""


@dataclass(slots=True)
class Start:
    """What a backend needs to open its run for this start."""
    run_dir: Path
    job: str
    """the job's name (experiment / project / run name)"""
    start: int
    """0 for the run's first start, then 1, 2, ... (counted in trackers.json, whatever restarted it)"""
    resumed: int
    """completed steps this start resumed after"""
    spec: MetricsSpec
    state: dict[str, Any] = field(default_factory=dict)
    """this backend's entry in trackers.json (its run id); `save()` makes a change durable"""
    save: Callable[[], None] = lambda: None
    note: Callable[[str], None] = lambda part: None
    """names the part of the open now waiting (e.g. "create_run"), for a no-answer error"""

    @property
    def purge_from(self) -> int:
        return purge_from(self.resumed)


class StateUnreadable(OSError):
    """trackers.json exists but cannot be read: opening would start second tracker runs."""


def read_state(run_dir: str | Path) -> dict[str, Any]:
    """trackers.json; {} when there is none yet. Raises StateUnreadable (naming the file and the
    fix) when it exists but cannot be read: new tracker runs would silently split the run."""
    path = Path(run_dir) / STATE_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise StateUnreadable(f"{path} cannot be read ({type(exc).__name__}: {exc}); not opening new tracker "
                              "runs, which would split this run's curves in two. Fix: restore the file (it "
                              "holds each tracker's run id), or delete it to start new tracker runs") from exc
    if not isinstance(data, dict):
        raise StateUnreadable(f"{path} holds {type(data).__name__}, not an object of tracker run ids; not "
                              "opening new tracker runs. Fix: restore the file, or delete it to start new ones")
    return data


class Trackers:
    """The job's trackers for one start: opened at the start's first fed event, fed every
    ledger event after it, closed at its exit event (or `close()`)."""

    def __init__(self, run_dir: str | Path, spec: MetricsSpec, job: str,
                 report: Callable[[events.Event], Any] | None = None) -> None:
        self.run_dir, self.spec, self.job, self.report = Path(run_dir), spec, job, report
        self.lanes: dict[str, Lane] = {}
        self.failed: dict[str, str] = {}
        self.failed_during: dict[str, str] = {}
        self.state: dict[str, Any] = {}
        self.opened = self.closed = False
        self._lock = threading.Lock()  # an async save's ckpt_save is appended from its own thread
        self._state_lock = threading.Lock()  # the lanes open (and write trackers.json) concurrently
        self._start: tuple[int, int] | None = None  # (this start's number, resumed) once counted
        self._state_error: StateUnreadable | None = None

    # ------------------------------------------------------------------ the feed (training thread)

    def on_event(self, ev: events.Event) -> None:
        """A ledger listener: what `ev` becomes, queued for every lane. Never waits for a tracker,
        except for the start's close at its exit event (bounded by metrics.tracker_close_s)."""
        if self.closed or isinstance(ev, (events.TrackerFailed, events.TrackerDropped)):
            return
        with self._lock:
            f = feed(ev)
            if f is None or (not self.opened and not f.opens):
                return
            if not self.opened:
                self.open(resumed_step(ev))
            for lane in self.lanes.values():
                if f.values:
                    lane.offer(Item("log", step=f.step, values=f.values))
                if f.note:
                    lane.offer(Item("event", step=f.step, text=f.note))
        if f.closes:
            self.close(ending=getattr(ev, "reason", None))

    # ------------------------------------------------------------------ open, close

    def open(self, resumed: int) -> None:
        """Start a lane for every configured tracker of a start that resumed after `resumed` steps
        (each opens in its own thread; trackers.json is read there, not here)."""
        self.opened = True
        self._resumed = resumed
        for name in self.spec.trackers:
            self.lanes[name] = Lane(name, self._opener(name), timeout_s=self.spec.tracker_timeout_s,
                                    close_s=self.spec.tracker_close_s, fail=self._lane_failed)

    _resumed = 0

    def _count_start(self) -> int:
        """This start's number from trackers.json, counted once (the first lane to open does it)."""
        with self._state_lock:
            if self._state_error is not None:
                raise self._state_error
            if self._start is None:
                try:
                    self.state = read_state(self.run_dir)
                except StateUnreadable as exc:
                    self._state_error = exc
                    raise
                start = int(self.state.get("starts", 0))
                self.state["starts"] = start + 1
                self._write()
                self._start = (start, self._resumed)
            return self._start[0]

    def _opener(self, name: str) -> Callable[[Lane], Tracker]:
        def open_lane(lane: Lane) -> Tracker:
            start = self._count_start()
            with self._state_lock:
                entry = dict(self.state.get(name) or {})
            backend = importlib.import_module(BACKENDS[name])
            ctx = Start(run_dir=self.run_dir, job=self.job, start=start, resumed=self._resumed, spec=self.spec,
                        state=entry, save=lambda: self._save_entry(name, entry), note=lane.note)
            lane.what = backend.describe(ctx)
            tracker: Tracker = backend.open_run(ctx)
            self._save_entry(name, entry)
            if start:
                tracker.log(self._resumed, {"run/restarts": float(start)})
            return tracker
        return open_lane

    def close(self, ending: str | None = None) -> None:
        """End every lane: what is queued is sent and the backends close, waiting at most
        metrics.tracker_close_s in all; a lane that has not finished by then is a tracker_failed."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        now = time.monotonic()
        deadline = now + self.spec.tracker_close_s
        for lane in self.lanes.values():
            lane.offer(Item("close", ending=ending))
        for lane in self.lanes.values():
            lane.finished.wait(max(0.0, deadline - time.monotonic()))
        for lane in self.lanes.values():
            lane.give_up(time.monotonic() - now)
            if lane.dropped:
                why = "; ".join(filter(None, [
                    f"{lane.dropped_full} while its queue was full ({lanes.QUEUE_MAX} waiting)"
                    if lane.dropped_full else "",
                    f"{lane.dropped_off} once it was off (tracker_failed during "
                    f"{self.failed_during.get(lane.name, '?')})" if lane.dropped_off else ""]))
                log.warning("tracker %s: %d item(s) not sent: %s; the ledger has every number",
                            lane.name, lane.dropped, why)
                self._report(events.TrackerDropped(tracker=lane.name, items=lane.dropped,
                                                   delivered=lane.delivered, why=why))

    def _save_entry(self, name: str, entry: dict[str, Any]) -> None:
        """A backend's entry is durable (called from its lane, which alone changes `entry`)."""
        with self._state_lock:
            self.state[name] = dict(entry)
            self._write()

    def _write(self) -> None:
        try:
            atomic_write_text(self.run_dir / STATE_FILE, json.dumps(self.state, indent=1, sort_keys=True) + "\n")
        except OSError as exc:  # the next start would open a new tracker run: say so, go on
            log.error("trackers: could not write %s: %s", self.run_dir / STATE_FILE, exc)

    # ------------------------------------------------------------------ failures

    def _lane_failed(self, lane: Lane, during: str, exc: BaseException) -> None:
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:400]
        if isinstance(exc, ImportError):
            error += " (install the trackers extra: pip install 'dslurm[trackers]')"
        with self._state_lock:
            self.failed[lane.name] = error
            self.failed_during[lane.name] = during
        log.error("tracker %s failed during %s, off for the rest of this start (training goes on): %s",
                  lane.name, during, error)
        self._report(events.TrackerFailed(tracker=lane.name, error=error, during=during))

    def _report(self, ev: events.Event) -> None:
        if self.report is not None:
            try:
                self.report(ev)
            except Exception as rexc:
                log.error("trackers: could not record %s: %s", ev.NAME, rexc)


def attach(ledger: Any, run_dir: str | Path, spec: MetricsSpec | None, job: str) -> Trackers | None:
    """Rank 0: the job's trackers listening to `ledger` (None when the job configures none)."""
    if ledger is None or spec is None or not spec.trackers:
        return None
    trackers = Trackers(run_dir, spec, job, report=ledger.append)
    ledger.listeners.append(trackers.on_event)
    return trackers
