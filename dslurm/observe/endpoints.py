"""A recovery timed from an outside moment (a kill, a failure), phase by phase, read from the
ledger through the report's own rules. Pure.

The benches under bench/ time "the kill -> training again". The endpoint is the first step done
by the start being timed (`report.first_step_done`: the start the report splits off, never the
first `steps` event after the kill, which a dying attempt's rank 0 may still log), and the
phases in between come from the same starts:

  ending       the dying start's ending (None when the next start wrote it, late)
  decided      its decision: the in-allocation `recovery`, or requeue-me's `requeue`
  job_start    the timed start's launcher (the first start whose job_start is at or after t0)
  train_start  the timed start restored and about to train
  first_step   the timed start's first step done

`check_order` names what is out of order (ending <= decided <= job_start <= train_start <=
first_step, every phase at or after t0; first_step and train_start must exist): a bench rejects
such a rep loudly and never averages it in.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dslurm.observe import events as ev
from dslurm.observe.report import first_step_done, summarize
from dslurm.observe.starts import Start

ORDER = ("ending", "decided", "job_start", "train_start", "first_step")
REQUIRED = ("job_start", "train_start", "first_step")


@dataclass(frozen=True, slots=True)
class Timed:
    """Seconds from t0 to each phase (None: not in the ledger), and the start being timed."""

    t0: float
    phases: dict[str, float | None]
    start: Start | None

    def seconds(self, phase: str) -> float | None:
        return self.phases.get(phase)

    @property
    def first_step(self) -> float | None:
        return self.phases.get("first_step")


def _since(t0: float, t: float | None) -> float | None:
    return None if t is None else round(t - t0, 4)


def since(events: Iterable[ev.Event], t0: float) -> Timed:
    """The phases of the first start launched at or after t0, from t0."""
    starts = summarize(list(events)).starts
    timed = next((s for s in starts if (j := s.first(ev.JobStart)) is not None and j.t >= t0), None)
    if timed is None:
        return Timed(t0, {k: None for k in ORDER}, None)
    # The start that was running at t0 (not a stray group a late event may open after it).
    dying = next((s for s in reversed(starts[:timed.index]) if s.begin <= t0), None)
    ending = decided = None
    if dying is not None:
        ends = [e for e in dying.all(ev.Ending) if not e.late]
        ending = ends[-1].t if ends else None
        calls = dying.all(ev.Recovery, ev.Requeue)
        decided = calls[0].t if calls else None
    ts, js = timed.first(ev.TrainStart), timed.first(ev.JobStart)
    raw = {"ending": ending, "decided": decided, "job_start": js.t if js else None,
           "train_start": ts.t if ts else None, "first_step": first_step_done(timed) if ts else None}
    return Timed(t0, {k: _since(t0, v) for k, v in raw.items()}, timed)


def check_order(timed: Timed) -> list[str]:
    """What is wrong with these phases, in words; [] when they are in order."""
    problems = [f"no {k}" for k in REQUIRED if timed.seconds(k) is None]
    known = [(k, v) for k in ORDER if (v := timed.seconds(k)) is not None]
    problems += [f"{k} {v:.3f} s before t0" for k, v in known if v < 0]
    problems += [f"{b} {vb:.3f} s before {a} {va:.3f} s" for (a, va), (b, vb) in zip(known, known[1:]) if vb < va]
    return problems


def format_phases(timed: Timed) -> str:
    """One line: each phase's seconds from t0 ('-' when not in the ledger)."""
    return ", ".join(f"{k} {'-' if v is None else f'{v:.2f}'}" for k, v in timed.phases.items())


def start_phases(s: Start) -> Timed:
    """One start's own phases from its begin (a requeued start: no ending/decision of its own
    to time from): job_start, train_start, first_step."""
    ts, js = s.first(ev.TrainStart), s.first(ev.JobStart)
    raw = {"job_start": js.t if js else None, "train_start": ts.t if ts else None,
           "first_step": first_step_done(s) if ts else None}
    return Timed(s.begin, {k: _since(s.begin, v) for k, v in raw.items()}, s)
