"""The events of something wrong inside a running start: a hang the watchdog caught, a
non-finite step, silent data corruption between replicas, a device finding of the NVML poll, a
rank out of memory. The rules behind them are in dslurm/health/__init__.py; doctor and report's health
lines (dslurm/observe/report.py, perflines.py) read them.

The catalogue and the reading rules are in dslurm/observe/events/__init__.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dslurm.observe.events.base import Event


@dataclass(frozen=True, kw_only=True)
class Hang(Event):
    """The hang watchdog fired (train/watchdog.py; the rules: dslurm/health/__init__.py). Written once, by
    the lowest rank that fired; every rank's stacks are in `stacks_dir`."""
    NAME = "hang"
    step: int | None = None
    """optimizer steps completed when progress stopped"""
    idle_s: float = 0.0
    """seconds without progress when the watchdog fired"""
    bound_s: float = 0.0
    median_step_s: float | None = None
    suspects: list[int] = field(default_factory=list)
    suspect_hosts: list[str] = field(default_factory=list)
    why: str = ""
    collectives: dict[str, Any] = field(default_factory=dict)
    """rank -> the last of the trainer's collectives it entered: name, #, still inside; `c10d`: the
    last c10d collective it entered in each process group (group, desc, seq, op, inside)"""
    stacks_dir: str | None = None
    flight: list[dict[str, Any]] = field(default_factory=list)
    """the collectives some ranks wait inside (dslurm/observe/forensics.py Stall: group, seq, op,
    waiting, missing, sentence), the stall that names the suspects first"""
    flight_dir: str | None = None
    """every rank's Flight Recorder dump (PyTorch's pickle; `forensics.VIEW` reads it)"""


@dataclass(frozen=True, kw_only=True)
class NonFinite(Event):
    """A step whose loss or gradient norm was not finite, and what all ranks did about it
    (train.nonfinite: skip | rollback | stop)."""
    NAME = "nonfinite"
    step: int | None = None
    """0-based step whose loss was not finite"""
    loss: float | None = None
    grad_norm: float | None = None
    action: str = ""
    """skip | rollback | stop | train"""
    reason: str = ""
    handled: int = 0
    """non-finite steps skipped or rolled back so far in this start, this one included"""
    generation: str | None = None
    """rollback: the generation restored; stop: the one the pointer still names"""
    resumed_step: int | None = None
    skipped_position: int | None = None
    """the data stream position (samples) of the batch that will not be read again"""


@dataclass(frozen=True, kw_only=True)
class Sdc(Event):
    """Silent data corruption: the fingerprints of replicated parameter shards disagreed
    (train/sdc.py; the rules: dslurm/health/__init__.py). Written once by rank 0 for all replicas."""
    NAME = "sdc"
    step: int | None = None
    """optimizer steps completed when the check ran"""
    last_clean_step: int | None = None
    """the step of the last check that passed (the rollback target was saved at or before it)"""
    suspects: list[int] = field(default_factory=list)
    """global ranks whose shards disagree with their replicas' majority (all of them when unnamed)"""
    suspect_hosts: list[str] = field(default_factory=list)
    named: bool = False
    """a strict majority of replicas agreed, so the suspects are the culprits"""
    why: str = ""
    params: list[str] = field(default_factory=list)
    """parameter names whose fingerprints differ (the first few)"""
    blocklisted: list[str] = field(default_factory=list)
    action: str = ""
    """rollback | stop"""
    generation: str | None = None
    """the generation restored"""
    resumed_step: int | None = None


@dataclass(frozen=True, kw_only=True)
class DeviceHealth(Event):
    """The periodic NVML poll found something (train/sdc.py DevicePoll; the site's burn-in
    thresholds). One event per host and finding set."""
    NAME = "device_health"
    step: int | None = None
    findings: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class Oom(Event):
    """A rank ran out of memory (train/oom.py): where in the step, the allocator's numbers and
    snapshot (GPU). The start ends as `oom`; requeue-me stops with the planner's fix."""
    NAME = "oom"
    rank: int | None = None
    step: int | None = None
    """the 1-based step being taken"""
    phase: str = ""
    """data | compute | optimizer | checkpoint | other"""
    collective: str = ""
    """the last trainer collective it entered (forward_backward, ...)"""
    error: str = ""
    device: str = ""
    memory: dict[str, float] = field(default_factory=dict)
    """GiB: allocated, peak_allocated, reserved, free, total (GPU)"""
    snapshot: str | None = None
    """the allocator snapshot (torch.cuda.memory._dump_snapshot; https://pytorch.org/memory_viz)"""
    note: str | None = None
