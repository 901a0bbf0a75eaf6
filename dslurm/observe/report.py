"""`dslurm report RUN_DIR`: whether the run finished, goodput, lost work, restarts, saves, MFU,
stragglers, a PNG.

Reads the run's ledger (typed events, `dslurm.observe.events`) and, for the target step count,
the frozen job.yaml (`dslurm.observe.completion`). The run is first split into starts, each with
its own facts (`dslurm.observe.starts`: `Start`, `split_starts`); this module adds what needs the
whole run: steps kept or redone, queue waits, recoveries inside the allocation and their time to
training, the health lines, evaluations, and the `Summary`. `summarize(events)` is pure; the
definitions (goodput, productive time, lost steps, restart overhead) are in docs/report.md and in
the docstrings below. `dslurm doctor` reuses `summarize` and `suspect_hosts`.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dslurm.errors import UserError
from dslurm.observe import events as ev
from dslurm.observe import perflines, software, trackerlines
from dslurm.observe.completion import NOT_STARTED, Completion, completion, ended_completed
from dslurm.observe.completion import target_steps as frozen_target
from dslurm.observe.durability import Durability, durability
from dslurm.observe.events import Event
from dslurm.observe.replica_lines import replica_lines
from dslurm.observe.replica_spans import GroupLane, group_lanes
from dslurm.observe.starts import DIED as DIED  # re-exported: doctor imports it from here
from dslurm.observe.starts import Start as Start  # re-exported: doctor, perfdoctor, selftest.chaos import it from here
from dslurm.observe.starts import starts_of
from dslurm.run import LEDGER


@dataclass(slots=True)
class Recovered:
    """One recovery inside the allocation (a `recovery` event) and how long training stood still."""

    start: int
    """the index of the start that failed"""
    cause: str
    mode: str
    removed: list[str]
    added: list[str]
    to_nodes: int
    grad_accum: int | None
    resumed_s: float | None
    """the failure (`failed_t`) -> the next start's first step done (`first_step_done`); None
    when no later start trained"""
    startup: str | None = None
    """the next start's `Start.startup`: "warm" or "cold"; None when there is no next start"""


def _recoveries(starts: list[Start]) -> list[Recovered]:
    out = []
    for i, s in enumerate(starts):
        for rec in s.all(ev.Recovery):
            nxt = starts[i + 1] if i + 1 < len(starts) else None
            back = first_step_done(nxt) if nxt else None
            failed = rec.failed_t or rec.t
            out.append(Recovered(start=s.index, cause=rec.cause, mode=rec.mode, removed=list(rec.removed),
                                 added=list(rec.added), to_nodes=rec.to_nodes, grad_accum=rec.grad_accum,
                                 resumed_s=None if back is None else round(back - failed, 3),
                                 startup=nxt.startup if nxt else None))
    return out


def first_step_done(s: Start) -> float | None:
    """When a start's first step was done: its phase table (rank 0 writes it right after that
    step, the moment a cold start's own table ends at) or its first logged window (written after
    the step's `train.step_sleep_s` and the log interval), whichever came first; its train_start
    when it logged neither. The one endpoint of a start: `report`, `dslurm.observe.endpoints` and
    the benches under bench/ all time a start to here."""
    done = _steps_done(s)
    ts = s.first(ev.TrainStart)
    return min(done) if done else (ts.t if ts else None)


def _steps_done(s: Start, after: float = float("-inf")) -> list[float]:
    """When steps of a start were done, after `after`: its logged windows and the phase table rank
    0 writes right after its first step. A start trains only after its own train_start: a window
    logged before it is a dying attempt's (its rank 0 outlived the kill long enough to log one
    more step after the next launcher began), never this start's."""
    ts = s.first(ev.TrainStart)
    since = ts.t if ts else float("-inf")
    done = [w.t for w in s.windows] + [p.t for p in s.all(ev.StartPhases)]
    return [t for t in done if t > after and t >= since]


