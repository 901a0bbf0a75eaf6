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
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

E = TypeVar("E", bound="Event")


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


@dataclass(frozen=True, kw_only=True)
class JobStart(Event):
    """The launcher on node 0 as a start begins, before any worker imports torch (also runs
    outside Slurm, e.g. api.run_local). `report` measures start-up from here."""
    NAME = "job_start"
    hosts: list[str] = field(default_factory=list)
    mode: str | None = None
    nproc_per_node: int | None = None


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
    """with spares: whether attempts after a failure start warm (recovery.warm, dslurm/warm_proof.py)"""
    warm_reason: str | None = None


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
class CkptFreshStart(Event):
    NAME = "ckpt_fresh_start"
    run_dir: str | None = None
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class CkptRestoreFailed(Event):
    NAME = "ckpt_restore_failed"
    run_dir: str | None = None
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class CkptRestore(Event):
    NAME = "ckpt_restore"
    run_dir: str | None = None
    step: int | None = None
    generation: str | None = None
    reason: str = ""
    rejected: list[str] = field(default_factory=list)
    tier: str = "durable"
    """"local" (node-local copies, same nodes and layout) or "durable" (the run dir)"""
    tier_reason: str = ""
    """why that tier: the local candidate used, or why no local generation qualified"""
    rng_restored: bool | None = None
    """False: the world size changed, so the ranks' saved RNG streams (Python, numpy, torch, CUDA)
    were not restored: dropout and sampling start from the script's seeds (None: older ledgers)"""
    saved_world_size: int | None = None
    """the world size the generation was saved with"""


@dataclass(frozen=True, kw_only=True)
class CkptFallback(CkptRestore):
    """A restore that skipped the pointer's generation (rejected or garbage pointer)."""
    NAME = "ckpt_fallback"


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
class CkptSave(Event):
    NAME = "ckpt_save"
    run_dir: str | None = None
    step: int | None = None
    generation: str | None = None
    bytes: int = 0
    stall_s: float = 0.0
    """how long training was blocked by this save"""
    total_s: float = 0.0
    """from the save's start to the pointer move (two tiers: includes the durable copy)"""
    tier: str = "durable"
    """"durable" (written to the run dir) or "two_tier" (local commit first, then copied)"""
    local_commit_t: float | None = None
    """two tiers: unix time of the local commit (restorable on the same nodes from then on)"""
    lag_s: float | None = None
    """two tiers: durable commit minus local commit (node loss loses this much more than a restart)"""


@dataclass(frozen=True, kw_only=True)
class CkptLocalCommit(Event):
    """Two tiers: every rank's shard is on its node's scratch with its crc32 known; the generation
    is restorable by a job on the same nodes and layout, not yet after a node loss."""
    NAME = "ckpt_local_commit"
    run_dir: str | None = None
    step: int | None = None
    generation: str | None = None
    bytes: int = 0
    stall_s: float = 0.0
    local_s: float = 0.0
    """from the save's start to the local commit"""
    lag_wait_s: float = 0.0
    """on_lag=wait: seconds training waited for the previous durable copy before this save began
    (included in the save's stall_s)"""


@dataclass(frozen=True, kw_only=True)
class CkptDurableSkipped(Event):
    """Two tiers, on_lag=skip_durable: the copier was still busy with an older generation when
    this one was locally committed; it stays local only (node loss falls back further)."""
    NAME = "ckpt_durable_skipped"
    run_dir: str | None = None
    step: int | None = None
    generation: str | None = None
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class CkptSaveFailed(Event):
    NAME = "ckpt_save_failed"
    run_dir: str | None = None
    step: int | None = None
    generation: str | None = None
    reason: str = ""
    policy: str | None = None


@dataclass(frozen=True, kw_only=True)
class CkptSaveSkipped(Event):
    NAME = "ckpt_save_skipped"
    run_dir: str | None = None
    step: int | None = None
    reason: str = ""
    """"in_flight" (on_inflight=skip) or "lag" (two tiers, on_lag=skip_local)"""


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
class Hang(Event):
    """The hang watchdog fired (train/watchdog.py; the rules: dslurm/health.py). Written once, by
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
class Ending(Event):
    """How a start ended (dslurm/endings.py). late=True: the next start wrote it."""
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
class ChainCancel(Event):
    NAME = "chain_cancel"
    job_ids: list[int] = field(default_factory=list)
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class Sdc(Event):
    """Silent data corruption: the fingerprints of replicated parameter shards disagreed
    (train/sdc.py; the rules: dslurm/health.py). Written once by rank 0 for all replicas."""
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
class InitFrom(Event):
    """`model.init_from` at a start (dslurm/checkpoint/init_from.py): the weights were loaded (a
    fresh start) or not, because a generation existed (resume wins)."""
    NAME = "init_from"
    path: str = ""
    action: str = ""
    """loaded or resumed"""
    generation: str | None = None
    """resumed: the generation restored instead"""
    step: int | None = None
    """resumed: its step"""
    tensors: int = 0
    """loaded: parameters filled on rank 0"""
    bytes_read: int = 0
    """loaded: bytes rank 0 read (its own shard, not the model)"""
    load_s: float = 0.0


@dataclass(frozen=True, kw_only=True)
class TrackerFailed(Event):
    """An experiment tracker (dslurm/trackers/) raised: reported once, then that tracker is off for
    the rest of this start; training goes on and the ledger keeps every number."""
    NAME = "tracker_failed"
    tracker: str = ""
    """tensorboard | wandb | mlflow"""
    error: str = ""
    """the exception, one line"""
    during: str = ""
    """open | log | event | close"""


@dataclass(frozen=True, kw_only=True)
class TrackerDropped(Event):
    """At a start's end: what one tracker was handed but never sent (its bounded queue was full,
    or it was off after a `tracker_failed`). The ledger itself has every number."""
    NAME = "tracker_dropped"
    tracker: str = ""
    items: int = 0
    """items not sent (a `steps` window's values are one item, an annotation another)"""
    delivered: int = 0
    """items the tracker took in this start"""
    why: str = ""


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


CATALOGUE: dict[str, type[Event]] = {c.NAME: c for c in (
    JobStart, Submit, Preflight, CkptFreshStart, CkptRestoreFailed, CkptRestore, CkptFallback, TrainStart,
    StartPhases, Steps, Stragglers, CkptSave, CkptLocalCommit, CkptDurableSkipped, CkptSaveFailed,
    CkptSaveSkipped, Signal, Exit, Hang, NonFinite, Ending, Requeue, Recovery, ChainCancel,
    Sdc, DeviceHealth, Eval,
    InitFrom, TrackerFailed, TrackerDropped, OperatorRequest, Oom, Profile)}
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


def decode(record: Any) -> Event | None:
    """The typed event of one ledger record; None for an unknown name or a record without time."""
    if not isinstance(record, dict):
        return None
    cls = CATALOGUE.get(str(record.get("event"))) or ALIASES.get(str(record.get("event")))
    if cls is None or not _matches(record.get("t"), float):
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
