"""Experiment trackers that follow the run across requeues and heal after an outage:
TensorBoard, W&B, MLflow.

Chosen in the job (`metrics.trackers`), written by rank 0 from the ledger's own numbers: the
ledger calls `Trackers.on_event` after each append (dslurm/observe/ledger.py `listeners`), and
dslurm/trackers/feed.py says what each event becomes. The built-in trainer and
`dslurm.runtime.log_metrics` feed them the same way.

The ledger is the source of truth. Never on the training path: `on_event` only queues
(dslurm/trackers/lane.py: one lane per tracker, its own threads, a bounded queue). A tracker
that fails (open, log or close; an error or no answer within `metrics.tracker_timeout_s`) is a
`tracker_failed` and retries with backoff for the whole start; when it answers again it
catches up from the ledger (every point it lacks, in order: dslurm/trackers/backlog.py) and
the ledger says `tracker_healed`. Every opening catches up the same way, so a start also sends
what an earlier one could not. The start's end gives each lane at most
`metrics.tracker_close_s`, and leaves at once a lane that is down or stalled (STALL_S): an exit
never waits on a tracker; what is unsent stays for the next start or `dslurm trackers sync`
(dslurm/trackers/sync.py). Each start ends with one `tracker_delivery` per tracker (delivered,
late, missing, closed), which `dslurm report` sums up.

One tracker run per dslurm run: the ids live in `<run_dir>/trackers.json` (written through
dslurm.durable, before the backend is opened when the id is ours to choose), so every start --
a requeue, a spare swap, a shrink, a resubmission -- appends to the same run, even after a
node failure that ran no callback (Lightning #13524 lost it there). A trackers.json that exists
but cannot be read is refused by name: opening new runs would split the run's curves in two,
silently. The entry of each tracker also says whether its run got its final status (`closed`),
and for W&B what it holds (`held`).

Credentials stay in the user's environment: nothing here reads or writes them (the packages
read WANDB_API_KEY / MLFLOW_TRACKING_TOKEN themselves).

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
from dslurm.trackers.backlog import Held, items_of, missing, points
from dslurm.trackers.feed import feed, purge_from, resumed_step
from dslurm.trackers.lane import Item, Lane

if TYPE_CHECKING:
    from dslurm.config import MetricsSpec

log = logging.getLogger(__name__)
STATE_FILE = TRACKERS  # the run directory's name for it (dslurm/run.py)
BACKENDS = {"tensorboard": "dslurm.trackers.to_tensorboard", "wandb": "dslurm.trackers.to_wandb",
            "mlflow": "dslurm.trackers.to_mlflow"}
"""tracker name -> the module whose `open_run(Start) -> Tracker` opens it (imported when opened),
whose `describe(Start) -> str` names what it talks to and `remote(spec, run_dir)` whether that is
a server; `PACKAGE`: the tracker package it loads"""


STALL_S = 0.3
"""a stop's end leaves a lane whose call has waited this long (or that is down): exit first. A
completed run's end gives a slow (not down) lane its call bound, metrics.tracker_timeout_s, for
the run's final status: nothing is pressing then"""


