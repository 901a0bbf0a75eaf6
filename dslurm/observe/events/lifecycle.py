"""The events of a run's life, start by start: its submission, a start's launch, burn-in and first
step, the stop request, the trainer's exit, how the start ended, and what came next (a requeue
decision, a recovery inside the allocation, a chain cancelled, an operator's request).

`dslurm report` splits a run into starts with these (dslurm/observe/starts.py); the catalogue
and the reading rules are in dslurm/observe/events/__init__.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dslurm.observe.events.base import Event


@dataclass(frozen=True, kw_only=True)
class Submit(Event):
    """A submission (a chain lists every link). The signal lead is the effective one (None with
    requeue off); with the checkpoint interval the report can tell whether the lead sufficed."""
    NAME = "submit"
    job_ids: list[int] = field(default_factory=list)
    signal_lead_s: int | None = None
    signal_lead_setting: str | int | None = None
    signal_lead_reason: str | None = None
    checkpoint_interval: int | None = None
    via: str | None = None
    logs: list[str] = field(default_factory=list)
    """this submission's Slurm log files when they are not under <run_dir>/logs (a sweep's array
    task writes <sweep dir>/logs/NAME-ARRAY_TASK.out|.err; `dslurm doctor` reads them too)"""
    warm: bool | None = None
    """with spares: whether attempts after a failure start warm (recovery.warm, dslurm/submission/warm_proof.py)"""
    warm_reason: str | None = None


@dataclass(frozen=True, kw_only=True)
class JobStart(Event):
    """The launcher on node 0 as a start begins, before any worker imports torch (also runs
    outside Slurm, e.g. api.run_local). `report` measures start-up from here."""
    NAME = "job_start"
    hosts: list[str] = field(default_factory=list)
    mode: str | None = None
    nproc_per_node: int | None = None


@dataclass(frozen=True, kw_only=True)
class Preflight(Event):
    NAME = "preflight"
    passed: bool = False
    bad_nodes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: dict[str, Any] = field(default_factory=dict)
    report: str | None = None
    duration_s: float = 0.0
    nodes: list[str] = field(default_factory=list)


@dataclass(frozen=True, kw_only=True)
class TrainStart(Event):
    NAME = "train_start"
    step: int = 0
    """the step it resumed from (0: fresh)"""
    generation: str | None = None
    fell_back: bool = False
    startup_s: float = 0.0
    """process start -> about to train, as the trainer measured it"""
    layout: dict[str, Any] = field(default_factory=dict)

    @property
    def world_size(self) -> int | None:
        degrees = [v for v in self.layout.values() if isinstance(v, int) and not isinstance(v, bool)]
        prod = 1
        for v in degrees:
            prod *= v
        return prod if degrees else None


@dataclass(frozen=True, kw_only=True)
class StartEnv(Event):
    """The software and machines one start ran on (rank 0, before its `train_start`;
    dslurm/observe/software.py): `report` and `doctor` name what changed between starts. A value
    the start could not know (no GPU, no container, not a git checkout) is None."""
    NAME = "start_env"
    step: int = 0
    """the step the start resumed from (where a change shows on the curves)"""
    torch: str | None = None
    cuda: str | None = None
    nccl: str | None = None
    driver: str | None = None
    gpu: str | None = None
    """the GPU model (rank 0's device)"""
    image: str | None = None
    """the container image the site runs the job in"""
    image_digest: str | None = None
    """its digest where the image names one (`@sha256:...`) or the runtime says"""
    code_sha: str | None = None
    """the git commit of the code the start ran"""
    code_dirty: bool | None = None
    """that checkout had uncommitted changes"""
    python: str | None = None
    packages: int = 0
    """installed Python distributions"""
    packages_changed: dict[str, Any] = field(default_factory=dict)
    """name -> [version at the previous start or None, version now or None]"""
    nodes: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    """NCCL_* and TORCH_* variables"""


@dataclass(frozen=True, kw_only=True)
class StartPhases(Event):
    """One start of the trainer, phase by phase (rank 0, right after the first step; measured by
    train/startup.py). `dslurm.observe.phases` adds the spawn phase (job_start -> t0) and
    turns a run's starts into tables and the restart overhead."""
    NAME = "start_phases"
    t0: float = 0.0
    """the process's birth (unix time, from /proc; else the entry's first line)"""
    phases: dict[str, float] = field(default_factory=dict)
    """seconds per phase in the order passed (names: dslurm.observe.phases.PHASES)"""
    total_s: float = 0.0
    """t0 -> first step done"""
    step: int = 0
    """the step it resumed from (0: fresh)"""
    generation: str | None = None
    """the generation restored (None: a cold start, nothing loaded)"""


@dataclass(frozen=True, kw_only=True)
class Signal(Event):
    """The stop request the ranks agreed on, and the step."""
    NAME = "signal"
    signal: str = ""
    step: int | None = None


@dataclass(frozen=True, kw_only=True)
class Exit(Event):
    """The trainer's own exit: reason completed | requeue | terminated | save_failed | nonfinite."""
    NAME = "exit"
    reason: str = "?"
    step: int | None = None
    code: int | None = None


@dataclass(frozen=True, kw_only=True)
class Ending(Event):
    """How a start ended (dslurm/endings/__init__.py). late=True: the next start wrote it."""
    NAME = "ending"
    cls: str = ""
    reason: str = ""
    origin_rank: int | None = None
    origin_host: str | None = None
    step: int | None = None
    saved: bool = False
    evidence: list[str] = field(default_factory=list)
    step_rc: int | None = None
    late: bool = False
    slurm_state: str | None = None


@dataclass(frozen=True, kw_only=True)
class Requeue(Event):
    """requeue-me's (or the API's) decision: requeue | stop | end."""
    NAME = "requeue"
    decision: str = ""
    step_rc: int | None = None
    exit_code: int | None = None
    reason: str = ""
    ending: str | None = None
    via: str | None = None


@dataclass(frozen=True, kw_only=True)
class Recovery(Event):
    """An in-allocation recovery (dslurm/recover/supervise.py): the job step ended in a failure
    and a new step was launched inside the same allocation, without the queue. `dslurm report`
    measures the time to resumed training from `failed_t` to the next start's first step."""
    NAME = "recovery"
    cause: str = ""
    """the ending's class: crash, node_failure, burnin_rejected"""
    reason: str = ""
    mode: str = ""
    """same_nodes (no node at fault), spare (bad nodes swapped for spares), shrink (fewer nodes)"""
    removed: list[str] = field(default_factory=list)
    """nodes taken out of training (blocklisted)"""
    added: list[str] = field(default_factory=list)
    """spares swapped in"""
    nodes: list[str] = field(default_factory=list)
    """the training nodes of the next job step"""
    from_nodes: int = 0
    to_nodes: int = 0
    grad_accum: int | None = None
    """the gradient accumulation of the next step when a shrink changed it"""
    step_index: int = 0
    """the next job step of this start"""
    resume_step: int | None = None
    """the step the pointer names: where training resumes"""
    failed_t: float | None = None
    """when the failure happened (the earliest report of it; else when the step ended)"""


@dataclass(frozen=True, kw_only=True)
class BlocklistWaived(Event):
    """A requeue let blocklisted nodes back: excluding them all would have left the job fewer
    schedulable nodes in its partition than it needs, pending for ever (dslurm/requeue/exclude.py)."""
    NAME = "blocklist_waived"
    hosts: list[str] = field(default_factory=list)
    """the blocklisted nodes readmitted for this requeue"""
    excluded: list[str] = field(default_factory=list)
    """what the requeued job is still kept off"""
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class ChainCancel(Event):
    NAME = "chain_cancel"
    job_ids: list[int] = field(default_factory=list)
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class OperatorRequest(Event):
    """`dslurm ctl RUN_DIR save|stop` (dslurm/observe/ctl.py), as rank 0 took it at a step
    boundary; the ranks then save (and, for stop, end: not requeued) at that step."""
    NAME = "operator_request"
    action: str = ""
    """save | stop | profile"""
    request_id: str = ""
    user: str = ""
    step: int | None = None
    """completed steps when it was taken"""
    recorded: bool = False
    """stop: the request is on record for requeue-me (the start's cancel.json)"""
    dropped: str = ""
    """not acted on, and why: a stale request (for another start, or too old; ctl.stale_reason)"""
