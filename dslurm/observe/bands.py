"""The report's timeline as bands that cover every second once (issue 54), and its markers. Pure.

From the first moment the run is known (its first submit, or its first start's queue wait) to
its last event, each second belongs to exactly one band on one start's lane:

- inside a start, what the ledger measured, later kinds over earlier ones: start-up (its phases
  when the trainer timed them), burn-in, training and redone (a window's steps a later start
  trained again), save stalls, evaluations;
- hung: from the last progress a `hang` event gives (its time less `idle_s`) to its detection;
- teardown + requeue: after the last step or the detection, to the start's last event (the
  workers ended, the requeue decision written);
- before a start, queue wait (`report._queue_waits`: from the later of the previous start's end
  and the last submit) and, before that, no job queued (a submit came later than the previous
  start's end);
- start-up before the first step, and "between steps" for what no event accounts for while it trains.

`timeline(sm)` walks one cursor across the run, so the bands never overlap and their widths add
up to the span exactly: tests/unit/test_report_bands.py, and on a real hung run
tests/integration/test_health.py. dslurm/observe/plot.py draws them.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dslurm import endings as E
from dslurm.observe import events as ev

if TYPE_CHECKING:
    from dslurm.observe.report import Summary
    from dslurm.observe.starts import Start

QUEUE, IDLE, STARTUP, BURNIN = "queue wait", "no job queued", "startup", "burn-in"
TRAINING, REDONE, SAVE, EVAL = "training", "redone", "save stall", "eval"
HUNG, TEARDOWN, BETWEEN = "hung", "teardown + requeue", "between steps"
KINDS = (QUEUE, IDLE, STARTUP, BURNIN, TRAINING, REDONE, SAVE, EVAL, HUNG, TEARDOWN, BETWEEN)
# Endings that a marker calls a crash: the run's own failures (dslurm/endings/__init__.py).
CRASHES = (E.CRASH, E.NODE_FAILURE, E.OOM, E.SAVE_FAILED, E.DIVERGED)


@dataclass(frozen=True, slots=True)
class Band:
    lane: int
    """the start's index (its row in the PNG)"""
    kind: str
    """one of KINDS, or a start-up phase's name (`startup` split by dslurm.observe.phases)"""
    t0: float
    width: float


@dataclass(frozen=True, slots=True)
class Mark:
    lane: int
    kind: str
    """hang (its detection), signal (a stop signal received), crash (a failure ended the start),
    died (no exit event), save"""
    t: float
    label: str = ""


@dataclass(frozen=True, slots=True)
class Timeline:
    t0: float
    t_end: float
    bands: list[Band]
    marks: list[Mark]

    def width_of(self, kind: str) -> float:
        return sum(b.width for b in self.bands if b.kind == kind)


def measured(s: Start, phases: bool = True) -> list[tuple[str, float, float]]:
    """(kind, t0, t1) the start's events measured, in painting order (a later one wins)."""
    ts = s.first(ev.TrainStart)
    out = [(STARTUP, s.begin, ts.t if ts else s.end)]
    if phases and s.phases and s.phases_end is not None:  # laid back to back, ending at the first step done
        t = s.phases_end - sum(v for _, v in s.phases)
        for name, secs in s.phases:
            out.append((name, t, t + secs))
            t += secs
    out += [(BURNIN, pf.t - pf.duration_s, pf.t) for pf in s.all(ev.Preflight)]
    for w in s.windows:  # kept steps first in the window, the redone tail after them
        t0 = w.t - w.duration_s
        kept = t0 + w.duration_s * w.kept / (w.last - w.first + 1)
        out += [(TRAINING, t0, kept), (REDONE, kept, w.t)]
    out += [(SAVE, c.t - c.stall_s, c.t) for c in s.all(ev.CkptSave)]
    out += [(EVAL, e.t - e.duration_s, e.t) for e in s.all(ev.Eval)]
    return [(k, a, b) for k, a, b in out if b > a]


