"""`dslurm watch RUN_DIR [--once]`: a live view of a training run, refreshed from its ledger.

Current step of train.steps, loss, tokens/s, ETA, the last save, the run's state (the same
completion line as `dslurm report`), the last operator request and tracker failures. `view`
is pure (events in, lines out); the command re-reads the ledger every `--interval` seconds
under rich's Live display, or prints once (`--once`, for scripts and tests). Piped (stdout not
a terminal: a log, ssh, a script) it prints one `line` per change instead and ends when the
run is over, which is how a remote run's watch streams back (RUN_DIR a local handle of a run
on a cluster: docs/remote.md).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dslurm.observe import events as ev

if TYPE_CHECKING:
    from dslurm.observe.completion import Completion


def _last(events: Sequence[ev.Event], *kinds: type[ev.Event]) -> ev.Event | None:
    return next((e for e in reversed(events) if isinstance(e, kinds)), None)


def _age(now: float, t: float) -> str:
    s = max(0, int(now - t))
    return f"{s}s ago" if s < 120 else (f"{s // 60}m ago" if s < 7200 else f"{s / 3600:.1f}h ago")


def eta_s(done: int, target: int | None, step_time_s: float | None) -> float | None:
    """Seconds left at the last window's pace; None when unknown. Pure."""
    if target is None or not step_time_s or step_time_s <= 0 or done >= target:
        return None if target is None or done < target else 0.0
    return (target - done) * step_time_s


def _hms(s: float) -> str:
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def view(events: Sequence[ev.Event], *, target: int | None, state: str, now: float) -> list[str]:
    """The view's lines. Pure."""
    steps = _last(events, ev.Steps)
    start = _last(events, ev.TrainStart)
    done = (steps.last + 1) if isinstance(steps, ev.Steps) and steps.last is not None else (
        start.step if isinstance(start, ev.TrainStart) else 0)
    last_exit = _last(events, ev.Exit, ev.TrainStart)
    ended = last_exit if isinstance(last_exit, ev.Exit) else None  # this start's trainer is gone
    lines = [f"state     {state}"]
    if ended is not None:
        lines.append(f"exited    {ended.reason} at step {ended.step} (code {ended.code}, {_age(now, ended.t)})")
    of = f" of {target} ({100 * done / target:.1f}%)" if target else ""
    lines.append(f"step      {done}{of}")
    if isinstance(steps, ev.Steps):
        loss = f"{steps.loss:.4f}" if steps.loss is not None else "-"
        tps = f"{steps.tokens_per_s:,.0f}" if steps.tokens_per_s is not None else "-"
        mfu = f"   mfu {100 * steps.mfu:.1f}%" if steps.mfu is not None else ""
        lines.append(f"loss      {loss}   tokens/s {tps}{mfu}   ({_age(now, steps.t)})")
        left = None if ended else eta_s(done, target, steps.step_time_s)
        lines.append(f"eta       {_hms(left) if left is not None else '-'}"
                     + (f"   ({steps.step_time_s:.3f} s/step)" if steps.step_time_s else ""))
    evl = _last(events, ev.Eval)
    if isinstance(evl, ev.Eval) and evl.loss is not None:
        lines.append(f"eval      loss {evl.loss:.4f} at step {evl.step}")
    save = _last(events, ev.CkptSave)
    lines.append(f"last save step {save.step} ({_age(now, save.t)}, stall {save.stall_s:.2f}s)"
                 if isinstance(save, ev.CkptSave) else "last save none yet")
    starts = sum(isinstance(e, ev.TrainStart) for e in events)
    if starts > 1:
        lines.append(f"starts    {starts} ({starts - 1} restart(s))")
    op = _last(events, ev.OperatorRequest)
    if isinstance(op, ev.OperatorRequest):
        lines.append(f"operator  {op.action} by {op.user} at step {op.step} ({_age(now, op.t)})")
    failed = sorted({e.tracker for e in events if isinstance(e, ev.TrackerFailed)})
    if failed:
        lines.append(f"trackers  failed: {', '.join(failed)} (see `dslurm doctor`; training goes on)")
    return lines


