"""The promises a chaos soak checks, from the run's ledger and what the soak did. Pure: the facts
are read by the caller (dslurm/selftest/chaos/run.py) and passed in.

1. complete: the run completed its steps.
2. identical: its final parameters equal an uninterrupted run's, bit for bit (compared by the caller).
3. no step twice: every start resumed at (or past) the newest save committed before it began, and a
   step trained again trained to the same loss, bit for bit.
4. every start ended: each start has an `ending` in the ledger.
5. nothing torn: no garbled ledger line, every generation left sound, no checkpoint fallback.
6. budget: only the run's own failures spend the restart budget: a start that ended in a failure
   (crash, node failure) had a fault of that kind (kill -9, SIGSTOP, a node's step killed) injected
   while it ran; no start was stopped by a spent budget.
7. placeable: the job is never left pending for a reason no wait clears (BadConstraints: a
   blocklist that excludes nodes the job needs).

Each broken promise names the fault just before it (kind, index, when) and the moment it was seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dslurm import endings as E
from dslurm import exitcodes as X
from dslurm.observe import events as ev
from dslurm.observe.report import Start, Summary
from dslurm.selftest.chaos.schedule import OWN_FAILURES


@dataclass(frozen=True, slots=True)
class Broken:
    promise: str
    at: float | None
    """wall clock of the moment it was seen (None: the run as a whole)"""
    detail: str
    fault: str
    """the fault injected last before that moment, in words ('-' when none)"""

    def to_dict(self) -> dict[str, Any]:
        return {"promise": self.promise, "at": self.at, "detail": self.detail, "fault": self.fault}


def fault_before(done: Sequence[dict[str, Any]], t: float | None, t0: float) -> str:
    """The last fault injected at or before `t`, named with its index and offset from t0 ("-" for the
    run as a whole, t None)."""
    hits = [d for d in done if d["injected"] and t is not None and d["t"] <= t]
    if not hits:
        return "-"
    d = hits[-1]
    return f"#{d['index']} {d['kind']} at +{d['t'] - t0:.1f} s ({d['detail']})"


def _resumes(sm: Summary) -> list[Broken]:
    out = []
    committed: list[tuple[float, int]] = []
    for s in sm.starts:
        ts = s.first(ev.TrainStart)
        if ts is not None and committed:
            newest = max(step for t, step in committed if t <= ts.t) if any(t <= ts.t for t, _ in committed) else None
            if newest is not None and ts.step < newest:
                out.append(Broken("no step twice", ts.t, f"start {s.index} resumed at step {ts.step}, but step "
                                  f"{newest} was committed before it began: {newest - ts.step} step(s) trained twice "
                                  "beyond the last committed checkpoint", ""))
        committed += [(e.t, e.step) for e in s.all(ev.CkptSave) if e.step is not None]
    return out


def _same_losses(sm: Summary) -> list[Broken]:
    seen: dict[int, tuple[float, Start]] = {}
    out = []
    for s in sm.starts:
        for w in s.windows:
            if w.first != w.last or w.loss is None:
                continue  # a window of several steps carries their mean
            prev = seen.get(w.last)
            if prev is not None and prev[0] != w.loss:
                out.append(Broken("no step twice", w.t, f"step {w.last} trained again in start {s.index} to loss "
                                  f"{w.loss!r}, in start {prev[1].index} to {prev[0]!r}", ""))
            seen.setdefault(w.last, (w.loss, s))
    return out


def _endings(sm: Summary) -> list[Broken]:
    return [Broken("every start ended", s.end, f"start {s.index} (job {s.job_id}, restart {s.restart}) has no "
                   "ending in the ledger", "") for s in sm.starts if s.ending is None]


def _torn(sm: Summary, events: Sequence[ev.Event], bad_generations: dict[str, list[str]]) -> list[Broken]:
    out = []
    if sm.skipped_lines:
        out.append(Broken("nothing torn", None, f"{sm.skipped_lines} garbled line(s) in the ledger", ""))
    for name, problems in bad_generations.items():
        out.append(Broken("nothing torn", None, f"generation {name}: {'; '.join(problems[:3])}", ""))
    for fb in ev.of(events, ev.CkptFallback):
        out.append(Broken("nothing torn", fb.t, f"a start fell back past {', '.join(fb.rejected) or fb.reason}", ""))
    for rf in ev.of(events, ev.CkptRestoreFailed):
        out.append(Broken("nothing torn", rf.t, f"a start could not restore: {rf.reason}", ""))
    return out


def _budget(sm: Summary, done: Sequence[dict[str, Any]]) -> list[Broken]:
    out = []
    prev_end = float("-inf")
    for s in sm.starts:
        if s.ending in E.FAILURES:
            own = [d for d in done if d["injected"] and d["kind"] in OWN_FAILURES and prev_end <= d["t"] <= s.end]
            if not own:
                out.append(Broken("budget", s.end, f"start {s.index} ended '{s.ending}' ({s.ending_reason}) and "
                                  "spent the restart budget, but no fault of the run's own (kill -9, SIGSTOP, a "
                                  "node's step) hit it", ""))
        for rq in s.all(ev.Requeue):
            if rq.exit_code in (X.BUDGET, X.NO_PROGRESS):
                out.append(Broken("budget", rq.t, f"start {s.index} stopped: {rq.reason}", ""))
        prev_end = s.end
    return out


def check(sm: Summary, events: Sequence[ev.Event], done: Sequence[dict[str, Any]], *, steps: int,
          identical: str | None, bad_generations: dict[str, list[str]], t0: float,
          stuck: tuple[float, str] | None = None) -> list[Broken]:
    """Every broken promise. `identical`: None when the parameters matched, else what differed;
    `stuck`: (when, what) if the job was left pending for good (the soak's `PendingWatch`)."""
    found: list[Broken] = []
    if stuck is not None:
        found.append(Broken("placeable", stuck[0], stuck[1], ""))
    last = sm.starts[-1] if sm.starts else None
    if last is None or last.ending != E.COMPLETED or sm.final_step != steps:
        found.append(Broken("complete", last.end if last else None, f"the run ended "
                            f"{last.ending if last else 'without a start'} at step {sm.final_step} of {steps}", ""))
    if identical is not None:
        found.append(Broken("identical", None, identical, ""))
    found += _resumes(sm) + _same_losses(sm) + _endings(sm) + _torn(sm, events, bad_generations) + _budget(sm, done)
    return [Broken(b.promise, b.at, b.detail, fault_before(done, b.at, t0)) for b in found]
