"""A run's starts: the ledger's events split start by start, and each start's own facts.

`split_starts(events)` groups the events by start (a first run, a requeue, a job step after a
recovery inside the allocation; late endings join the start they describe). `starts_of(events)`
turns the groups into `Start` records: begin and end, burn-in and start-up overhead, the step it
resumed from and the one it reached, its logged windows, exit reason, classified ending and what
happened next (`outcome`). Pure. `dslurm report` (dslurm/observe/report.py `summarize`) adds the
run-wide accounting on top (steps kept or redone, queue waits, phases, recoveries); doctor,
perfdoctor, completion, endpoints and the chaos promises read `Start`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import TypeVar

from dslurm import exitcodes as X
from dslurm.observe import events as ev
from dslurm.observe.events import Event

E = TypeVar("E", bound=Event)

DIED = "died without exit event (killed?)"
# Events a fresh start writes before it trains (ev.RESTORES); seeing one after the current start
# trained (or exited) means a new start, even when job_id/restart do not change (runs outside Slurm).
_OUTSIDE = (ev.Submit, ev.ChainCancel)  # written by the submitting host / after the decision


@dataclass(slots=True)
class Window:
    """One `steps` event: steps first..last, and how many of them survived (were not redone)."""

    t: float
    first: int
    last: int
    loss: float | None
    step_s: float
    """seconds per step excluding the checkpoint phase (the save stall billed to the window)"""
    duration_s: float
    kept: int = 0


@dataclass(slots=True)
class Start:
    """One start of the job (first run or a restart): the events between its begin and end."""

    index: int
    job_id: str | None
    restart: int
    begin: float
    """earliest known moment of the start: job_start, preflight t - duration_s, train_start t - startup_s"""
    end: float
    """its last event (the requeue decision when there is one)"""
    queue_wait_s: float = 0.0
    burnin_s: float = 0.0
    overhead_s: float = 0.0
    """begin -> first step (train_start); the whole start when it never trained"""
    resumed_from: int | None = None
    reached: int | None = None
    discarded_steps: int = 0
    """steps trained in this start that a later start redid (it resumed from an earlier step)"""
    productive_s: float = 0.0
    redone_s: float = 0.0
    save_stall_s: float = 0.0
    eval_s: float = 0.0
    """wall time of this start's evaluations (`eval` events): in no step's time, so not productive"""
    world_size: int | None = None
    tokens_per_s: float | None = None
    exit_reason: str = DIED
    decision: str | None = None
    ending: str | None = None
    """the classified ending (dslurm/endings/__init__.py): completed, crash, preempted, save_failed, ..."""
    ending_reason: str | None = None
    phases: list[tuple[str, float]] = field(default_factory=list)
    """start-up phase by phase (dslurm.observe.phases): (name, seconds), spawn first"""
    phases_end: float | None = None
    """when the first step was done (the start_phases event), to place the phases in time"""
    startup_ratio: float | None = None
    """this start's start-up / the cold start's (same phases compared)"""
    startup: str = "cold"
    """how its workers started: "warm" (forked by a node's preloaded pool: the launcher's job_start
    says mode "warm", docs/recovery.md) or "cold" (a fresh interpreter: torchrun or srun)"""
    outcome: str | None = None
    """what happened next, in words (`outcome`): requeued by dslurm, requeued by Slurm, stopped, ended"""
    windows: list[Window] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    def first(self, kind: type[E]) -> E | None:
        return next(ev.of(self.events, kind), None)

    def all(self, *kinds: type[E]) -> list[E]:
        return list(ev.of(self.events, *kinds))


def _key(e: Event) -> tuple[str | None, int]:
    return e.job_id, e.restart or 0


def _opens_new(cur: list[Event], e: Event) -> bool:
    """Does `e` belong to a new start rather than to the current one (`cur`)?"""
    has = {type(x) for x in cur}
    if isinstance(e, ev.Steps) and _key(e) == _key(cur[0]):
        return False  # a window never begins a start: one after the decision is the dying attempt's
    if isinstance(e, ev.BlocklistWaived) and _key(e) == _key(cur[0]):
        return False  # written by requeue-me while it carries its decision out: that start's
    if _key(e) != _key(cur[0]) or ev.Requeue in has or ev.Recovery in has or isinstance(e, ev.JobStart):
        return True  # another job/restart, or the last start already took its decision (or recovered)
    trained = ev.TrainStart in has or ev.Exit in has
    restored = any(isinstance(x, ev.RESTORES) for x in cur)
    if isinstance(e, (*ev.RESTORES, ev.TrainStart)):
        return trained
    if isinstance(e, ev.Preflight):
        return trained or ev.Preflight in has or restored
    return False


def _rolled_back(e: Event, after: list[Event]) -> bool:
    """A restore inside a running start: the trainer rolled back (non-finite loss, silent data
    corruption) and wrote its event right after the restore's. Not a new start."""
    return (isinstance(e, ev.RESTORES) and bool(after) and _key(after[0]) == _key(e)
            and isinstance(after[0], (ev.NonFinite, ev.Sdc)) and after[0].action == "rollback")


