"""`dslurm status SWEEP_DIR` and `dslurm report SWEEP_DIR`: one row per task, from each task's
ledger through the single-run report (`dslurm.observe.report.summarize`); the PNG overlays
the tasks' loss curves, each labelled by its overrides.

`register` wraps the single-run `report` command: a directory holding sweep.json is a sweep,
anything else goes to `dslurm.observe.report.run` unchanged.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dslurm.errors import UserError, check_output_file
from dslurm.remote import handle as handle_mod
from dslurm.sweep.build import MAP_FILE

COLUMNS = ("task", "state", "restarts", "step", "train_loss", "eval_loss", "goodput")


@dataclass(slots=True)
class TaskRow:
    task: int
    overrides: dict[str, Any]
    run_dir: str
    state: str
    """the run's completion status (completed, incomplete, running, requeued, queued, not_started)"""
    restarts: int = 0
    step: int | None = None
    target_steps: int | None = None
    train_loss: float | None = None
    eval_loss: float | None = None
    goodput: float | None = None
    why: str | None = None
    curve: list[tuple[int, float]] = field(default_factory=list)
    """(step, train loss) of every logged window, for the PNG"""


def is_sweep_dir(path: str | Path) -> bool:
    return (Path(path) / MAP_FILE).is_file()


def task_row(index: int, overrides: dict[str, Any], run_dir: Path, submitted: bool) -> TaskRow:
    """One task's row from its ledger (single-run summarize); a task with no ledger yet is
    queued (its array was submitted) or not started."""
    from dslurm.observe import events as ev
    from dslurm.observe.completion import target_steps
    from dslurm.observe.ledger import FILENAME
    from dslurm.observe.report import summarize

    if not (run_dir / FILENAME).is_file():
        return TaskRow(index, overrides, str(run_dir), "queued" if submitted else "not_started",
                       target_steps=target_steps(run_dir))
    sm = summarize(ev.read(run_dir), 0, target_steps(run_dir), run_dir)
    curve = [(w.last + 1, w.loss) for s in sm.starts for w in s.windows
             if w.loss is not None and math.isfinite(w.loss)]
    return TaskRow(index, overrides, str(run_dir), sm.completion.status, restarts=sm.restarts,
                   step=sm.completion.stopped_at, target_steps=sm.completion.target_steps,
                   train_loss=curve[-1][1] if curve else None,
                   eval_loss=sm.eval.loss if sm.eval is not None else None, goodput=sm.goodput,
                   why=sm.completion.why, curve=curve)


def sweep_rows(sweep_dir: Path) -> list[TaskRow]:
    from dslurm.sweep.submit import read_map

    data = read_map(sweep_dir)
    if data is None:
        raise UserError(f"{sweep_dir}: no {MAP_FILE}. Fix: give the sweep directory `dslurm submit --sweep` wrote")
    submitted = {int(t) for a in data.get("arrays", []) for t in a.get("tasks", [])}
    return [task_row(int(t["index"]), dict(t.get("overrides") or {}), Path(t["run_dir"]), int(t["index"]) in submitted)
            for t in data["tasks"]]


def sort_rows(rows: list[TaskRow], key: str | None, descending: bool = False) -> list[TaskRow]:
    """Rows by a column (tasks without a value last); by task index when no key. Pure."""
    if key is None:
        return sorted(rows, key=lambda r: r.task)
    if key not in COLUMNS:
        raise UserError(f"--sort {key}: not a column. Valid: {', '.join(COLUMNS)}")
    have = [r for r in rows if getattr(r, key) is not None]
    return (sorted(have, key=lambda r: getattr(r, key), reverse=descending)
            + [r for r in rows if getattr(r, key) is None])