def _after(s: Start, starts: list[Start], t: float) -> float | None:
    """The first step done after time t: in this start, else in the next one that trained (its
    first logged window, or the phase table rank 0 writes right after its first step)."""
    for st in starts[s.index:]:
        done = _steps_done(st, t)
        if done:
            return min(done)
    return None


def rank_host(rank: int, start: ev.JobStart | None) -> str | None:
    """The host global rank `rank` ran on, from the start's layout (the launcher's job_start):
    in torchrun mode each node runs nproc_per_node ranks, and the c10d rendezvous numbers the
    nodes in the order of their --local-addr, the host name (torch's dynamic_rendezvous sorts its
    participants), so rank r runs on sorted(hosts)[r // nproc_per_node]. None when unknown
    (srun mode: Slurm's task distribution decides). Pure."""
    if start is None or start.mode not in (None, "torchrun") or not start.nproc_per_node or rank < 0:
        return None
    hosts = sorted(start.hosts)
    i = rank // start.nproc_per_node
    return hosts[i] if i < len(hosts) else None


def suspect_hosts(e: ev.Hang | ev.Sdc, s: Start) -> list[str]:
    """The hosts of an event's suspect ranks: those the event names (from the ranks' own notes),
    then, for a suspect that left no note (a frozen or dead rank), its place in the start's
    layout (`rank_host`). Pure; report and doctor both print these."""
    out = list(e.suspect_hosts)
    notes = e.collectives if isinstance(e, ev.Hang) else {}
    layout = s.first(ev.JobStart)
    for r in e.suspects:
        note = notes.get(str(r))
        named = note.get("host") if isinstance(note, dict) else None
        host = str(named) if named else rank_host(r, layout)
        if host and host not in out:
            out.append(host)
    return out


def health_lines(starts: list[Start]) -> list[str]:
    """Hangs with their cost (no progress until detection, then back to a step done), silent
    data corruption and device findings, one line each (pure; doctor has the evidence)."""
    out = []
    for s in starts:
        for h in s.all(ev.Hang):
            back = _after(s, starts, h.t)
            rec = f", back to training {back - h.t:.0f} s later" if back is not None else ", never back to training"
            cost = f"; cost {h.idle_s + (back - h.t):.0f} s" if back is not None else ""
            out.append(f"hang in start {s.index} after step {h.step} (suspects {h.suspects or 'none'} on "
                       f"{', '.join(suspect_hosts(h, s)) or '?'}): detected after {h.idle_s:.0f} s without progress "
                       f"(bound {h.bound_s:.0f} s){rec}{cost}")
        for c in s.all(ev.Sdc):
            what = (f"rolled back to step {c.resumed_step}, {c.step - c.resumed_step} step(s) redone"
                    if c.action == "rollback" and c.step is not None and c.resumed_step is not None else c.action)
            out.append(f"silent data corruption in start {s.index} at step {c.step} (last clean check step "
                       f"{c.last_clean_step}; {'named' if c.named else 'unnamed, no majority'}: ranks {c.suspects} "
                       f"on {', '.join(suspect_hosts(c, s)) or '?'}): {what}"
                       + (f"; blocklisted {', '.join(c.blocklisted)}" if c.blocklisted else ""))
        for d in s.all(ev.DeviceHealth):
            out.append(f"device health on {d.host or '?'} at step {d.step}: {'; '.join(d.findings)}")
        out += perflines.lines(s.index, s.events)  # collectives, slow parts, OOMs, profiles (issue 37)
    return out


@dataclass(slots=True)
class EvalSummary:
    """The run's evaluations (`eval` events, train/evaluate.py): the last loss and their time."""

    count: int
    """evaluations completed"""
    interrupted: int
    """evaluations a stop cut short (no loss)"""
    time_s: float
    """wall time of all of them; not productive training time (goodput excludes it)"""
    last_step: int | None
    loss: float | None
    """the last completed evaluation's mean token loss"""
    ppl: float | None
    best_loss: float | None
    source: str
    """val (data.val) | held_out (data.val_fraction)"""
    points: list[tuple[float, int | None, float]] = field(default_factory=list)
    """(t, step, loss) of each completed evaluation, in ledger order"""