def _late(e: Event) -> bool:
    """An ending written by a later start for an earlier one (whose batch shell died with it)."""
    return isinstance(e, ev.Ending) and e.late


def split_starts(events: Iterable[Event]) -> list[list[Event]]:
    """The run's events grouped by start, in ledger order; submit/chain_cancel are left out,
    late endings join the start they describe."""
    starts: list[list[Event]] = []
    events = list(events)
    for i, e in enumerate(events):
        if isinstance(e, _OUTSIDE) or _late(e):
            continue
        if not starts or (_opens_new(starts[-1], e) and not _rolled_back(e, events[i + 1:i + 2])):
            starts.append([])
        starts[-1].append(e)
    for e in filter(_late, events):
        # The last start of that incarnation: the job steps of one allocation share its key, and a
        # late ending is for the one its batch shell died in (the earlier ones had theirs written).
        for g in reversed(starts):
            if _key(g[0]) == _key(e):
                g.append(replace(e, t=max(x.t for x in g)))  # it describes that start's end
                break
    return starts


def _begin(evs: list[Event]) -> float:
    cands = [e.t for e in evs]
    cands += [e.t - e.duration_s for e in ev.of(evs, ev.Preflight)]
    cands += [e.t - e.startup_s for e in ev.of(evs, ev.TrainStart)]
    return min(cands)


STRAY = "stray stop (a TERM reached the job step only)"
OPERATOR = "operator stop (dslurm ctl stop, saved)"


def _reason_of_ending(ending: str, rc: int | None) -> str:
    """A start's exit reason, in the words of exitcodes.NAMES, from its classified ending
    (dslurm/endings/__init__.py) rather than srun's code: a burn-in rejection or a warned stop
    that srun tore down on the other node returns 143, a crash torchrun folds into 1. Pure."""
    from dslurm import endings as E

    said = {E.COMPLETED: "completed (no exit event)", E.WARNED_STOP: "requeue (no exit event)",
            E.BURNIN_REJECTED: "preflight_failed", E.USER_ERROR: "user_error", E.SAVE_FAILED: "save_failed",
            E.REFUSED: "refused", E.DIVERGED: "nonfinite", E.CANCELLED: "terminated",
            E.PREEMPTED: "terminated", E.TIME_LIMIT: "terminated", E.STRAY_STOP: STRAY,
            E.OPERATOR_STOP: OPERATOR}
    return said.get(ending) or f"failed ({ending}{'' if rc is None else f', exit {rc}'})"


