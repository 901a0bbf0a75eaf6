"""Each replica group's line through its faults, as spans for the report's PNG (`recovery.replicas`,
docs/recovery.md): one lane per group from the run's first training to the group's end, the
stretches it was out of the quorum (from its failure to its heal), and its losses and heals as
marks. Pure: from the ledger's replica events (dslurm/observe/events/replicas.py); drawn by
dslurm/observe/plot.py, told in words by dslurm/observe/replica_lines.py."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from dslurm.observe import events as ev

JOINED_LATE = "joined late"


@dataclass(frozen=True, slots=True)
class Out:
    """A stretch a group was out of the quorum: from the failure to the heal that brought it back."""

    t0: float
    """the failure (`replica_lost.failed_t`; the record's time when the failure time is unknown)"""
    t1: float
    """the heal (`replica_healed`'s time), or the lane's end when it never came back"""
    step: int | None
    """the last step the group began before it was lost"""
    cause: str
    """the first loss's cause (a group lost again while it restarts stays in one stretch), or
    `joined late` (no loss: it began after the others and healed into their quorum)"""
    losses: int = 1
    """losses in the stretch; 0 for a late join"""
    healed_step: int | None = None
    """the step it joined at; None: not healed before its lane ends"""
    heal_s: float | None = None


@dataclass(frozen=True, slots=True)
class GroupLane:
    group: int
    t0: float
    """the run's first training (its first train_start), or the first replica event"""
    t1: float
    """the group's end (`replica_end`), else its last replica event"""
    outs: list[Out] = field(default_factory=list)
    trained: list[tuple[float, float]] = field(default_factory=list)
    """the stretches of [t0, t1] in which the job trained (each start's first step to its end):
    a requeue's gap is not drawn as time in the quorum"""

    def out_s(self) -> float:
        return sum(o.t1 - o.t0 for o in self.outs)


def group_lanes(events: Iterable[ev.Event], trained: list[tuple[float, float]] | None = None) -> list[GroupLane]:
    """One lane per group seen in the replica events, by group number; [] for a run without them.
    `trained`: when the job trained (each start's train_start to its end); None: all along."""
    events = list(events)
    lost = list(ev.of(events, ev.ReplicaLost))
    healed = list(ev.of(events, ev.ReplicaHealed))
    steps = list(ev.of(events, ev.ReplicaSteps))
    ends = {e.group: e.t for e in ev.of(events, ev.ReplicaEnd)}
    mine: list[ev.Event] = [*lost, *healed, *steps, *ev.of(events, ev.ReplicaEnd)]
    if not mine:
        return []
    starts = [e.t for e in ev.of(events, ev.TrainStart)]
    t0 = min(starts) if starts else min(e.t for e in mine)
    groups = sorted({getattr(e, "group") for e in mine})
    out: list[GroupLane] = []
    for g in groups:
        t1 = ends.get(g, max(e.t for e in mine if getattr(e, "group") == g))
        t1 = max(t0, t1)
        spans = [(max(a, t0), min(b, t1)) for a, b in (trained if trained is not None else [(t0, t1)])]
        out.append(GroupLane(g, t0, t1, _outs([x for x in lost if x.group == g], [h for h in healed if h.group == g],
                                              t0, t1), [(a, b) for a, b in spans if b > a]))
    return out


def _outs(lost: list[ev.ReplicaLost], healed: list[ev.ReplicaHealed], begin: float, end: float) -> list[Out]:
    """The group's losses and heals in time order, paired: a stretch opens at a loss and closes at
    the next heal; a heal with no loss open that missed steps is a late join (out from the lane's
    begin); one that missed none (a resumed run's first quorum) is no stretch."""
    timed: list[tuple[float, int, ev.Event]] = [(_failed(x), 0, x) for x in lost] + [(h.t, 1, h) for h in healed]
    out: list[Out] = []
    open_: Out | None = None
    for t, _, e in sorted(timed, key=lambda p: (p[0], p[1])):
        if isinstance(e, ev.ReplicaLost):
            open_ = (Out(t, end, e.step, e.cause) if open_ is None
                     else Out(open_.t0, end, open_.step, open_.cause, losses=open_.losses + 1))
        elif isinstance(e, ev.ReplicaHealed) and open_ is not None:
            out.append(Out(open_.t0, t, open_.step, open_.cause, open_.losses, e.step, e.heal_s))
            open_ = None
        elif isinstance(e, ev.ReplicaHealed) and e.missed_steps and t > begin:
            out.append(Out(begin, t, None, JOINED_LATE, 0, e.step, e.heal_s))
    if open_ is not None:
        out.append(Out(open_.t0, max(open_.t0, end), open_.step, open_.cause, open_.losses))
    return out


def _failed(x: ev.ReplicaLost) -> float:
    return x.failed_t if x.failed_t is not None else x.t
