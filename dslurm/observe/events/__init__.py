"""The ledger's events, typed: one dataclass per event the chain writes.

Producers construct one of these and hand it to `Ledger.append` (dslurm/observe/ledger.py);
readers (`report`, `doctor`, `requeue-me`, `submit`) get them back from `read(run_dir)` or
`decode(record)` and use attributes, never string keys. The field `event` on disk is the
class's NAME. Every event also carries the envelope the ledger fills in: `t` (unix time),
`job_id`, `restart`, `host`.

Reading is tolerant, because a ledger outlives the code that wrote it and a kill -9 or an
older/newer version can leave odd records: an unknown event name decodes to None (skipped),
an unknown field is ignored, and a field of the wrong type (a garbled producer) reads as its
default. A record without a numeric `t` is not an event.

The package holds the classes by theme: `base` (Event and its envelope), `lifecycle` (submit,
a start's launch, exit and ending, requeue, recovery), `ckpt` (restores, saves, init_from),
`training` (step windows, stragglers, evaluations, profiles, trackers), `health` (hang,
non-finite, SDC, device findings, OOM) and `replicas` (replica groups lost, healed, their
steps). This module is the one registry: every class is re-exported here (`from
dslurm.observe import events as ev; ev.JobStart`), `CATALOGUE` maps each NAME to its class, and
the reading rules (`decode`, `read`, `of`) live below it. A new event: its class in the module of
its theme, then its name here (import, `__all__`, `CATALOGUE`).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from dslurm.observe.events.base import Event
from dslurm.observe.events.ckpt import (
    CkptDurableSkipped,
    CkptFallback,
    CkptFreshStart,
    CkptLocalCommit,
    CkptPartnerCommit,
    CkptRestore,
    CkptRestoreFailed,
    CkptSave,
    CkptSaveFailed,
    CkptSaveSkipped,
    InitFrom,
    RestoreRejected,
)
from dslurm.observe.events.health import DeviceHealth, Hang, NonFinite, Oom, Sdc
from dslurm.observe.events.lifecycle import (
    BlocklistWaived,
    ChainCancel,
    Ending,
    Exit,
    JobStart,
    OperatorRequest,
    Preflight,
    Recovery,
    Requeue,
    Signal,
    StartEnv,
    StartPhases,
    Submit,
    TrainStart,
)
from dslurm.observe.events.replicas import ReplicaEnd, ReplicaHealed, ReplicaLost, ReplicaSteps
from dslurm.observe.events.training import (
    Eval,
    Profile,
    Steps,
    Stragglers,
    TrackerDelivery,
    TrackerDropped,
    TrackerFailed,
    TrackerHealed,
)

__all__ = [
    "ALIASES", "CATALOGUE", "RESTORES", "BlocklistWaived", "ChainCancel", "CkptDurableSkipped", "CkptFallback",
    "CkptFreshStart",
    "CkptLocalCommit", "CkptPartnerCommit",
    "CkptRestore", "CkptRestoreFailed", "CkptSave", "CkptSaveFailed", "CkptSaveSkipped",
    "DeviceHealth", "E", "Ending", "Eval", "Event", "Exit", "Hang", "InitFrom", "JobStart", "NonFinite", "Oom",
    "OperatorRequest", "Preflight", "Profile", "Recovery", "ReplicaEnd", "ReplicaHealed", "ReplicaLost",
    "ReplicaSteps", "Requeue", "RestoreRejected", "Sdc", "Signal", "StartEnv",
    "StartPhases", "Steps",
    "Stragglers", "Submit", "TrackerDelivery", "TrackerDropped", "TrackerFailed", "TrackerHealed", "TrainStart",
    "decode", "decode_all", "of", "read",
]

E = TypeVar("E", bound="Event")

CATALOGUE: dict[str, type[Event]] = {c.NAME: c for c in (
    JobStart, Submit, Preflight, StartEnv, CkptFreshStart, CkptRestoreFailed, CkptRestore, CkptFallback, TrainStart,
    StartPhases, Steps, Stragglers, CkptSave, CkptLocalCommit, CkptPartnerCommit, CkptDurableSkipped,
    RestoreRejected, CkptSaveFailed,
    CkptSaveSkipped, Signal, Exit, Hang, NonFinite, Ending, Requeue, Recovery, ChainCancel, BlocklistWaived,
    Sdc, DeviceHealth, Eval,
    InitFrom, TrackerFailed, TrackerDropped, TrackerHealed, TrackerDelivery, OperatorRequest, Oom, Profile,
    ReplicaLost, ReplicaHealed, ReplicaSteps, ReplicaEnd)}
ALIASES = {"local_start": JobStart}  # older ledgers
RESTORES = (CkptFreshStart, CkptRestore, CkptRestoreFailed)  # CkptFallback is a CkptRestore


# ------------------------------------------------------------------------------ reading

def _matches(value: Any, tp: Any) -> bool:
    """Does a decoded JSON value fit the annotated type? (bool is not a number here)"""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is Any:
        return True
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is list:
        (arg,) = typing.get_args(tp)
        return isinstance(value, list) and all(_matches(v, arg) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    return isinstance(value, tp)


_HINTS: dict[str, dict[str, Any]] = {}


def _hints(cls: type[Event]) -> dict[str, Any]:
    """Field name -> type of an event class (computed once per class)."""
    if cls.NAME not in _HINTS:
        names = {f.name for f in dataclasses.fields(cls)}
        _HINTS[cls.NAME] = {k: v for k, v in typing.get_type_hints(cls).items() if k in names}
    return _HINTS[cls.NAME]


def _members(tp: Any) -> tuple[Any, ...]:
    return typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)


def _coerce(name: str, value: Any, tp: Any) -> Any:
    if not isinstance(value, int) or isinstance(value, bool):
        return value
    if name == "job_id":
        return str(value)  # a hand-written or older record
    members = _members(tp)
    return float(value) if float in members and int not in members else value


# A record's time is a Unix time of this era: a value past it (1e300, inf, a negative one) is a
# damaged or hand-edited record, skipped like a torn one rather than turned into a 200-digit wall time.
LATEST_T = 1e10  # 2286-11-20


def decode(record: Any) -> Event | None:
    """The typed event of one ledger record; None for an unknown name or a record without a
    plausible time (a Unix time in [0, LATEST_T))."""
    if not isinstance(record, dict):
        return None
    cls = CATALOGUE.get(str(record.get("event"))) or ALIASES.get(str(record.get("event")))
    t = record.get("t")
    if cls is None or not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 <= t < LATEST_T:
        return None
    kwargs = {}
    for name, tp in _hints(cls).items():
        if name in record:
            value = _coerce(name, record[name], tp)
            if _matches(value, tp):
                kwargs[name] = value
    return cls(**kwargs)


def decode_all(records: Iterable[Any]) -> list[Event]:
    return [ev for ev in map(decode, records) if ev is not None]


def read(run_dir: str | Path) -> list[Event]:
    """The run's events, typed, in ledger order (torn and unknown records skipped)."""
    from dslurm.observe.ledger import read_events

    return decode_all(read_events(run_dir))


def of(events: Iterable[Event], *kinds: type[E]) -> Iterator[E]:
    """The events of the given kinds (a subclass counts: CkptFallback is a CkptRestore)."""
    return (e for e in events if isinstance(e, kinds))