def eval_summary(starts: list[Start]) -> EvalSummary | None:
    """None when the run never evaluated. Pure."""
    evals = [e for s in starts for e in s.all(ev.Eval)]
    if not evals:
        return None
    done = [e for e in evals if not e.interrupted and e.loss is not None and math.isfinite(e.loss)]
    last = done[-1] if done else None
    return EvalSummary(count=len(done), interrupted=sum(e.interrupted for e in evals),
                       time_s=sum(e.duration_s for e in evals), last_step=last.step if last else None,
                       loss=last.loss if last else None, ppl=last.ppl if last else None,
                       best_loss=min((e.loss for e in done if e.loss is not None), default=None),
                       source=evals[-1].source, points=[(e.t, e.step, e.loss) for e in done if e.loss is not None])


@dataclass(slots=True)
class Summary:
    """What `dslurm report` prints; `to_dict` is the --json form (without raw events)."""

    wall_s: float
    queue_wait_s: float
    productive_s: float
    goodput: float | None
    lost_steps: int
    lost_s: float
    restarts: int
    restart_overhead_s: float
    startup_overhead_s: float
    checkpoint_overhead_s: float
    saves: int
    mfu: float | None
    mfu_label: str
    tokens_per_s: float | None
    final_step: int | None
    stragglers: dict[str, int]
    straggler_checks: int
    starts: list[Start]
    submit_t: float | None = None
    skipped_lines: int = 0
    undurable_steps: int = 0
    """steps trained after the last committed checkpoint of a run that is over: in no checkpoint"""
    endings: dict[str, int] = field(default_factory=dict)
    recoveries: list[Recovered] = field(default_factory=list)
    """recoveries inside the allocation (spare swap, same nodes, shrink): no queue, no requeue"""
    durability: Durability | None = None
    """two-tier checkpoints: durable lag, RPO on process restart vs node loss, lag policy cost"""
    health: list[str] = field(default_factory=list)
    """hangs (with their cost), silent data corruption, device findings (`health_lines`)"""
    software: list[str] = field(default_factory=list)
    """the last start's software and what changed between starts (dslurm/observe/software.py)"""
    trackers: list[str] = field(default_factory=list)
    """per experiment tracker: delivered, late-delivered, still missing (dslurm/observe/trackerlines.py)"""
    completion: Completion = field(default_factory=lambda: Completion(NOT_STARTED, None, None, None))
    """whether the run finished: the report's first line (`dslurm.observe.completion`)"""
    eval: EvalSummary | None = None
    """evaluations: last loss and perplexity, their time apart from training (`eval_summary`)"""
    replicas: list[str] = field(default_factory=list)
    """replica groups: participants per step, each group's losses and heals (`replica_lines`)"""
    replica_lanes: list[GroupLane] = field(default_factory=list)
    """replica groups: each group's lane, out of the quorum from its failure to its heal (the PNG's)"""
    warm: str | None = None
    """with spares: whether recoveries inside the allocation start warm, and why (the last submit's
    choice, dslurm/submission/warm_proof.py)"""

    def to_dict(self) -> dict[str, Any]:
        """The --json form: the completion's fields (status, complete, target_steps, stopped_at,
        why, continue_with, resumes_from) at the top level, first."""
        d = asdict(self)
        for s in d["starts"]:
            s.pop("events"), s.pop("windows")
        done = d.pop("completion")
        done.pop("job_id")
        return {**done, **d}


def _undurable(starts: list[Start]) -> int:
    """Steps the finished run trained past its last committed save: they exist in no checkpoint.
    0 while the run may still go on (its last start has no stop/end decision yet), and 0 for a
    completed run: completion is reported only after the final save committed."""
    last = starts[-1] if starts else None
    if last is None or last.decision not in ("stop", "end") or last.reached is None:
        return 0
    if ended_completed(last):
        return 0
    saved = [e.step for s in starts for e in s.all(ev.CkptSave) if e.step is not None]
    saved += [s.resumed_from for s in starts if s.resumed_from is not None]
    return max(0, last.reached - max(saved, default=0))


