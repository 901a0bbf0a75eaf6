"""`dslurm trackers sync RUN_DIR [--to tensorboard|mlflow|wandb]`: the run's ledger into a tracker,
after the fact -- a run that had no tracker, or points a tracker still lacks after an outage.

The same tracker runs as the starts use (trackers.json), and only what the tracker lacks is sent
(dslurm/trackers/backlog.py: what it holds is read back from it -- MLflow's store, TensorBoard's
event files -- or, for W&B, from trackers.json), so a second sync sends nothing. When the
ledger's last start has ended, the tracker run gets its final status (MLflow FINISHED / KILLED /
FAILED) if no start could give it one. The ledger says what the sync did (`tracker_delivery`,
`by: sync`), so `dslurm report` counts it.

Run it when no start of the run is training (a start sends its own points; both at once may
send a point twice, which MLflow's sqlite store keeps once and W&B drops).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
from pathlib import Path
from typing import Any

from dslurm.durable import atomic_write_text
from dslurm.errors import UserError
from dslurm.observe import events
from dslurm.observe.ledger import Ledger
from dslurm.run import LEDGER, RunDir
from dslurm.trackers import BACKENDS, STATE_FILE, Start, StateUnreadable, read_state
from dslurm.trackers.backlog import missing, points
from dslurm.trackers.lane import Item

log = logging.getLogger(__name__)


class TrackerUnreachable(UserError):
    """The tracker failed during a sync (exit 1): what was sent stays sent; a rerun sends the rest."""
    exit_code = 1


def ending_of(evs: list[events.Event]) -> str | None:
    """The exit reason of the ledger's last start when it has ended; None while one may be training."""
    last_start = max((i for i, e in enumerate(evs) if isinstance(e, events.TrainStart)), default=-1)
    ends = [e for e in evs[last_start + 1:] if isinstance(e, events.Exit)]
    return ends[-1].reason if ends else None


def _spec_and_job(run_dir: Path) -> tuple[Any, str]:
    """The job's metrics section and name from its frozen job.yaml; without one (a run started by
    hand), the defaults and the directory's name. A job.yaml that does not load is said, not fatal:
    `--to` names the tracker anyway."""
    from dslurm.config import MetricsSpec, load_job

    rd = RunDir(run_dir)
    if rd.is_run():
        try:
            job = load_job(rd.job_yaml)
            return job.metrics, job.name
        except UserError as exc:
            log.warning("%s does not load (%s); using the default tracker settings", rd.job_yaml, exc)
    return MetricsSpec(), run_dir.resolve().name


def sync(run_dir: Path, name: str) -> events.TrackerDelivery:
    """Send tracker `name` every ledger point it lacks; returns (and records) what was done."""
    spec, job = _spec_and_job(run_dir)
    try:
        state = read_state(run_dir)
    except StateUnreadable as exc:
        raise UserError(str(exc)) from exc
    entry: dict[str, Any] = dict(state.get(name) or {})

    def save() -> None:
        state[name] = dict(entry)
        atomic_write_text(run_dir / STATE_FILE, json.dumps(state, indent=1, sort_keys=True) + "\n")

    evs = events.read(run_dir)
    ending = ending_of(evs)
    backend = importlib.import_module(BACKENDS[name])
    ctx = Start(run_dir=run_dir, job=job, start=int(state.get("starts", 0)), resumed=0, spec=spec, state=entry,
                save=save, sync=True)
    try:
        tracker = backend.open_run(ctx)
        held = tracker.held()
        todo = missing(points(evs), held)
        sent = _send(tracker, todo, held)
        closed = ending is not None and entry.get("closed") is not True
        tracker.close(ending if closed else None)
    except ImportError as exc:
        raise UserError(f"{name}: {exc}; install the trackers extra: pip install 'dslurm[trackers]'") from exc
    except Exception as exc:  # the server is down, the store refuses: nothing recorded as sent
        raise TrackerUnreachable(
            f"{name}: {backend.describe(ctx)} failed: {type(exc).__name__}: {exc}".splitlines()[0]
            + f"; nothing more was sent. Fix: make it reachable and run `dslurm trackers sync {run_dir} --to "
            f"{name}` again (it sends only what is missing)") from exc
    entry["held"] = held.to_json()
    if ending is not None:
        entry["closed"] = True
    save()
    done = events.TrackerDelivery(tracker=name, delivered=0, late=sent, missing=0, closed=ending is not None,
                                  by="sync")
    return Ledger(run_dir).append(done)  # type: ignore[return-value]


def _send(tracker: Any, items: list[Item], held: Any) -> int:
    """Send `items` in order (MLflow: in batches); each taken into `held`."""
    logs = [i for i in items if i.kind == "log"]
    if hasattr(tracker, "log_many") and logs:
        tracker.log_many(logs)
        for i in logs:
            held.took(i)
        items = [i for i in items if i.kind != "log"]
    for item in items:
        if item.kind == "log":
            tracker.log(item.step, item.values or {}, t=item.t)
        else:
            tracker.event(item.text, item.step)
        held.took(item)
    return len(items) + (len(logs) if hasattr(tracker, "log_many") else 0)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("trackers", help="experiment trackers: replay a run's ledger into one (sync)",
                       description="docs/trackers.md")
    tsub = p.add_subparsers(dest="trackers_command", metavar="ACTION", required=True)
    s = tsub.add_parser("sync", help="send a tracker every ledger point it lacks (same tracker runs; a second "
                                     "sync sends nothing)", description="docs/trackers.md, 'trackers sync'")
    s.add_argument("run_dir", type=Path, help=f"the run directory (its {LEDGER})")
    s.add_argument("--to", choices=sorted(BACKENDS), action="append", dest="to",
                   help="the tracker (repeatable); default: the job's metrics.trackers")
    s.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    run_dir: Path = args.run_dir
    if not RunDir(run_dir).ledger.is_file():
        raise UserError(f"{run_dir}: no {LEDGER} here; give the run directory of a run that started")
    names = args.to or list(_spec_and_job(run_dir)[0].trackers)
    if not names:
        raise UserError(f"{run_dir}: the job configures no tracker; name one with --to tensorboard|mlflow|wandb")
    for name in dict.fromkeys(names):
        d = sync(run_dir, name)
        status = "; its run has its final status" if d.closed else ""
        print(f"{name}: {d.late} item(s) sent{'' if d.late else ' (it held every ledger point already)'}{status}")
    return 0
