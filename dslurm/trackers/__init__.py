"""Experiment trackers that follow the run across requeues: TensorBoard, W&B, MLflow.

Chosen in the job (`metrics.trackers`), written by rank 0 from the ledger's own numbers: the
ledger calls `Trackers.on_event` after each append (dslurm/observe/ledger.py `listeners`), and
dslurm/trackers/feed.py says what each event becomes. The built-in trainer and
`dslurm.runtime.log_metrics` feed them the same way.

One tracker run per dslurm run: the ids live in `<run_dir>/trackers.json` (written through
dslurm.durable, before the backend is opened when the id is ours to choose), so every start --
a requeue, a spare swap, a shrink, a resubmission -- appends to the same run, even after a
node failure that ran no callback (Lightning #13524 lost it there). The steps a start trains
again after a crash replace the earlier points from `feed.purge_from(resumed)` on.

A tracker that fails (its package missing, a full disk, a server down) is reported once, to
the log and as a `tracker_failed` ledger event, and is off for the rest of the start; training
never stops for it. Credentials stay in the user's environment: nothing here reads or writes
them (the packages read WANDB_API_KEY / MLFLOW_TRACKING_TOKEN themselves).

Torch-free, and no tracker package is imported until a tracker opens (the CLI stays instant).
"""

from __future__ import annotations

import importlib
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from dslurm.durable import atomic_write_text
from dslurm.observe import events
from dslurm.trackers.feed import Feed, feed, purge_from, resumed_step

if TYPE_CHECKING:
    from dslurm.config import MetricsSpec

log = logging.getLogger(__name__)
STATE_FILE = "trackers.json"
BACKENDS = {"tensorboard": "dslurm.trackers.to_tensorboard", "wandb": "dslurm.trackers.to_wandb",
            "mlflow": "dslurm.trackers.to_mlflow"}
"""tracker name -> the module whose `open_run(Start) -> Tracker` opens it (imported when opened)"""


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

    @property
    def purge_from(self) -> int:
        return purge_from(self.resumed)


def read_state(run_dir: str | Path) -> dict[str, Any]:
    """trackers.json ({} when missing or unreadable: a new tracker run is better than none)."""
    try:
        data = json.loads((Path(run_dir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


class Trackers:
    """The job's trackers for one start: opened at the start's first fed event, fed every
    ledger event after it, closed at its exit event (or `close()`)."""

    def __init__(self, run_dir: str | Path, spec: MetricsSpec, job: str,
                 report: Callable[[events.Event], Any] | None = None) -> None:
        self.run_dir, self.spec, self.job, self.report = Path(run_dir), spec, job, report
        self.live: dict[str, Tracker] = {}
        self.failed: dict[str, str] = {}
        self.state: dict[str, Any] = {}
        self.opened = self.closed = False
        self._lock = threading.Lock()  # an async save's ckpt_save is appended from its own thread

    # ------------------------------------------------------------------ the feed

    def on_event(self, ev: events.Event) -> None:
        """A ledger listener: what `ev` becomes in every live tracker."""
        if self.closed or isinstance(ev, events.TrackerFailed):
            return
        with self._lock:
            self._on_event(ev)

    def _on_event(self, ev: events.Event) -> None:
        f = feed(ev)
        if f is None or (not self.opened and not f.opens):
            return
        if not self.opened:
            self.open(resumed_step(ev))
        self.write(f)
        if f.closes:
            self.close(ending=getattr(ev, "reason", None))

    def write(self, f: Feed) -> None:
        for name in list(self.live):
            if f.values:
                self._guard(name, "log", lambda t: t.log(f.step, f.values))
            if f.note:
                self._guard(name, "event", lambda t: t.event(f.note or "", f.step))

    # ------------------------------------------------------------------ open, close

    def open(self, resumed: int) -> None:
        """Open every configured tracker for a start that resumed after `resumed` steps."""
        self.opened = True
        self.state = read_state(self.run_dir)
        start = int(self.state.get("starts", 0))
        self.state["starts"] = start + 1
        self._save()
        for name in self.spec.trackers:
            entry = self.state.setdefault(name, {})
            ctx = Start(run_dir=self.run_dir, job=self.job, start=start, resumed=resumed, spec=self.spec,
                        state=entry, save=self._save)
            try:
                self.live[name] = importlib.import_module(BACKENDS[name]).open_run(ctx)
            except Exception as exc:
                self._failed(name, "open", exc)
                continue
            if start:
                self._guard(name, "log", lambda t: t.log(resumed, {"run/restarts": float(start)}))

    def close(self, ending: str | None = None) -> None:
        if self.closed:
            return
        self.closed = True
        for name in list(self.live):
            self._guard(name, "close", lambda t: t.close(ending))
        self.live.clear()

    def _save(self) -> None:
        try:
            atomic_write_text(self.run_dir / STATE_FILE, json.dumps(self.state, indent=1, sort_keys=True) + "\n")
        except OSError as exc:  # the next start would open a new tracker run: say so, go on
            log.error("trackers: could not write %s: %s", self.run_dir / STATE_FILE, exc)

    # ------------------------------------------------------------------ failures

    def _guard(self, name: str, during: str, call: Callable[[Tracker], None]) -> None:
        tracker = self.live.get(name)
        if tracker is None:
            return
        try:
            call(tracker)
        except Exception as exc:  # any tracker error: off for this start, training goes on
            del self.live[name]
            self._failed(name, during, exc)

    def _failed(self, name: str, during: str, exc: BaseException) -> None:
        error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        if isinstance(exc, ImportError):
            error += " (install the trackers extra: pip install 'dslurm[trackers]')"
        self.failed[name] = error
        log.error("tracker %s failed during %s, off for the rest of this start (training goes on): %s",
                  name, during, error)
        if self.report is not None:
            try:
                self.report(events.TrackerFailed(tracker=name, error=error, during=during))
            except Exception as rexc:
                log.error("tracker %s: could not record the failure: %s", name, rexc)


def attach(ledger: Any, run_dir: str | Path, spec: MetricsSpec | None, job: str) -> Trackers | None:
    """Rank 0: the job's trackers listening to `ledger` (None when the job configures none)."""
    if ledger is None or spec is None or not spec.trackers:
        return None
    trackers = Trackers(run_dir, spec, job, report=ledger.append)
    ledger.listeners.append(trackers.on_event)
    return trackers