class Tracker(Protocol):
    def log(self, step: int, values: dict[str, float], t: float = 0.0) -> None:
        """`t`: the ledger event's time (MLflow's timestamp, so a point sent twice is one point)."""

    def held(self) -> Held:
        """What the tracker run holds already (read from the backend where it can be read)."""

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
    sync: bool = False
    """opened by `dslurm trackers sync`, not by a start: nothing purged, the status left as it is"""

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
        self.held: dict[str, Held] = {}
        self.entries: dict[str, dict[str, Any]] = {}
        self.failed: dict[str, str] = {}
        self.state: dict[str, Any] = {}
        self.opened = self.closed = False
        self._lock = threading.Lock()  # an async save's ckpt_save is appended from its own thread
        self._state_lock = threading.Lock()  # the lanes open (and write trackers.json) concurrently
        self._start: tuple[int, int] | None = None  # (this start's number, resumed) once counted
        self._state_error: StateUnreadable | None = None
        self._live_from = 0.0  # the opening event's time: items from then on are this start's own

    # ------------------------------------------------------------------ the feed (training thread)

    def on_event(self, ev: events.Event) -> None:
        """A ledger listener: what `ev` becomes, queued for every lane. Never waits for a tracker,
        except for the start's close at its exit event (bounded, and never for a stalled one)."""
        if self.closed or isinstance(ev, (events.TrackerFailed, events.TrackerDropped, events.TrackerHealed,
                                          events.TrackerDelivery)):
            return
        with self._lock:
            f = feed(ev)
            if f is None or (not self.opened and not f.opens):
                return
            if not self.opened:
                self._live_from = ev.t
                self.open(resumed_step(ev))
            for item in items_of(ev):
                for lane in self.lanes.values():
                    lane.offer(item)
        if f.closes:
            self.close(ending=getattr(ev, "reason", None))

    # ------------------------------------------------------------------ open, catch up, close

    def open(self, resumed: int) -> None:
        """Start a lane for every configured tracker of a start that resumed after `resumed` steps
        (each opens in its own thread; trackers.json is read there, not here)."""
        self.opened = True
        self._resumed = resumed
        for name in self.spec.trackers:
            self.lanes[name] = Lane(name, self._opener(name), timeout_s=self.spec.tracker_timeout_s,
                                    close_s=self.spec.tracker_close_s, fail=self._lane_failed,
                                    send=self._sender(name), catch_up=self._catch_up(name), healed=self._healed,
                                    send_many=self._many_sender(name))
            self.lanes[name].live_from = self._live_from
            self.lanes[name].remote = importlib.import_module(BACKENDS[name]).remote(self.spec, self.run_dir)

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
                entry = self.entries.setdefault(name, dict(self.state.get(name) or {}))
            lane.note("import")  # loading the package: a close does not count it as a stall
            backend = importlib.import_module(BACKENDS[name])
            importlib.import_module(backend.PACKAGE)
            lane.note("connect")
            ctx = Start(run_dir=self.run_dir, job=self.job, start=start, resumed=self._resumed, spec=self.spec,
                        state=entry, save=lambda: self._save_entry(name, entry), note=lane.note)
            lane.what = backend.describe(ctx)
            tracker: Tracker = backend.open_run(ctx)
            entry["closed"] = False
            self._save_entry(name, entry)
            self.held[name] = tracker.held()
            if start:
                self._send(name, tracker, Item("log", step=self._resumed, values={"run/restarts": float(start)},
                                               t=self._live_from))
            return tracker
        return open_lane

    def _send(self, name: str, tracker: Tracker, item: Item) -> bool:
        """Send what of `item` the tracker lacks (False: it holds all of it)."""
        held = self.held.setdefault(name, Held())
        fresh = held.fresh(item)
        if fresh is None:
            return False
        if fresh.kind == "log":
            tracker.log(fresh.step, fresh.values or {}, t=fresh.t)
        else:
            tracker.event(fresh.text, fresh.step)
        held.took(fresh)
        return True

    def _many_sender(self, name: str) -> Callable[[Any, list[Item]], list[bool]]:
        def send_many(tracker: Any, items: list[Item]) -> list[bool]:
            """Several items in few calls where the backend can (MLflow's log_batch); True per item sent."""
            held = self.held.setdefault(name, Held())
            fresh = [held.fresh(i) for i in items]
            logs = [f for f in fresh if f is not None and f.kind == "log"]
            if logs and hasattr(tracker, "log_many"):
                tracker.log_many(logs)
                for f in logs:
                    held.took(f)
                rest = [f for f in fresh if f is not None and f.kind != "log"]
            else:
                rest = [f for f in fresh if f is not None]
            for f in rest:
                self._send(name, tracker, f)
            return [f is not None for f in fresh]
        return send_many

    def _sender(self, name: str) -> Callable[[Any, Item, bool], bool]:
        return lambda tracker, item, late: self._send(name, tracker, item)

    def _catch_up(self, name: str) -> Callable[[Any], list[Item]]:
        """What the tracker lacks of the whole ledger (read when the lane opens or heals)."""
        def lacking(tracker: Any) -> list[Item]:
            return missing(points(events.read(self.run_dir)), self.held.setdefault(name, Held()))
        return lacking

    def close(self, ending: str | None = None) -> None:
        """End every lane: what is queued is sent and the backends close, within
        metrics.tracker_close_s in all; a lane that is down or stalled (its call waiting over
        STALL_S; a completed run: over its call bound) is left at once, its unsent points kept in
        the ledger for the next start or `dslurm trackers sync`. Then one `tracker_delivery` per
        tracker."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        t0 = time.monotonic()
        deadline = t0 + self.spec.tracker_close_s
        for lane in self.lanes.values():
            lane.final_try = ending == "completed"
            lane.offer(Item("close", ending=ending))
        left: set[str] = set()
        stall_s = self.spec.tracker_timeout_s if ending == "completed" else STALL_S
        while time.monotonic() < deadline:
            waiting = [lane for lane in self.lanes.values() if not lane.finished.is_set() and lane.name not in left]
            left.update(lane.name for lane in waiting if lane.stalled(stall_s))
            if not [lane for lane in waiting if lane.name not in left]:
                break
            time.sleep(0.01)
        for lane in self.lanes.values():
            lane.abandoned = not lane.finished.is_set()
            if not lane.finished.is_set():  # reported once, whoever sees it first (the lane's lock)
                lane.give_up(TimeoutError(
                    f"left at the start's end after {time.monotonic() - t0:.1f} s ({lane.doing} with {lane.what} "
                    f"waiting {time.monotonic() - lane.since:.1f} s): what it did not send stays in the ledger"))
            self._delivered(lane, ending)

    def _delivered(self, lane: Lane, ending: str | None) -> None:
        missed = lane.missed + lane.left_queued()
        entry = self.entries.get(lane.name)
        if entry is not None:
            entry["closed"] = lane.closed_ok
            if lane.name in self.held:
                entry["held"] = self.held[lane.name].to_json()
            self._save_entry(lane.name, entry)
        if missed:
            log.warning("tracker %s: %d item(s) not sent in this start; the ledger has every number "
                        "(the next start sends them, or `dslurm trackers sync %s --to %s`)",
                        lane.name, missed, self.run_dir, lane.name)
        self._report(events.TrackerDelivery(tracker=lane.name, delivered=lane.delivered, late=lane.backfilled,
                                            missing=missed, closed=lane.closed_ok, outages=lane.outages,
                                            by="start"))

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
        log.error("tracker %s failed during %s (training goes on; it retries and catches up from the ledger): %s",
                  lane.name, during.split(":")[0], error)
        self._report(events.TrackerFailed(tracker=lane.name, error=error, during=during.split(":")[0]))

    def _healed(self, lane: Lane, down_s: float, sent: int) -> None:
        log.warning("tracker %s answers again after %.1f s: %d item(s) sent late from the ledger",
                    lane.name, down_s, sent)
        self._report(events.TrackerHealed(tracker=lane.name, down_s=round(down_s, 3), late=sent))

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