def label(r: TaskRow) -> str:
    """`lr=0.0001, seed=0`: each override by its field's last name."""
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={v}" for k, v in r.overrides.items()) or "(base)"


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def table(rows: list[TaskRow]) -> str:
    """The rows for a person: one line per task. Pure."""
    head = f"{'task':>4}  {'state':<11} {'restarts':>8} {'step':>9} {'train loss':>10} {'eval loss':>9} " \
           f"{'goodput':>7}  overrides"
    lines = [head]
    for r in rows:
        step = "-" if r.step is None else f"{r.step}/{r.target_steps if r.target_steps is not None else '?'}"
        lines.append(f"{r.task:>4}  {r.state:<11} {r.restarts:>8} {step:>9} {_f(r.train_loss, '.4f'):>10} "
                     f"{_f(r.eval_loss, '.4f'):>9} {_pct(r.goodput):>7}  {label(r)}")
    done = sum(r.state == "completed" for r in rows)
    lines.append(f"{done} of {len(rows)} task(s) completed")
    return "\n".join(lines)


def plot_curves(rows: list[TaskRow], path: Path) -> Path:
    """One loss curve per task, labelled by its overrides."""
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    try:
        for r in rows:
            if r.curve:
                ax.plot([s for s, _ in r.curve], [v for _, v in r.curve], label=f"{r.task}: {label(r)}")
        ax.set_xlabel("step")
        ax.set_ylabel("train loss")
        ax.set_title(f"sweep {path.parent.name}: {len(rows)} task(s)")
        if any(r.curve for r in rows):
            ax.legend(fontsize=8)
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


def as_json(rows: list[TaskRow]) -> str:
    from dslurm.observe.ledger import finite_json

    out = []
    for r in rows:
        d = asdict(r)
        d.pop("curve")
        out.append(d)
    return json.dumps(finite_json(out), indent=2, default=str, allow_nan=False)


# ------------------------------------------------------------------------------ CLI


def run_status(args: argparse.Namespace) -> int:
    rows = sort_rows(sweep_rows(Path(args.job_id)), getattr(args, "sort", None), getattr(args, "desc", False))
    print(as_json(rows) if args.json else table(rows))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The single-run `report` command, extended: a sweep directory gives the sweep's table."""
    from dslurm.observe import report

    report.register(sub)
    p = sub.choices["report"]
    p.add_argument("--sort", choices=COLUMNS, default=None, help="sweep directory: sort the tasks by this column")
    p.add_argument("--desc", action="store_true", help="sweep directory: sort descending")
    p.set_defaults(func=run_report)


def run_report(args: argparse.Namespace) -> int:
    from dslurm.observe import report

    if args.png is not None:
        check_output_file(args.png, "--png", "report.png")
        if args.png.suffix.lower() != ".png":
            raise UserError(f"--png {args.png}: not a .png file name (the picture would be written as "
                            f"{args.png}.png). Fix: --png {args.png.with_suffix('.png')}")
    if (h := handle_mod.read(args.run_dir)) is not None:
        return _remote_report(h, args)
    if not is_sweep_dir(args.run_dir):
        return report.run(args)
    rows = sort_rows(sweep_rows(Path(args.run_dir)), args.sort, args.desc)
    print(as_json(rows) if args.json else table(rows))
    if not args.no_png:
        png = args.png or Path(args.run_dir) / "report.png"
        plot_curves(rows, png)
        if not args.json:
            print(f"wrote {png}")
    return 0


def _remote_report(h: handle_mod.Handle, args: argparse.Namespace) -> int:
    """A run on a cluster (docs/remote.md): made there, brought back into the local handle."""
    import sys

    from dslurm.durable import atomic_write_bytes
    from dslurm.remote.proxy import fetch_report

    got = fetch_report(h, png=not args.no_png)
    print(got[("report.json" if args.json else "report.txt")].read_text(), end="")
    if "report.png" in got and args.png:
        atomic_write_bytes(args.png, got["report.png"].read_bytes())
    where = ", ".join(str(p) for p in got.values())
    print(f"brought back from {h.login.host}:{h.run_dir}: {where}", file=sys.stderr if args.json else sys.stdout)
    return 0
