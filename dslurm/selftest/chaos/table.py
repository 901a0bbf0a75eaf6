"""The soak's table: one row per fault (which start it hit, the recovery's path, the time to the next
step done, the steps lost) and the totals by kind, as markdown and as a PNG. Pure but for the
writers; matplotlib is imported only to draw.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dslurm.observe import events as ev
from dslurm.observe.report import Start, Summary
from dslurm.selftest.chaos.schedule import KINDS, OWN_FAILURES


@dataclass(frozen=True, slots=True)
class Row:
    index: int
    kind: str
    at_s: float
    """seconds after the soak's first training step"""
    injected: bool
    start: int | None
    """the start it hit (None: between starts)"""
    ended_it: bool
    """the last fault before that start's ending: the one its recovery answered"""
    path: str
    """warm | cold (in the allocation, same nodes) | spare | shrink | requeue | absorbed | skipped"""
    to_step_s: float | None
    """the fault -> the next step done (in this start or the next one that trained)"""
    lost: int | None
    """steps the interrupted start trained past the next one's resume point"""
    detail: str


def next_step_done(starts: Sequence[Start], first: Start, t: float) -> float | None:
    """When the first step after `t` was done: a logged window, or the phase table rank 0 writes right
    after a start's first step, in `first` or a later start."""
    for st in starts[first.index:]:
        done = [w.t for w in st.windows if w.t > t] + [p.t for p in st.all(ev.StartPhases) if p.t > t]
        if done:
            return min(done)
    return None


# Which fault kinds can end a start in each class: the earliest such fault in the start is its cause
# (a SIGSTOP ends a start only once the watchdog fires, after later faults may have come).
EXPLAINS = {"crash": OWN_FAILURES, "node_failure": OWN_FAILURES, "preempted": ("requeue",),
            "warned_stop": ("usr2", "time_limit"), "time_limit": ("requeue",), "cancelled": ("requeue",)}


def start_of(starts: Sequence[Start], t: float) -> int | None:
    """The start a fault at `t` hit: the last one begun by then (a start lasts until the next one
    begins: its last events, an ending written late, come well after the fault that ended it);
    None after the last one ended."""
    if not starts or t > starts[-1].end:
        return None
    begun = [s.index for s in starts if s.begin <= t]
    return begun[-1] if begun else starts[0].index


def cause(s: Start, starts: Sequence[Start], done: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The fault that ended start `s`: the earliest injected during it of a kind that explains its
    ending, else the last one injected during it; None for a completed start or one no fault hit."""
    if s.ending in (None, "completed"):
        return None
    mine = [d for d in done if d["injected"] and s.index == start_of(starts, d["t"])]
    fits = [d for d in mine if d["kind"] in EXPLAINS.get(s.ending, ())]
    return fits[0] if fits else (mine[-1] if mine else None)


def _path(s: Start, nxt: Start | None) -> str:
    rec = s.all(ev.Recovery)
    if rec:
        mode = rec[-1].mode
        if mode == "same_nodes":
            return "warm" if nxt is not None and nxt.startup == "warm" else "cold"
        return mode
    return "requeue" if nxt is not None else "end"


def rows(sm: Summary, done: Sequence[dict[str, Any]], t0: float) -> list[Row]:
    starts = sm.starts
    out = []
    for d in done:
        t = d["t"]
        idx = start_of(starts, t)
        hit = base = starts[idx] if idx is not None else None
        hit_idx = idx
        ended = bool(d["injected"] and hit is not None and cause(hit, starts, done) is d)
        nxt = starts[hit.index + 1] if hit is not None and hit.index + 1 < len(starts) else None
        if not d["injected"]:
            path = "skipped"
        elif ended and hit is not None:
            path = _path(hit, nxt)
        else:
            path = "absorbed"
        # an interruption: the next start's first step; else the next step done at all
        since = nxt if ended and nxt is not None else base
        back = next_step_done(starts, since, t) if since is not None and d["injected"] else None
        lost = None
        if ended and hit is not None and nxt is not None and hit.reached is not None and nxt.resumed_from is not None:
            lost = max(0, hit.reached - nxt.resumed_from)
        out.append(Row(index=d["index"], kind=d["kind"], at_s=round(t - t0, 1), injected=d["injected"],
                       start=hit_idx, ended_it=ended, path=path,
                       to_step_s=None if back is None else round(back - t, 1), lost=lost,
                       detail=d["detail"]))
    return out


def by_kind(table: Sequence[Row]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for kind in KINDS:
        mine = [r for r in table if r.kind == kind]
        if not mine:
            continue
        times = [r.to_step_s for r in mine if r.to_step_s is not None and r.ended_it]
        paths: dict[str, int] = {}
        for r in mine:
            paths[r.path] = paths.get(r.path, 0) + 1
        out[kind] = {"injected": sum(r.injected for r in mine), "skipped": sum(not r.injected for r in mine),
                     "paths": paths, "lost": sum(r.lost or 0 for r in mine),
                     "median_to_step_s": sorted(times)[len(times) // 2] if times else None}
    return out


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def markdown(table: Sequence[Row], sm: Summary, head: Sequence[str]) -> str:
    kinds = by_kind(table)
    paths = sorted({r.path for r in table} - {"skipped"})  # skipped has its own column
    lines = [*head, "", "## Faults by kind", "",
             "| kind | injected | skipped | " + " | ".join(paths) + " | lost steps | median s to next step |",
             "|---|---|---|" + "---|" * len(paths) + "---|---|"]
    for kind, k in kinds.items():
        lines.append(f"| {kind} | {k['injected']} | {k['skipped']} | "
                     + " | ".join(str(k["paths"].get(p, 0)) for p in paths)
                     + f" | {k['lost']} | {_s(k['median_to_step_s'])} |")
    gp = "n/a" if sm.goodput is None else f"{sm.goodput:.1%}"
    lines += ["", f"Starts {len(sm.starts)}, lost steps {sm.lost_steps} (report), goodput {gp} "
              f"(productive {sm.productive_s:.0f} s of {sm.wall_s:.0f} s).", "",
              "## Every fault", "",
              "| # | at s | kind | start | ended it | path | s to next step | lost | what was done |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(f"| {r.index} | {r.at_s:.1f} | {r.kind} | {'-' if r.start is None else r.start} | "
                     f"{'yes' if r.ended_it else 'no'} | {r.path} | {_s(r.to_step_s)} | "
                     f"{'-' if r.lost is None else r.lost} | {r.detail.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def to_json(table: Sequence[Row]) -> list[dict[str, Any]]:
    return [asdict(r) for r in table]


def plot(table: Sequence[Row], png: Path, title: str) -> None:
    """Left: faults by kind, stacked by recovery path. Right: each fault's time to the next step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = by_kind(table)
    paths = sorted({r.path for r in table})
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    names = list(kinds)
    bottom = [0] * len(names)
    for p in paths:
        vals = [kinds[k]["paths"].get(p, 0) for k in names]
        a.barh(names, vals, left=bottom, label=p)
        bottom = [x + y for x, y in zip(bottom, vals)]
    a.set_xlabel("faults")
    a.legend(title="recovery path", fontsize=8)
    a.invert_yaxis()
    for p in paths:
        pts = [(r.at_s, r.to_step_s) for r in table if r.path == p and r.to_step_s is not None]
        if pts:
            b.scatter([x for x, _ in pts], [y for _, y in pts], label=p, s=18)
    b.set_xlabel("fault at (s after the first step)")
    b.set_ylabel("s to the next step done")
    if b.get_legend_handles_labels()[0]:
        b.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