def line(events: Sequence[ev.Event], *, target: int | None, status: str) -> str:
    """The view in one line, for a pipe: printed when it changes. Pure."""
    steps, start = _last(events, ev.Steps), _last(events, ev.TrainStart)
    done = (steps.last + 1) if isinstance(steps, ev.Steps) and steps.last is not None else (
        start.step if isinstance(start, ev.TrainStart) else 0)
    parts = [status, f"step {done}" + (f"/{target}" if target else "")]
    if isinstance(steps, ev.Steps) and steps.loss is not None:
        parts.append(f"loss {steps.loss:.4f}")
    save = _last(events, ev.CkptSave)
    parts.append(f"saved {save.step}" if isinstance(save, ev.CkptSave) else "saved -")
    parts.append(f"starts {sum(isinstance(e, ev.TrainStart) for e in events)}")
    return "  ".join(parts)


def _state(run_dir: Path) -> tuple[list[ev.Event], int | None, Completion]:
    from dslurm.observe.completion import target_steps
    from dslurm.observe.report import load, summarize

    events, _ = load(run_dir)
    target = target_steps(run_dir)
    return events, target, summarize(events, target_steps=target, run_dir=run_dir).completion


def snapshot(run_dir: Path, now: float | None = None) -> list[str]:
    """The view of the run directory as it is now."""
    from dslurm.observe.ctl import REQUEST, parse

    events, target, done = _state(run_dir)
    lines = view(events, target=target, state=done.lines()[0], now=time.time() if now is None else now)
    try:
        pending = parse((run_dir / REQUEST).read_text())
    except OSError:
        pending = None
    if pending is not None:
        lines.append(f"pending   {pending.action} requested by {pending.user} (not taken yet)")
    return [f"{run_dir}", *lines]


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("watch", help="a live view of a run: step, loss, tokens/s, ETA, last save, state",
                       description="Refreshed from the run's ledger (docs/trackers.md).")
    p.add_argument("run_dir", type=Path, help="the run directory")
    p.add_argument("--once", action="store_true", help="print the view once and exit")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    p.set_defaults(func=_run, configure_logging=False)


def _slurm_has_job(events: Sequence[ev.Event]) -> bool:
    """Slurm still holds a job of the run: after a preemption requeue-me leaves the requeue to
    Slurm (decision `stop`), so the ledger reads "incomplete" until the next start begins."""
    from dslurm import slurm
    from dslurm.errors import SlurmError

    ids = sorted({i for e in ev.of(events, ev.Submit) for i in e.job_ids})
    try:
        return bool(ids) and bool(slurm.squeue(job_ids=ids))  # squeue lists pending and running jobs
    except SlurmError:  # squeue refuses ids it has forgotten: none of them is active
        return False


def _piped(run_dir: Path, interval: float) -> int:
    """One line per change, until the run is over: completed, or incomplete with no job left."""
    last = None
    while True:
        events, target, done = _state(run_dir)
        text = line(events, target=target, status=done.status)
        if text != last:
            print(f"{time.strftime('%H:%M:%S')}  {text}", flush=True)
            last = text
        if done.complete or (done.complete is False and not _slurm_has_job(events)):
            return 0
        time.sleep(max(0.2, interval))


def _run(args: argparse.Namespace) -> int:
    import sys

    from dslurm.remote import handle

    if (h := handle.read(args.run_dir)) is not None:  # a run on a cluster: watch it there
        from dslurm.remote.proxy import passthrough

        return passthrough(h, ["watch", h.run_dir, "--interval", str(args.interval), *(["--once"] if args.once
                                                                                         else [])])
    if args.once:
        print("\n".join(snapshot(args.run_dir)))
        return 0
    if not sys.stdout.isatty():
        return _piped(args.run_dir, args.interval)
    from rich.live import Live
    from rich.text import Text

    with Live(Text("\n".join(snapshot(args.run_dir))), refresh_per_second=4, screen=False) as live:
        while True:
            time.sleep(max(0.2, args.interval))
            live.update(Text("\n".join(snapshot(args.run_dir))))