def _exit_reason(s: Start) -> tuple[str, str | None]:
    """(reason, requeue decision): the requeue decision wins when it stopped the chain."""
    ex, rq = s.all(ev.Exit), s.all(ev.Requeue)
    rq_ev = rq[-1] if rq else None
    decision = rq_ev.decision if rq_ev else None
    if rq_ev and rq_ev.exit_code in (X.NO_PROGRESS, X.BUDGET):
        return X.NAMES[rq_ev.exit_code], decision
    if rq_ev and rq_ev.ending == "stray_stop":  # the ranks exited 143 on it: not a cancel, say what it was
        return STRAY, decision
    if rq_ev and rq_ev.ending == "operator_stop":  # the ranks exited 143 on it: an operator's stop, not a cancel
        return OPERATOR, decision
    if ex:
        return ex[-1].reason, decision
    if rq_ev and rq_ev.ending:  # no exit event from the trainer: the ending classified from the facts
        return _reason_of_ending(rq_ev.ending, rq_ev.step_rc), decision
    if rq_ev:  # an older ledger without the ending: the step's code, said as such
        rc = rq_ev.step_rc
        name = X.NAMES.get(rc) if rc is not None else None
        if name and rc in (X.OK, X.REQUEUE):
            name += " (no exit event)"  # e.g. a burn-in-only job, or an exit line lost to a kill
        return name or f"failed (exit {rc})", decision
    return DIED, decision


def _fill_start(s: Start) -> None:
    """Per-start facts that need only the start's own events."""
    ts = s.first(ev.TrainStart)
    launch = s.first(ev.JobStart)
    s.startup = "warm" if launch is not None and launch.mode == "warm" else "cold"
    s.burnin_s = sum(e.duration_s for e in s.all(ev.Preflight))
    s.overhead_s = (ts.t - s.begin) if ts else (s.end - s.begin)
    s.resumed_from = ts.step if ts else None
    s.world_size = ts.world_size if ts else None
    s.save_stall_s = sum(e.stall_s for e in s.all(ev.CkptSave))
    s.eval_s = sum(e.duration_s for e in s.all(ev.Eval))
    reached = [s.resumed_from] if s.resumed_from is not None else []
    marks: list[int | None] = [e.step for e in s.all(ev.Exit)] + [e.step for e in s.all(ev.Signal)]
    reached += [m for m in marks + [e.step for e in s.all(ev.CkptSave)] if m is not None]
    tok_time = dur = 0.0
    for e in s.all(ev.Steps):
        if e.first is None or e.last is None:
            continue
        n = max(1, e.last - e.first + 1)
        d = e.duration_s or (e.step_time_s or 0.0) * n
        s.windows.append(Window(e.t, e.first, e.last, e.loss, max(0.0, d / n - e.phase_s("checkpoint")), d))
        reached.append(e.last + 1)
        if e.tokens_per_s is not None:
            tok_time, dur = tok_time + e.tokens_per_s * d, dur + d
    s.reached = max(reached) if reached else None
    s.tokens_per_s = tok_time / dur if dur else None
    s.exit_reason, s.decision = _exit_reason(s)
    ends = s.all(ev.Ending)
    if ends:
        s.ending, s.ending_reason = ends[-1].cls, ends[-1].reason


def outcome(decision: str | None, requeued_by_slurm: bool) -> str | None:
    """What happened after a start, from its requeue decision and whether the same Slurm job
    started again. `stop` after a Slurm stop (preemption, cancel, time limit) means dslurm left
    the next move to Slurm: when a later start of the same job exists, Slurm requeued it."""
    if decision == "requeue":
        return "requeued by dslurm"
    if decision == "end":
        return "ended"
    if requeued_by_slurm:  # `stop`, or no decision at all (killed with its batch shell)
        return "requeued by Slurm"
    return "stopped" if decision == "stop" else None


def _outcomes(starts: list[Start]) -> None:
    for i, s in enumerate(starts):
        rec = s.all(ev.Recovery)
        if rec:
            s.outcome = f"recovered in the allocation ({rec[-1].mode})"
            continue
        again = s.job_id is not None and any(
            t.job_id == s.job_id and t.restart > s.restart for t in starts[i + 1:])
        s.outcome = outcome(s.decision, again)


def starts_of(events: Iterable[Event]) -> list[Start]:
    """The run's starts in ledger order, each filled from its own events (`_fill_start`) and
    with what happened next (`outcome`). Pure."""
    starts = [Start(i, g[0].job_id, g[0].restart or 0, _begin(g), max(e.t for e in g), events=g)
              for i, g in enumerate(split_starts(events))]
    for s in starts:
        _fill_start(s)
    _outcomes(starts)
    return starts
