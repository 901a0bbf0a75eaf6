"""The job's half of the config tree: `JobSpec` (what to run, on how many nodes, with which
entry) and the sections about running it: health during the run, the burn-in switch, recovery
inside the allocation, requeue overrides, experiment trackers.

The trainer's sections (model, parallel, train, data, checkpoint) are in dslurm/config/training.py.
`dslurm.config.load_job` (dslurm/config/__init__.py) reads a job file into a `JobSpec` and checks
what needs the whole job (the time limit, the model's shape); every other module imports these
names from `dslurm.config`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from dslurm.config.envvars import check_env
from dslurm.config.schema import FieldError, field
from dslurm.config.training import CheckpointSpec, DataSpec, ModelSpec, ParallelSpec, TrainSpec


@dataclass(kw_only=True, slots=True)
class HealthSpec:
    watchdog: bool = field(True, help="hang watchdog in every training process (dslurm/health/__init__.py)")
    hang_k: float = field(10.0, help="a step without progress for hang_k x the median step time is a hang")
    hang_floor_s: float = field(120.0, help="the hang bound is never below this (seconds)")
    hang_ceiling_s: float = field(1800.0, help="the hang bound before step times are known and during saves; "
                                  "the process-group timeout is this + 60 s")
    sdc_every: int = field(50, help="steps between silent-data-corruption checks of the HSDP replicas "
                           "(also before every save); 0 = off; needs parallel.dp_replicate > 1")
    sdc_max: int = field(2, help="corruptions rolled back per start; the next one ends the start as a crash "
                         "(the requeue then excludes the blocklisted node)")
    device_poll_every: int = field(50, help="steps between NVML polls (temperature, throttling, new ECC/Xid); "
                                   "0 = off; a no-op without NVML")
    profile_at: int = field(0, help="profile steps profile_at..profile_at+profile_steps-1 (1-based) of each start "
                            "with torch.profiler on every rank (train/profile.py); 0 = off")
    profile_steps: int = field(3, help="steps per profile (also what `dslurm ctl RUN profile` takes without --steps)")

    def __post_init__(self) -> None:
        if self.profile_steps < 1:
            raise FieldError("profile_steps", f"{self.profile_steps} must be at least 1",
                             "set health.profile_steps to e.g. 3")
        for name in ("sdc_every", "sdc_max", "device_poll_every", "profile_at"):
            if getattr(self, name) < 0:
                raise FieldError(name, f"{getattr(self, name)} must not be negative",
                                 f"set health.{name} to 0 (off) or more")
        if self.hang_k < 1:
            raise FieldError("hang_k", f"{self.hang_k} must be at least 1", "set health.hang_k to e.g. 10")
        if not 0 < self.hang_floor_s <= self.hang_ceiling_s:
            raise FieldError(("hang_floor_s", "hang_ceiling_s"),
                             f"need 0 < hang_floor_s({self.hang_floor_s}) <= hang_ceiling_s({self.hang_ceiling_s})",
                             "set health.hang_floor_s below health.hang_ceiling_s")


@dataclass(kw_only=True, slots=True)
class PreflightSpec:
    enabled: bool = field(True, help="run the burn-in before training")


@dataclass(kw_only=True, slots=True)
class RecoverySpec:
    warm: bool | Literal["auto"] = field(
        "auto", help="with spares: keep a preloaded worker pool on every allocated node, so an attempt after a "
        "failure forks its workers instead of importing torch again (docs/recovery.md); auto = where the site "
        "proved it (its recovery.warm, or a passed `dslurm site check` warm row), true = always, false = every "
        "attempt starts cold")
    replicas: bool = field(
        False, help="fault-tolerant replica groups (torchft): each parallel.dp_replicate group is its own job step "
        "and torchrun world; across groups the gradients are averaged through torchft's managed process group, a "
        "lost group drops out of the quorum at the next step while the others train on, and a restarted group "
        "heals from a live peer (docs/recovery.md)")
    replicas_min: int = field(
        1, help="with replicas: the fewest groups that may train a step; below it no step commits (the survivors "
        "stop with an agreed save, as for a stop signal, and the job is requeued)")
    replica_timeout_s: float = field(
        2.0, help="with replicas: how long a survivor waits on a silent group before it trains on without it -- "
        "the Lighthouse's heartbeat timeout (torchft's managers heartbeat every 100 ms from their own thread) and "
        "the bound of every wait inside the groups' gradient all-reduce (a hung group keeps its sockets open); "
        "the survivors lose about this long per fault. It must exceed the groups' skew in reaching the "
        "all-reduce and a heal's transfer, or a step is discarded and trained again (docs/recovery.md)")


@dataclass(kw_only=True, slots=True)
class RequeueSpec:
    enabled: bool | None = field(None, help="requeue on preemption/time limit; null = the site's policy")
    signal_lead: int | Literal["auto"] | None = field(
        None, help="seconds of warning before the time limit, or 'auto'; null = the site's")
    max_restarts: int | None = field(None, help="restart budget; null = the site's")
    no_progress_limit: int | None = field(None, help="starts without progress before giving up")
    max_stray_stops: int | None = field(None, help="requeues after stray stops (a TERM that reached only the "
                                                   "job step); null = the site's")

    def __post_init__(self) -> None:
        if isinstance(self.signal_lead, int) and self.signal_lead < 1:
            raise FieldError("signal_lead", f"{self.signal_lead} seconds gives the job no warning before the time "
                             "limit (it is killed mid-step, nothing saved)",
                             "give the seconds a step plus a save need (e.g. 120), or auto")
        for name in ("max_restarts", "no_progress_limit", "max_stray_stops"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise FieldError(name, f"{getattr(self, name)} must not be negative",
                                 "give 0 (none) or more, or remove it for the site's")


@dataclass(kw_only=True, slots=True)
class MetricsSpec:
    trackers: list[Literal["tensorboard", "wandb", "mlflow"]] = field(
        factory=list, help="experiment trackers rank 0 writes from the ledger's numbers (docs/trackers.md)")
    mlflow_uri: str | None = field(None, help="MLflow tracking URI; null = a file store in the run directory "
                                   "(or MLFLOW_TRACKING_URI from your environment)")
    wandb_project: str | None = field(None, help="W&B project; null = the job's name")
    wandb_mode: Literal["offline", "online"] | None = field(
        None, help="W&B mode; null = WANDB_MODE from your environment, else offline")
    tracker_timeout_s: float = field(
        30.0, help="seconds a tracker's open, log or annotation may go unanswered; then it is a tracker_failed "
        "and off for the rest of the start (training never waits for it)")
    tracker_close_s: float = field(
        10.0, help="seconds the end of a start waits for the trackers to send what is queued and close "
        "(keep it inside the site's KillWait)")

    def __post_init__(self) -> None:
        for name in ("tracker_timeout_s", "tracker_close_s"):
            if not 0 < getattr(self, name) <= 3600:
                raise FieldError(name, f"{getattr(self, name)} is not in (0, 3600] seconds", "give a positive bound")
        if len(set(self.trackers)) != len(self.trackers):
            raise FieldError("trackers", f"{self.trackers} names a tracker twice", "list each tracker once")
        if self.mlflow_uri is not None and not self.mlflow_uri.strip():
            raise FieldError("mlflow_uri", "is empty", "remove it (a file store in the run directory) or give a URI")


REPLICA_TIMEOUT_S = (0.5, 600.0)
"""recovery.replica_timeout_s's range: 5 of the managers' 100 ms heartbeats at least (fewer, and a
scheduling hiccup drops a live group), 10 minutes at most"""
_DEPENDENCY = r"[a-z]+(:[0-9_+]+)+([,?][a-z]+(:[0-9_+]+)+)*|singleton"  # e.g. afterany:12:13,afterok:14


@dataclass(kw_only=True, slots=True)
class JobSpec:
    name: str = field(help="job name (letters, digits, - _ . only)")
    nodes: int = field(help="whole nodes to allocate")
    time: str | None = field(None, help="time limit, Slurm format (MM, HH:MM:SS, D-HH:MM...)")
    procs_per_node: int | None = field(None, help="override the site's processes per node")
    launch: Literal["torchrun", "srun"] = field(
        "torchrun", help="torchrun: one task per node; srun: one task per process")
    entry: str | list[str] = field(
        "train", help="what every training process runs. A module name (train, dslurm.launch.probe): "
        "python -m ENTRY --site S --job J. Your own script with its arguments: [my_train.py, --lr, '3e-4'] "
        "(or [-m, my.module, ...]), run as given, without dslurm's arguments; dslurm.runtime finds the "
        "frozen config through DSLURM_RUN_DIR")
    model: ModelSpec = field(factory=ModelSpec, help="model shape")
    parallel: ParallelSpec = field(factory=ParallelSpec, help="parallel degrees")
    train: TrainSpec = field(factory=TrainSpec, help="optimisation")
    data: DataSpec = field(factory=DataSpec, help="data")
    checkpoint: CheckpointSpec = field(factory=CheckpointSpec, help="checkpoints")
    preflight: PreflightSpec = field(factory=PreflightSpec, help="pre-flight burn-in")
    health: HealthSpec = field(factory=HealthSpec, help="health during the run: hang watchdog, SDC check, device poll")
    requeue: RequeueSpec = field(factory=RequeueSpec, help="requeue")
    recovery: RecoverySpec = field(factory=RecoverySpec, help="recovery inside the allocation (jobs with spares)")
    metrics: MetricsSpec = field(factory=MetricsSpec, help="experiment trackers (TensorBoard, W&B, MLflow)")
    dependency: str | None = field(None, help="Slurm dependency, e.g. afterany:1234")
    env: dict[str, str] = field(factory=dict, help="extra environment for this job (SLURM_*, dslurm's own DSLURM_* "
                                "and what the launcher sets, RANK, MASTER_ADDR, ..., are refused)")
    spares: int = field(0, help="spare whole nodes allocated beyond `nodes` (with --no-kill): a failed "
                        "node is swapped for one inside the allocation, without the queue (docs/recovery.md)")
    on_spares_exhausted: Literal["requeue", "shrink"] = field(
        "requeue", help="a node fails and no spare is left: requeue without the bad node, or shrink: go on "
        "with fewer nodes, a smaller data-parallel degree and the same global batch (gradient accumulation)")

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", self.name):
            raise FieldError("name", f"{self.name!r} may only hold letters, digits, '-', '_' and '.' (max 64, "
                             "no spaces, quotes or newlines) because it names files and Slurm jobs",
                             "rename the job, e.g. llama8b-run1")
        if self.nodes < 1:
            raise FieldError("nodes", f"nodes={self.nodes} must be at least 1", "set nodes: 1 or more")
        if self.spares < 0:
            raise FieldError("spares", f"spares={self.spares} must not be negative",
                             "set spares: 0 (no spare nodes) or more")
        _check_entry(self.entry)
        self._check_replicas()
        if self.launch == "srun" and not self.builtin_entry and self.preflight.enabled:
            raise FieldError(("entry", "launch", "preflight"), "a script entry gets its burn-in from a torchrun "
                             "wrapper (dslurm.launch.gate), which srun mode does not have",
                             "use launch: torchrun, or set preflight.enabled: false")
        if self.procs_per_node is not None and self.procs_per_node < 1:
            raise FieldError("procs_per_node", f"{self.procs_per_node} must be at least 1",
                             "set procs_per_node: 1 or more, or remove it (the site's)")
        if self.dependency is not None and not re.fullmatch(_DEPENDENCY, self.dependency):
            raise FieldError("dependency", f"{self.dependency!r} is not a Slurm dependency",
                             "write it as Slurm does, e.g. afterany:1234 or afterok:12:13")
        check_env(self.env)

    def _check_replicas(self) -> None:
        """recovery.replicas: the dp_replicate groups are whole nodes each, run by the built-in trainer."""
        rec, groups = self.recovery, self.parallel.dp_replicate
        if not 1 <= rec.replicas_min <= max(groups, 1):
            raise FieldError(("recovery.replicas_min", "parallel.dp_replicate"),
                             f"replicas_min={rec.replicas_min} is not in 1..dp_replicate({groups})",
                             "set recovery.replicas_min between 1 and parallel.dp_replicate")
        if not REPLICA_TIMEOUT_S[0] <= rec.replica_timeout_s <= REPLICA_TIMEOUT_S[1]:
            raise FieldError("recovery.replica_timeout_s", f"replica_timeout_s={rec.replica_timeout_s} is not in "
                             f"{REPLICA_TIMEOUT_S[0]}..{REPLICA_TIMEOUT_S[1]} s",
                             "set recovery.replica_timeout_s to a few of the managers' 100 ms heartbeats or more "
                             "(default 2.0), and at most 600")
        if not rec.replicas:
            return
        if groups < 2:
            raise FieldError(("recovery.replicas", "parallel.dp_replicate"), f"dp_replicate={groups}: replica "
                             "groups need at least 2", "set parallel.dp_replicate: 2 or more (one group per node "
                             "or per few nodes)")
        if self.nodes % groups:
            raise FieldError(("recovery.replicas", "nodes"), f"nodes={self.nodes} do not split into "
                             f"dp_replicate={groups} groups of whole nodes",
                             f"set nodes to a multiple of {groups}")
        if not self.builtin_entry or self.launch != "torchrun":
            raise FieldError(("recovery.replicas", "entry", "launch"), "replica groups are the built-in "
                             "trainer's (-m train under torchrun)", "use entry: train and launch: torchrun")

    @property
    def builtin_entry(self) -> bool:
        """A module given as a string: a dslurm entry, which takes --site/--job."""
        return isinstance(self.entry, str) and not self.entry.endswith(".py")

    @property
    def entry_argv(self) -> list[str]:
        """What follows the interpreter: `-m MODULE`, or the script entry's words as given."""
        if isinstance(self.entry, str):
            return [self.entry] if self.entry.endswith(".py") else ["-m", self.entry]
        return list(self.entry)


