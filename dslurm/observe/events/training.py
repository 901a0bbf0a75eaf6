"""The events of training going on: logged step windows, straggler checks, evaluations,
profiles on demand, and the experiment trackers fed from the ledger (a tracker that failed, what
one never sent).

The catalogue and the reading rules are in dslurm/observe/events/__init__.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dslurm.observe.events.base import Event


@dataclass(frozen=True, kw_only=True)
class Steps(Event):
    """A logging window: steps first..last (0-based) and their averages."""
    NAME = "steps"
    first: int | None = None
    last: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    mfu_label: str | None = None
    step_time_s: float | None = None
    breakdown: dict[str, float] = field(default_factory=dict)
    """seconds per step in data / compute / optimizer / checkpoint"""
    duration_s: float | None = None
    grad_norm: float | None = None
    lr: float | None = None
    values: dict[str, float] = field(default_factory=dict)
    """a script's other metrics (dslurm.runtime.log_metrics), by name"""

    def phase_s(self, name: str) -> float:
        v = self.breakdown.get(name)
        return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


@dataclass(frozen=True, kw_only=True)
class Stragglers(Event):
    NAME = "stragglers"
    step: int | None = None
    step_times_s: list[float] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)
    factor: float | None = None
    slow: list[dict[str, Any]] = field(default_factory=list)
    """each: rank, host, step_time_s, ratio"""
    parts: dict[str, dict[str, float]] = field(default_factory=dict)
    """rank -> its last step split: data, compute, optimizer (own work), collective_wait (seconds;
    dslurm/observe/slowrank.py)"""
    scores: dict[str, dict[str, float]] = field(default_factory=dict)
    """rank -> relative score per part (NVRx's: the fastest rank's time / this rank's)"""
    causes: list[dict[str, Any]] = field(default_factory=list)
    """the ranks named slow: rank, host, part, score, excess_s, part_s"""

    def slow_hosts(self) -> list[str]:
        return [str(s.get("host", "?")) if isinstance(s, dict) else "?" for s in self.slow]


@dataclass(frozen=True, kw_only=True)
class Eval(Event):
    """An evaluation after optimizer step `step` (train/evaluate.py): forward only over the same
    `eval_batches` global batches each time, so losses are comparable. Rank 0 writes it."""
    NAME = "eval"
    step: int | None = None
    """optimizer steps done when it ran"""
    loss: float | None = None
    """mean token loss over the eval batches; None when interrupted"""
    ppl: float | None = None
    """exp(loss)"""
    batches: int = 0
    """eval batches done (fewer than eval_batches when a stop interrupted it)"""
    eval_batches: int = 0
    tokens: int = 0
    source: str = ""
    """val (data.val) | held_out (data.val_fraction)"""
    duration_s: float = 0.0
    """wall time of the evaluation: not training time (docs/report.md)"""
    interrupted: bool = False


@dataclass(frozen=True, kw_only=True)
class Profile(Event):
    """A `torch.profiler` trace of steps first..last on every rank (train/profile.py), asked for by
    `dslurm ctl RUN profile` or the job (health.profile_at)."""
    NAME = "profile"
    first_step: int | None = None
    last_step: int | None = None
    dir: str | None = None
    files: list[str] = field(default_factory=list)
    """one trace per rank (rank-NNNNN.trace.json.gz), on a GPU also rank-NNNNN.memory.pickle"""
    why: str = ""
    duration_s: float = 0.0
    view: str = ""
    """how to look at them"""


@dataclass(frozen=True, kw_only=True)
class TrackerFailed(Event):
    """An experiment tracker (dslurm/trackers/) raised or did not answer: reported once per outage;
    training goes on, the tracker retries with backoff and catches up from the ledger
    (`tracker_healed`)."""
    NAME = "tracker_failed"
    tracker: str = ""
    """tensorboard | wandb | mlflow"""
    error: str = ""
    """the exception, one line"""
    during: str = ""
    """open | log | event | close"""


@dataclass(frozen=True, kw_only=True)
class TrackerDropped(Event):
    """At a start's end, written by older versions: what one tracker was handed but never sent.
    Now `tracker_delivery` says it (a tracker heals and catches up)."""
    NAME = "tracker_dropped"
    tracker: str = ""
    items: int = 0
    """items not sent (a `steps` window's values are one item, an annotation another)"""
    delivered: int = 0
    """items the tracker took in this start"""
    why: str = ""


@dataclass(frozen=True, kw_only=True)
class TrackerHealed(Event):
    """A tracker that had failed answers again: it caught up from the ledger, in order."""
    NAME = "tracker_healed"
    tracker: str = ""
    down_s: float = 0.0
    """from its `tracker_failed` to its first answer"""
    late: int = 0
    """items sent late (the ledger's points it lacked)"""


@dataclass(frozen=True, kw_only=True)
class TrackerDelivery(Event):
    """One tracker's account at a start's end (`by: start`) or after `dslurm trackers sync`
    (`by: sync`): what it took, late or not, and what it still lacks."""
    NAME = "tracker_delivery"
    tracker: str = ""
    delivered: int = 0
    """items sent as they came (a `steps` window's values are one item, an annotation another)"""
    late: int = 0
    """items sent late: after an outage, or points an earlier start could not send"""
    missing: int = 0
    """items it still lacks (the ledger has them: the next start or a sync sends them)"""
    closed: bool = False
    """its run got its final status (MLflow FINISHED / KILLED / FAILED, W&B finished)"""
    outages: int = 0
    by: str = "start"
    """start | sync"""