def _paint(spans: list[tuple[str, float, float]], lo: float, hi: float) -> list[tuple[str, float, float]]:
    """The spans flattened over [lo, hi): a later span wins where they overlap (a sweep with a
    heap of the spans open, the latest on top: n log n for a run of many windows); what none
    covers is left out (the caller names the gaps)."""
    clipped = [(k, max(x, lo), min(y, hi)) for k, x, y in spans]
    clipped = [c for c in clipped if c[2] > c[1]]
    order = sorted(range(len(clipped)), key=lambda i: clipped[i][1])
    cuts = sorted({lo, hi, *(x for _, a, b in clipped for x in (a, b))})
    open_: list[int] = []  # -index: the latest span on top
    out: list[tuple[str, float, float]] = []
    j = 0
    for a, b in zip(cuts, cuts[1:]):
        while j < len(order) and clipped[order[j]][1] <= a:
            heapq.heappush(open_, -order[j])
            j += 1
        while open_ and clipped[-open_[0]][2] <= a:
            heapq.heappop(open_)
        if not open_:
            continue
        kind = clipped[-open_[0]][0]
        if out and out[-1][0] == kind and out[-1][2] == a:
            out[-1] = (kind, out[-1][1], b)
        else:
            out.append((kind, a, b))
    return out


def _gap_kind(s: Start, a: float, b: float) -> str:
    """What an unmeasured stretch [a, b) of a start was: waiting for its first step, hung (a
    hang's idle time), steps not yet logged, or after its last step (teardown + requeue)."""
    ts = s.first(ev.TrainStart)
    if ts is None or b <= ts.t:
        return STARTUP
    mid, hangs = (a + b) / 2, s.all(ev.Hang)
    if any(h.t - h.idle_s <= mid < h.t for h in hangs):
        return HUNG
    if a < max([w.t for w in s.windows] + [ts.t]) or any(h.t - h.idle_s > mid for h in hangs):
        return BETWEEN
    return TEARDOWN


def _lane(s: Start, lo: float, hi: float, phases: bool) -> list[Band]:
    """[lo, hi) of one start, covered once: the measured spans, and its gaps cut where a hang's
    idle time begins and ends, each piece named by `_gap_kind`."""
    out: list[Band] = []
    t = lo
    for kind, a, b in [*_paint(measured(s, phases), lo, hi), ("", hi, hi)]:
        if a > t:
            cuts = sorted({t, a, *(c for h in s.all(ev.Hang) for c in (h.t - h.idle_s, h.t) if t < c < a)})
            out += [Band(s.index, _gap_kind(s, x, y), x, y - x) for x, y in zip(cuts, cuts[1:])]
        if kind:
            out.append(Band(s.index, kind, a, b - a))
        t = max(t, b)
    return out


def marks_of(s: Start) -> list[Mark]:
    out = [Mark(s.index, "save", c.t) for c in s.all(ev.CkptSave)]
    out += [Mark(s.index, "signal", g.t, g.signal or "") for g in s.all(ev.Signal)]
    out += [Mark(s.index, "hang", h.t, f"hang: {h.idle_s:.0f} s idle") for h in s.all(ev.Hang)]
    ending = s.ending or next((r.ending for r in reversed(s.all(ev.Requeue)) if r.ending), None)
    if ending in CRASHES:
        out.append(Mark(s.index, "crash", s.end, ending))
    elif ending is None and s.exit_reason.startswith("died"):
        out.append(Mark(s.index, "died", s.end, "no exit event"))
    return out


def timeline(sm: Summary, phases: bool = True) -> Timeline:
    """Every second from the run's first known moment to its last event, in one band each."""
    starts = sm.starts
    firsts = [s.begin - s.queue_wait_s for s in starts] + ([sm.submit_t] if sm.submit_t is not None else [])
    t0 = min(firsts) if firsts else 0.0
    bands: list[Band] = []
    cursor = t0
    for s in starts:
        waited_from = max(cursor, s.begin - s.queue_wait_s)
        if waited_from > cursor:
            bands.append(Band(s.index, IDLE, cursor, waited_from - cursor))
        if s.begin > waited_from:
            bands.append(Band(s.index, QUEUE, waited_from, s.begin - waited_from))
        lo = max(cursor, s.begin)  # starts of one allocation may share moments: the earlier keeps them
        if s.end > lo:
            bands += _lane(s, lo, s.end, phases)
        cursor = max(cursor, s.end)
    return Timeline(t0, max(cursor, t0), bands, [m for s in starts for m in marks_of(s)])