_MODULE = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"


def _check_entry(entry: str | list[str]) -> None:
    """A module name, a script path ending in .py, or a list: [SCRIPT.py, ARGS...] or
    [-m, MODULE, ARGS...]. Every word one line (it is quoted into the script). Pure."""
    words = [entry] if isinstance(entry, str) else entry
    for i, w in enumerate(words):
        if any(c in w for c in "\n\r\0"):
            raise FieldError("entry", f"item {i} {w!r} holds a newline or NUL", "write each argument on one line")
    if isinstance(entry, str):
        if entry.endswith(".py") or re.fullmatch(_MODULE, entry):
            return
        raise FieldError("entry", f"{entry!r} is neither a Python module name nor a script path ending in .py",
                         "name a module like train, or give your script: entry: [my_train.py, --lr, '3e-4']")
    if not entry:
        raise FieldError("entry", "the list is empty", "give the script and its arguments: [my_train.py, --lr, '3e-4']")
    head = entry[0]
    if head == "-m":
        if len(entry) < 2 or not re.fullmatch(_MODULE, entry[1]):
            raise FieldError("entry", f"{entry[1:2]!r} after -m is not a Python module name",
                             "write [-m, my.module, ARGS...]")
    elif not head.endswith(".py") or head.startswith("-"):
        raise FieldError("entry", f"the first item {head!r} is not a script path ending in .py",
                         "start the list with your script, e.g. [my_train.py, --lr, '3e-4'], or with -m MODULE")