def _attribute_steps(starts: list[Start]) -> None:
    """A step trained in start i survives iff every later start resumed at or after it."""
    later_min = math.inf
    for s in reversed(starts):
        keep_below = later_min  # steps >= this were redone by some later start
        for w in s.windows:
            w.kept = (int(max(0, min(w.last + 1, keep_below) - w.first)) if keep_below != math.inf
                      else w.last - w.first + 1)
            s.productive_s += w.kept * w.step_s
            s.redone_s += (w.last - w.first + 1 - w.kept) * w.step_s
        if s.reached is not None and keep_below != math.inf:
            s.discarded_steps = max(0, s.reached - max(s.resumed_from or 0, int(keep_below)))
        if s.resumed_from is not None:
            later_min = min(later_min, s.resumed_from)


def _queue_waits(starts: list[Start], submits: list[float]) -> None:
    """Wait before a start: from the later of the previous start's end and the last submit."""
    prev_end: float | None = None
    for s in starts:
        refs = [t for t in submits if t <= s.begin] + ([prev_end] if prev_end is not None else [])
        s.queue_wait_s = max(0.0, s.begin - max(refs)) if refs else 0.0
        prev_end = s.end


def _mfu(starts: list[Start]) -> tuple[float | None, str]:
    steps = [e for s in starts for e in s.all(ev.Steps)]
    vals = [e.mfu for e in steps if e.mfu is not None]
    if vals:
        return sum(vals) / len(vals), f"{sum(vals) / len(vals):.1%}"
    label = next((e.mfu_label for e in steps if e.mfu_label), "cpu")
    return None, f"n/a ({label})"


def _phases(starts: list[Start], events: list[Event]) -> None:
    """Each start's phase table and its start-up as a ratio to the cold start's."""
    from dslurm.observe import phases

    ratios = phases.restart_overhead(phases.tables(events))
    # Matched by the event itself, not by (job_id, restart): the starts of one allocation
    # (recoveries inside it: same nodes, spare, warm) all share them.
    by_event = {id(e): tr for e, tr in zip(ev.of(events, ev.StartPhases), ratios)}
    for s in starts:
        marks = [m for m in s.all(ev.StartPhases) if id(m) in by_event]
        if marks:
            t, r = by_event[id(marks[-1])]
            s.phases, s.phases_end, s.startup_ratio = list(t.rows), marks[-1].t, r


