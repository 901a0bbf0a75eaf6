"""The pieces every checkpoint tier shares (in-job; imports torch): the object collectives, one
save's job record and outcome, and the reasons a save failed, told the way a person fixes them.

Imported by the manager (dslurm.checkpoint.dcp), the tier context (dslurm.checkpoint.tier) and
both tiers; it imports none of them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from dslurm import checkpoint as ck
from dslurm.observe import events


class Ledger(Protocol):
    def append(self, ev: events.Event) -> Any: ...


@dataclass
class SaveOutcome:
    generation: str
    step: int
    ok: bool
    reason: str = ""
    bytes: int = 0
    stall_s: float = 0.0  # training blocked (state_dict + staging, or the whole sync save)
    total_s: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # rank 0: seconds since the save began
    tier: str = "durable"  # "two_tier": locally committed first, then copied (dslurm.checkpoint.twotier)
    durable: bool = True  # False: locally committed only (on_lag=skip_durable)
    local_s: float | None = None  # two tiers: seconds from the save's start to the local commit
    local_commit_t: float | None = None  # two tiers: unix time of the local commit
    lag_s: float | None = None  # two tiers: durable commit minus local commit


@dataclass
class Job:
    """One save as every rank knows it: the generation's name, step, the process's nth save (the
    fault knobs count saves), meta.json, this rank's RNG and per-rank state, its phases."""

    name: str
    step: int
    nth: int
    meta: dict[str, Any]
    rng: dict[str, Any]
    t0: float
    phases: dict[str, float] = field(default_factory=dict)
    lag_wait_s: float = 0.0  # two tiers, on_lag=wait: training waited this long for the copier first
    state: dict[str, Any] = field(default_factory=dict)  # this rank's per-rank state (per_rank.capture)
    files: Path | None = None  # a finished folder this rank moves into the generation (ck.FILES)

    def since(self) -> float:
        return time.perf_counter() - self.t0


class Comm:
    """Object collectives on one group; a no-op world of one without torch.distributed."""

    def __init__(self, group: Any):
        self.group = group
        self.rank = dist.get_rank() if group is not None else 0
        self.world = dist.get_world_size() if group is not None else 1

    @classmethod
    def new(cls, on: bool) -> Comm:
        """On a gloo group of its own (a thread's collectives never interleave with another's)."""
        return cls(dist.new_group(backend="gloo") if on else None)

    def bcast(self, obj: Any) -> Any:
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out


def to_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}


def failure_hint(reason: str, run_dir: Path) -> str:
    """What a person should do about a failed save, from its reason. Pure."""
    if ck.full_disk(reason):
        return (f"the disk holding {run_dir} is full (ENOSPC): free space (e.g. `dslurm ckpt gc {run_dir}`) "
                "or point checkpoint.run_dir at a larger file system, then resubmit; it resumes from the pointer")
    if "non-finite" in reason:
        return ("the model or optimizer state is not finite (training diverged): lower train.lr or enable "
                "clipping, then resubmit; it resumes from the pointer's (finite) generation")
    return "see the reason above; the pointer still names the last verified generation"


def reason(exc: BaseException) -> str:
    # DCP wraps per-rank failures (e.g. ENOSPC) in CheckpointException; name each rank's cause.
    if isinstance(exc, CheckpointException):
        causes = {r: (e[0] if isinstance(e, tuple) else e) for r, e in exc.failures.items()}
        return "; ".join(f"rank {r}: {reason(e)}" for r, e in sorted(causes.items()))[:2000]
    return f"{type(exc).__name__}: {exc}"[:2000]


def write_reason(exc: BaseException, path: Path) -> str:
    """The reason a write failed, with the disk's state when that is the cause."""
    text, full = reason(exc), ck.disk_full_fact(path)
    return f"{full}; {text}" if full and "No space left" not in text else text
