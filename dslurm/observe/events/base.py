"""The event every ledger record is: `Event` and its envelope.

Every event class of the catalogue (dslurm/observe/events/) derives from `Event`: its NAME is the
record's `event` on disk, and the envelope (`t`, `job_id`, `restart`, `host`) is filled in by the
ledger (dslurm/observe/ledger.py), not by the producer. Kept apart so that the themed modules
beside it and the catalogue in `__init__` share one base without importing each other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar


@dataclass(frozen=True, kw_only=True)
class Event:
    NAME: ClassVar[str] = ""
    t: float = 0.0
    """set by the ledger when written"""
    job_id: str | None = None
    restart: int | None = None
    host: str | None = None
    """job_id, restart, host: the writer's (from its environment) unless set here, e.g. by a
    late ending written for an earlier start"""

    def fields(self) -> dict[str, Any]:
        """The event's own fields (the envelope is the ledger's), as written to disk."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in _ENVELOPE}


_ENVELOPE = ("t", "job_id", "restart", "host")