def summarize(events: Iterable[Event], skipped_lines: int = 0, target_steps: int | None = None,
              run_dir: str | Path = "RUN_DIR") -> Summary:
    """The report of one run from its ledger events (pure; see docs/report.md). `target_steps`
    (the frozen train.steps) and `run_dir` (named in the command that continues a run that
    ended short) feed the completion headline."""
    events = list(events)
    starts = starts_of(events)  # each start's own facts, and what happened next
    _attribute_steps(starts)
    _phases(starts, events)
    undurable = _undurable(starts)
    endings: dict[str, int] = {}
    for s in starts:
        if s.ending:
            endings[s.ending] = endings.get(s.ending, 0) + 1
    submits = [e.t for e in ev.of(events, ev.Submit)]
    _queue_waits(starts, submits)
    wall = sum(s.end - s.begin for s in starts)
    productive = sum(s.productive_s for s in starts)
    mfu, label = _mfu(starts)
    tps = [(s.tokens_per_s, sum(w.last - w.first + 1 for w in s.windows)) for s in starts if s.tokens_per_s]
    hosts: dict[str, int] = {}
    checks = [e for s in starts for e in s.all(ev.Stragglers)]
    for host in (h for e in checks for h in e.slow_hosts()):
        hosts[host] = hosts.get(host, 0) + 1
    return Summary(
        wall_s=wall, queue_wait_s=sum(s.queue_wait_s for s in starts), productive_s=productive,
        goodput=productive / wall if wall > 0 else None,
        lost_steps=sum(s.discarded_steps for s in starts) + undurable, lost_s=sum(s.redone_s for s in starts),
        restarts=max(0, len(starts) - 1), restart_overhead_s=sum(s.overhead_s for s in starts[1:]),
        startup_overhead_s=sum(s.overhead_s for s in starts[:1]),
        checkpoint_overhead_s=sum(s.save_stall_s for s in starts),
        saves=sum(len(s.all(ev.CkptSave)) for s in starts), mfu=mfu, mfu_label=label,
        tokens_per_s=(sum(t * n for t, n in tps) / sum(n for _, n in tps)) if tps else None,
        final_step=starts[-1].reached if starts else None, stragglers=hosts, straggler_checks=len(checks),
        starts=starts, submit_t=min(submits) if submits else None, skipped_lines=skipped_lines,
        undurable_steps=undurable, endings=endings, recoveries=_recoveries(starts),
        durability=durability([s.events for s in starts]), health=health_lines(starts),
        trackers=trackerlines.lines(events, str(run_dir)), software=software.change_lines(events),
        completion=completion(starts, events, target_steps, run_dir), eval=eval_summary(starts),
        replicas=replica_lines(events),
        replica_lanes=group_lanes(events, [(ts.t, s.end) for s in starts if (ts := s.first(ev.TrainStart))]),
        warm=next((f"{'warm' if e.warm else 'cold'} ({e.warm_reason})" for e in reversed(list(ev.of(events, ev.Submit)))
                   if e.warm is not None), None))


def load(run_dir: Path) -> tuple[list[Event], int]:
    """(events, garbled or unknown lines skipped); UserError naming the path when there is nothing to read."""
    from dslurm.observe.ledger import FILENAME

    path = Path(run_dir) / FILENAME
    if Path(run_dir).exists() and not Path(run_dir).is_dir():
        raise UserError(f"{run_dir}: a file, not a run directory. Fix: give the run directory a job wrote to "
                        f"(the one holding {LEDGER}; a job file's checkpoint.run_dir names it)")
    if not path.is_file():
        raise UserError(f"{path}: no ledger. Fix: give the run directory a job wrote to "
                        f"(the one holding {LEDGER})")
    events = ev.read(run_dir)
    lines = sum(1 for raw in path.read_bytes().splitlines() if raw.strip())
    if not events:
        raise UserError(f"{path}: the ledger holds no readable event ({lines} line(s)). "
                        "Fix: check the run directory; a run writes events from its first start")
    return events, lines - len(events)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("report", help="whether a run finished; goodput, lost work, restarts, MFU, "
                                      "stragglers (+ PNG)",
                       description="Summarize a run's ledger (see docs/report.md).")
    p.add_argument("run_dir", type=Path, help=f"run directory holding {LEDGER}")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--png", type=Path, default=None, help="timeline PNG (default RUN_DIR/report.png)")
    p.add_argument("--no-png", action="store_true", help="do not draw the timeline")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import sys

    from dslurm.observe.plot import print_summary

    events, skipped = load(args.run_dir)
    summary = summarize(events, skipped, frozen_target(args.run_dir), args.run_dir)
    if args.json:
        from dslurm.observe.ledger import finite_json

        print(json.dumps(finite_json(summary.to_dict()), indent=2, default=str, allow_nan=False))
    else:
        print_summary(summary, args.run_dir)
    if not args.no_png:
        from dslurm.observe.plot import plot_timeline

        png = args.png or Path(args.run_dir) / "report.png"
        try:
            plot_timeline(summary, png)
        except OSError as exc:
            if args.png:
                raise UserError(f"{png}: cannot write the timeline ({exc}). Fix: choose a writable --png path")
            print(f"dslurm report: timeline not written: {exc}", file=sys.stderr)
        else:
            print(f"timeline: {png}", file=sys.stderr if args.json else sys.stdout)
    return 0
