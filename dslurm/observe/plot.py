"""What a person sees of `dslurm report`: the text summary (rich) and the PNG timeline.

Both import their libraries lazily: `import dslurm.cli` must stay fast and torch-free,
and matplotlib alone costs about a second.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dslurm.observe import bands as B
from dslurm.observe import events as ev
from dslurm.observe.durability import lines as durability_lines

if TYPE_CHECKING:
    from dslurm.observe.replica_spans import GroupLane
    from dslurm.observe.report import Summary
    from dslurm.observe.starts import Start

# One colour per kind of time (dslurm/observe/bands.py), the same in the bands and the legend.
COLORS = {B.QUEUE: "#d9d9d9", B.STARTUP: "#ffd966", B.BURNIN: "#f4a261", B.TRAINING: "#2a9d8f",
          B.REDONE: "#e76f51", B.SAVE: "#264653", B.EVAL: "#9b5de5", B.HUNG: "#9d0208",
          B.TEARDOWN: "#8d99ae", B.IDLE: "#f2f2f2", B.BETWEEN: "#a8dadc"}


def _fmt_s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 3600:.2f}h" if x >= 36000 else f"{x / 60:.1f}m" if x >= 600 else f"{x:.1f}s"


def print_summary(sm: Summary, run_dir: Path) -> None:
    """The human form: one line per headline number, then one row per start."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    from dslurm.observe.table import console as wide_console
    from dslurm.observe.table import print_table

    gp = "n/a" if sm.goodput is None else f"{sm.goodput:.1%}"
    tps = "n/a" if sm.tokens_per_s is None else f"{sm.tokens_per_s:,.0f}"
    head = [escape(x) for x in sm.completion.lines()]  # first: did the run finish (STYLE 14)
    if sm.completion.complete is False:
        head[0] = f"[bold red]{head[0]}[/bold red]"
    lines = [
        *head,
        f"goodput [bold]{gp}[/bold] = productive {_fmt_s(sm.productive_s)} / wall {_fmt_s(sm.wall_s)}"
        f" (queue wait {_fmt_s(sm.queue_wait_s)} excluded)",
        f"restarts {sm.restarts}: overhead {_fmt_s(sm.restart_overhead_s)} (first start"
        f" {_fmt_s(sm.startup_overhead_s)}); lost {sm.lost_steps} step(s) = {_fmt_s(sm.lost_s)} redone",
        f"checkpoints: {sm.saves} save(s), stalls {_fmt_s(sm.checkpoint_overhead_s)}",
        f"MFU {sm.mfu_label}; {tps} tokens/s while training; final step {sm.final_step}",
        "stragglers: " + (", ".join(f"{h} flagged {n}x" for h, n in sorted(sm.stragglers.items(),
                                                                         key=lambda kv: -kv[1]))
                          or "none") + f" ({sm.straggler_checks} check(s))",
    ]
    if sm.eval is not None:
        lines.append(eval_line(sm))
    if sm.durability is not None:
        lines += durability_lines(sm.durability)
    if sm.undurable_steps:
        lines.append(f"[red]{sm.undurable_steps} step(s) trained after the last committed checkpoint: in no "
                     "checkpoint (counted as lost)[/red]")
    if sm.warm is not None:
        lines.append(f"attempts after a failure inside the allocation start {sm.warm}")
    if sm.recoveries:
        back = [r.resumed_s for r in sm.recoveries if r.resumed_s is not None]
        lines.append(f"recoveries inside the allocation: {len(sm.recoveries)} ("
                     + ", ".join(f"{r.cause}: {r.mode}" + (f" {'+'.join(r.added)} for {'+'.join(r.removed)}"
                                                            if r.removed else "")
                                 + (f" to {r.to_nodes} node(s), grad_accum {r.grad_accum}" if r.grad_accum else "")
                                 + (f" > {r.startup} start" if r.startup else "")
                                 + (f" {_fmt_s(r.resumed_s)}" if r.resumed_s is not None else "")
                                 for r in sm.recoveries)
                     + ")" + (f"; failure to training {_fmt_s(sum(back))} in all, {_fmt_s(max(back))} at most"
                              if back else ""))
    lines += sm.replicas  # replica groups: participants per step, each group's losses and heals
    if (line := startup_line(sm.starts)) is not None:
        lines.append(line)
    lines += sm.health  # hangs and their cost, silent data corruption, device findings
    lines += sm.software  # the software of the last start, and what changed between starts
    lines += sm.trackers  # per tracker: delivered, late-delivered, still missing
    if sm.endings:
        lines.append("endings: " + ", ".join(f"{k} {n}x" for k, n in sorted(sm.endings.items())))
    if sm.skipped_lines:
        lines.append(f"[yellow]{sm.skipped_lines} torn or garbled ledger line(s) skipped[/yellow]")
    # SIMPLE box and short headers: the table fits 80 columns when piped to a file.
    table = Table(title=f"{run_dir}: {len(sm.starts)} start(s)", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("start", "queue", "burn-in", "to step", "steps", "redone", "train", "saves", "exit"):
        table.add_column(col, justify="left" if col in ("start", "exit") else "right", no_wrap=col != "exit")
    for s in sm.starts:
        steps = "-" if s.reached is None else f"{s.resumed_from or 0}-{s.reached}"
        table.add_row(f"{s.index} {s.job_id or '-'}.{s.restart}", _fmt_s(s.queue_wait_s), _fmt_s(s.burnin_s),
                      _fmt_s(s.overhead_s), steps, str(s.discarded_steps), _fmt_s(s.productive_s),
                      _fmt_s(s.save_stall_s), start_label(s))
    console = wide_console()  # a file or a pipe: as wide as a line needs, never 80 columns
    for i, line in enumerate(lines):  # the headline whole on its line: the reason is the point
        console.print(line, highlight=False, soft_wrap=i < len(head))
    print_table(console, table)
    phased = [s for s in sm.starts if s.phases]
    if phased:
        console.print(_phase_table(phased), highlight=False)


def eval_line(sm: Summary) -> str:
    """`eval (held_out): loss 2.3456 ppl 10.44 at step 40 (best 2.3012); 4 eval(s), 3.2s apart
    from training (not productive)`. Pure."""
    e = sm.eval
    if e is None:
        return "eval: none"
    what = (f"loss {e.loss:.4f} ppl {e.ppl:.2f} at step {e.last_step}" if e.loss is not None and e.ppl is not None
            else f"loss {e.loss:.4f} at step {e.last_step}" if e.loss is not None else "no completed evaluation")
    best = f" (best {e.best_loss:.4f})" if e.best_loss is not None and e.best_loss != e.loss else ""
    cut = f", {e.interrupted} interrupted by a stop" if e.interrupted else ""
    return (f"eval ({e.source or '?'}): {what}{best}; {e.count} eval(s){cut}, {_fmt_s(e.time_s)} "
            "apart from training (not productive)")


def startup_line(starts: list[Start]) -> str | None:
    """`start-up (job start -> first step, median): cold 7.1s (2 starts), warm 1.4s (1 start)`:
    warm (forked by a preloaded pool) and cold starts apart; None when no start has a phase table,
    or when every start was cold (the phase table says it all). Pure."""
    import statistics

    by: dict[str, list[float]] = {}
    for s in starts:
        if s.phases:
            by.setdefault(s.startup, []).append(sum(v for _, v in s.phases))
    if "warm" not in by:
        return None
    return "start-up (job start -> first step, median): " + ", ".join(
        f"{kind} {_fmt_s(statistics.median(by[kind]))} ({len(by[kind])} start{'s' if len(by[kind]) > 1 else ''})"
        for kind in ("cold", "warm") if kind in by)


def _phase_table(starts: list[Start]) -> str:
    """Start-up phase by phase, one column per start (labelled warm or cold), and each start's
    ratio to the cold one."""
    names = list(dict.fromkeys(n for s in starts for n, _ in s.phases))
    heads = [f"{s.index} {s.startup}" for s in starts]
    out = ["start-up by phase (s):", f"  {'phase':<17}" + "".join(f"{h:>10}" for h in heads)]
    for n in names:
        cells = [dict(s.phases).get(n) for s in starts]
        out.append(f"  {n:<17}" + "".join(f"{'-' if c is None else f'{c:.2f}':>10}" for c in cells))
    out.append(f"  {'total':<17}" + "".join(f"{sum(v for _, v in s.phases):>10.2f}" for s in starts))
    out.append(f"  {'x cold start':<17}" + "".join(
        f"{'-' if s.startup_ratio is None else f'{s.startup_ratio:.2f}':>10}" for s in starts))
    return "\n".join(out)


def start_label(s: Start, width: int | None = None) -> str:
    """How a start ended and what happened next: `preempted > requeued by Slurm`."""
    ended = s.ending or s.exit_reason
    ended = ended if width is None or len(ended) <= width else ended[:width - 1] + "…"
    return ended + (f" > {s.outcome}" if s.outcome else "")


# The start-up split into its phases (the PNG's startup band, when the trainer measured them).
PHASE_COLORS = {"spawn": "#fff3b0", "interpreter": "#ffe08a", "config": "#ffd166", "imports": "#f9c74f",
                "rendezvous": "#f8961e", "burnin": COLORS["burn-in"], "build": "#e9c46a",
                "data": "#d4a373", "checkpoint_setup": "#bc9b6a", "restore": "#a98467",
                "first_step": "#8d6e63"}


def _markers(ax: Any, tl: B.Timeline, starts: list[Start], x: Any) -> None:
    """Saves as ticks; hangs, signals, crashes where they happened; each start's outcome."""
    style = {"signal": ("v", "crimson", -0.45), "hang": ("D", COLORS[B.HUNG], -0.45), "crash": ("*", "crimson", 0.0),
             "died": ("X", "crimson", 0.0)}
    for m in tl.marks:
        if m.kind == "save":
            ax.plot([x(m.t)] * 2, [m.lane - 0.4, m.lane + 0.4], color=COLORS[B.SAVE], lw=1)
            continue
        marker, color, dy = style[m.kind]
        ax.plot(x(m.t), m.lane + dy, marker, color=color, ms=7 if m.kind in ("signal", "hang") else 9)
        if m.kind != "signal":
            ax.annotate(m.label, (x(m.t), m.lane + dy), xytext=(4, -10), textcoords="offset points", fontsize=7,
                        color=color)
    for s in starts:
        decided = s.all(ev.Requeue)[-1:]  # the decision that stands; else the start's end
        when = decided[0].t if decided else s.end
        if s.outcome:
            ax.plot(x(when), s.index, ">", color="black", ms=6)
            ax.annotate(s.outcome, (x(when), s.index), xytext=(4, 6), textcoords="offset points", fontsize=7)


REPLICA_IN, REPLICA_OUT = "#2a9d8f", "#e76f51"  # a group in the quorum / out of it (failure -> heal)


def replica_panel(ax: Any, lanes: list[GroupLane], x: Any, scale: float) -> None:
    """One lane per replica group: in the quorum, out of it from its failure to its heal (shaded),
    a cross where it was lost (step, cause) and a dot where it healed (step, seconds)."""
    from matplotlib.patches import Patch

    for lane in lanes:
        ax.broken_barh([(x(a), (b - a) / scale) for a, b in lane.trained], (lane.group - 0.3, 0.6), color=REPLICA_IN)
        for o in lane.outs:
            ax.broken_barh([(x(o.t0), (o.t1 - o.t0) / scale)], (lane.group - 0.3, 0.6), color=REPLICA_OUT,
                           hatch="///" if o.healed_step is None else None)
            if o.losses:  # a late join has no loss to mark
                ax.plot(x(o.t0), lane.group, "X", color="crimson", ms=8)
            ax.annotate(f"lost @{o.step if o.step is not None else '?'} ({o.cause})" + (f" x{o.losses}" if o.losses > 1
                                                                                     else "") if o.losses else o.cause,
                        (x(o.t0), lane.group - 0.3), xytext=(2, 2), textcoords="offset points", fontsize=7,
                        color="crimson")
            if o.healed_step is not None:
                ax.plot(x(o.t1), lane.group, "o", color="black", ms=5)
                ax.annotate(f"healed @{o.healed_step}" + (f" {o.heal_s:.2f}s" if o.heal_s is not None else ""),
                            (x(o.t1), lane.group + 0.3), xytext=(2, -8), textcoords="offset points", fontsize=7)
    ax.set_yticks([lane.group for lane in lanes], [f"group {lane.group}" for lane in lanes], fontsize=8)
    ax.set_ylim(max(lane.group for lane in lanes) + 0.6, min(lane.group for lane in lanes) - 0.6)
    ax.set_title("replica groups: out of the quorum from the failure to the heal", fontsize=8, loc="left")
    ax.legend(handles=[Patch(color=REPLICA_IN, label="in the quorum"),
                       Patch(color=REPLICA_OUT, label="out (failure -> healed; hatched: not back)")],
              fontsize=7, ncol=2, loc="lower right", bbox_to_anchor=(1.0, 1.0), frameon=False, borderaxespad=0.1)


# The markers of `_markers`, as the legend names them (marker, colour, label).
MARKERS = [("|", COLORS[B.SAVE], "save"), ("v", "crimson", "interruption (stop signal)"),
           ("D", COLORS[B.HUNG], "hang detected"), ("*", "crimson", "crash (the run's own failure)"),
           ("X", "crimson", "no exit event"),
           (">", "black", "outcome (what happened next)")]


def timeline_title(sm: Summary) -> str:
    """The PNG's title: whether the run finished first, then goodput, restarts, redone steps."""
    done = sm.completion
    state = done.status.upper().replace("_", " ")
    if done.stopped_at is not None:
        state += f" at step {done.stopped_at}" + (f" of {done.target_steps}" if done.target_steps is not None else "")
    gp = "n/a" if sm.goodput is None else f"{sm.goodput:.1%}"
    return f"{state}: goodput {gp}, {sm.restarts} restart(s), {sm.lost_steps} step(s) redone"


def plot_timeline(sm: Summary, path: str | Path) -> Path:
    """Write the timeline PNG: one lane per start (top) and the loss curve (bottom)."""
    import matplotlib.pyplot as plt

    fig = timeline_figure(sm)
    path = Path(path)
    try:
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return path


def timeline_figure(sm: Summary) -> Any:
    """The timeline as a matplotlib Figure (the caller closes it)."""
    import logging

    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # font-cache chatter on first use
    matplotlib.use("Agg")  # no display on a login node; must precede pyplot
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    starts = sm.starts
    tl = B.timeline(sm)  # every second in one band
    t0 = tl.t0
    span = max(tl.t_end - t0, 1.0)
    scale, unit = (60.0, "min") if span > 600 else (1.0, "s")

    def x(t: float) -> float:
        return (t - t0) / scale

    lanes = sm.replica_lanes  # replica groups: a panel of one lane per group between the starts and the loss
    rows = [max(1, len(starts)), *([max(1.2, 0.45 * len(lanes))] if lanes else []), 2]
    fig, axes = plt.subplots(len(rows), 1, sharex=True, squeeze=False,
                             figsize=(11, 2.2 + 0.5 * len(starts) + 2.5 + (0.6 + 0.35 * len(lanes) if lanes else 0)),
                             gridspec_kw={"height_ratios": rows})
    top, bottom = axes[0][0], axes[-1][0]
    if lanes:
        replica_panel(axes[1][0], lanes, x, scale)
    palette = {**COLORS, **PHASE_COLORS}
    for b in tl.bands:
        color = palette.get(b.kind, COLORS[B.STARTUP])  # a phase without its own colour: start-up's
        top.broken_barh([(x(b.t0), b.width / scale)], (b.lane - 0.35, 0.7), color=color)
    _markers(top, tl, starts, x)
    if any(s.startup == "warm" for s in starts):  # warm and cold starts apart, over each startup band
        for s in starts:
            top.annotate(f"{s.startup} start", (x(s.begin), s.index - 0.35), xytext=(1, 1),
                         textcoords="offset points", fontsize=6, va="bottom",
                         color="#9a3412" if s.startup == "warm" else "#555555")
    labels = [f"{s.index}: {start_label(s, width=24)}" for s in starts]  # the classified ending > what next
    top.set_yticks([s.index for s in starts], labels, fontsize=8)
    top.set_ylim(len(starts) - 0.5, -0.5)
    top.set_title(timeline_title(sm), fontsize=10, color="crimson" if sm.completion.complete is False else "black")
    drawn = {b.kind for b in tl.bands}  # the run's own kinds; training and queue wait always
    handles: list[Any] = [Patch(color=c, label=k) for k, c in COLORS.items() if k in drawn | {B.TRAINING, B.QUEUE}]
    seen = {n for s in starts for n, _ in s.phases}
    handles += [Patch(color=c, label=f"startup: {k}") for k, c in PHASE_COLORS.items() if k in seen]
    handles += [Line2D([], [], ls="", marker=m, color=c, label=k) for m, c, k in MARKERS]
    top.legend(handles=handles, fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, -0.02),
               frameon=False)
    for s in starts:  # one line per start: a restart is a visible break in the curve
        pts = [(x(w.t), w.loss) for w in s.windows if w.loss is not None and math.isfinite(w.loss)]
        if pts:
            bottom.plot(*zip(*pts), color="#2a9d8f", lw=1, marker=".", ms=4,
                        label=None if s.index else "loss")
    redone = [(x(w.t), w.loss) for s in starts for w in s.windows if w.loss is not None and w.kept == 0]
    if redone:
        bottom.plot(*zip(*redone), ls="", marker="x", color=COLORS["redone"], label="redone later")
    if sm.eval is not None and sm.eval.points:
        bottom.plot([x(t) for t, _, _ in sm.eval.points], [v for _, _, v in sm.eval.points], ls="--",
                    marker="o", ms=4, color=COLORS["eval"], lw=1, label=f"eval loss ({sm.eval.source})")
    bottom.set_ylabel("loss")
    bottom.set_xlabel(f"wall time ({unit}) since {'submit' if sm.submit_t is not None else 'first start'}")
    if bottom.get_legend_handles_labels()[0]:
        bottom.legend(fontsize=7)
    fig.tight_layout()
    return fig
