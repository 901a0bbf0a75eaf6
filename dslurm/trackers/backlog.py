"""What a tracker should show, from the ledger, and what it holds already. Pure: no I/O.

`points(events)` is the run's whole tracker view in ledger order: every fed event (feed.py),
where a start that resumed after `k` completed steps replaces the points an earlier start
wrote after `k` (the steps it trains again). `Held` is what one tracker holds: per metric key
the last step it has, and the annotations it has; it filters what is sent, so a point is sent
once whatever path it came by (live, a catch-up after an outage, the next start, `dslurm
trackers sync`), and on a tracking server that cannot delete points, a resumed start logs only
the steps after the ones already there.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from dslurm.observe import events
from dslurm.trackers.feed import feed
from dslurm.trackers.lane import Item

NOTES = "dslurm/events"
"""the pseudo-key of annotations in `Held.last` (their last step: a purge forgets the later ones)"""


def items_of(ev: events.Event) -> list[Item]:
    """The tracker items one ledger event becomes (values, then its note)."""
    f = feed(ev)
    if f is None:
        return []
    out = []
    if f.values:
        out.append(Item("log", step=f.step, values=f.values, t=ev.t))
    if f.note:
        out.append(Item("event", step=f.step, text=f.note, t=ev.t))
    return out


def points(evs: Iterable[events.Event]) -> list[Item]:
    """Every item the run's trackers should hold, in ledger order; a `train_start` that resumed
    after `k` steps drops the values an earlier start logged after `k` (they are trained again)."""
    out: list[Item] = []
    for ev in evs:
        if isinstance(ev, events.TrainStart):
            out = [i for i in out if i.kind != "log" or i.step <= ev.step]
        out.extend(items_of(ev))
    return out


@dataclass(slots=True)
class Held:
    """What one tracker holds: `last[key]` = the last step it has of that metric (NOTES: of the
    annotations), `notes` = the annotations it has (step, text)."""
    last: dict[str, int] = field(default_factory=dict)
    notes: set[tuple[int, str]] = field(default_factory=set)

    def fresh(self, item: Item) -> Item | None:
        """`item` less what the tracker holds; None when it holds all of it."""
        if item.kind == "log":
            vals = {k: v for k, v in (item.values or {}).items() if item.step > self.last.get(k, -1)}
            if not vals:
                return None
            return Item("log", step=item.step, values=vals, t=item.t)
        if item.kind == "event":
            if (item.step, item.text) in self.notes:
                return None
        return item

    def took(self, item: Item) -> None:
        """The tracker took `item`."""
        if item.kind == "log":
            for k in item.values or {}:
                self.last[k] = max(self.last.get(k, -1), item.step)
        elif item.kind == "event":
            self.took_note(item.step, item.text)

    def took_note(self, step: int, text: str) -> None:
        self.notes.add((step, text))
        self.last[NOTES] = max(self.last.get(NOTES, -1), step)

    def below(self, step: int) -> None:
        """Forget what lies at `step` and later (a purge dropped it: TensorBoard, MLflow's file store)."""
        self.last = {k: min(v, step - 1) for k, v in self.last.items()}
        self.notes = {n for n in self.notes if n[0] < step}

    def to_json(self) -> dict[str, Any]:
        return {"last": dict(sorted(self.last.items())), "notes": sorted([s, t] for s, t in self.notes)}

    @classmethod
    def from_json(cls, data: Any) -> Held:
        last = data.get("last") if isinstance(data, dict) else None
        notes = data.get("notes") if isinstance(data, dict) else None
        return cls(last={str(k): v for k, v in (last if isinstance(last, dict) else {}).items()
                         if isinstance(v, int) and not isinstance(v, bool)},
                   notes={(n[0], n[1]) for n in (notes if isinstance(notes, list) else [])
                          if isinstance(n, list) and len(n) == 2 and isinstance(n[0], int) and isinstance(n[1], str)})


def missing(items: Iterable[Item], held: Held) -> list[Item]:
    """The items (or their parts) a tracker holding `held` lacks, in order."""
    out = []
    for item in items:
        f = held.fresh(item)
        if f is not None:
            out.append(f)
    return out
