"""The seeded fault schedule of a chaos soak. Pure: the same seed, minutes, spacing and kinds give
the same faults at the same offsets with the same targets, so a failing soak is replayed by its
seed (the job's own timing is not replayed: a fault lands on whatever step is running then).

Every kind is something an operator or a cluster does to a job from outside; none is a knob in
the trainer (dslurm/faults.py is not used). Targets are drawn as fractions and resolved against
what runs at the moment (the n-th live worker, the n-th training node), so a schedule holds no pid.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

# kind -> (what it is, hold range in seconds: how long the condition lasts; (0, 0): instant).
KINDS: dict[str, tuple[str, tuple[float, float]]] = {
    "kill_worker": ("kill -9 of one training process", (0.0, 0.0)),
    "stop_worker": ("SIGSTOP of one training process (never continued: the watchdog and teardown must end it)",
                    (0.0, 0.0)),
    "kill_node_step": ("kill -9 of every job-step process on one training node (the node's whole step)",
                       (0.0, 0.0)),
    "requeue": ("scontrol requeue JOB (an operator or a preemption)", (0.0, 0.0)),
    "usr2": ("scancel --signal=USR2 JOB (the job steps are warned)", (0.0, 0.0)),
    "time_limit": ("the time-limit warning: USR2 to the batch shell, as --signal=B:USR2@LEAD delivers it "
                   "(scancel --batch --signal=USR2)", (0.0, 0.0)),
    "ctld_restart": ("slurmctld stopped, down for a few seconds, started again", (3.0, 8.0)),
    "disk_full": ("the durable path (the run dir, a size-limited tmpfs) filled for a few seconds", (3.0, 8.0)),
    "spare_off": ("the spare node drained for a while, then resumed (spares off and on)", (5.0, 15.0)),
}
# Kinds that end a start through the run's own processes (they may spend the restart budget);
# every other kind is not the run's own failure and must never spend it.
OWN_FAILURES = ("kill_worker", "stop_worker", "kill_node_step")
DEFAULT_EVERY_S = 15.0
JITTER = 0.5  # each gap is every x U(1 - JITTER, 1 + JITTER)


@dataclass(frozen=True, slots=True)
class Fault:
    index: int
    at_s: float
    """seconds after the soak's first training step"""
    kind: str
    target: float
    """in [0, 1): which worker / node, resolved against the live ones when it is injected"""
    hold_s: float
    """how long the condition lasts (slurmctld down, disk full, spare drained); 0 for instant ones"""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_kinds(text: str | None, spares: bool) -> tuple[str, ...]:
    """'all' (default) or a comma list; ValueError names an unknown kind and lists the valid ones.
    Without spares there is no spare to turn off."""
    if not text or text == "all":
        kinds = tuple(KINDS)
    else:
        kinds = tuple(k.strip() for k in text.split(",") if k.strip())
        bad = [k for k in kinds if k not in KINDS]
        if bad or not kinds:
            raise ValueError(f"unknown fault kind(s) {bad or [text]}; valid: {', '.join(KINDS)}")
    return tuple(k for k in kinds if spares or k != "spare_off")


def draw(seed: int, minutes: float, every_s: float, kinds: tuple[str, ...]) -> list[Fault]:
    """The faults of a soak of `minutes`, one every `every_s` on average (jittered), kinds uniform."""
    if every_s <= 0 or minutes <= 0:
        raise ValueError(f"minutes ({minutes}) and every ({every_s}) must be positive")
    if not kinds:
        raise ValueError("no fault kind to draw from")
    rng = random.Random(seed)
    out: list[Fault] = []
    t = every_s * rng.uniform(1 - JITTER, 1 + JITTER)
    while t < minutes * 60:
        kind = rng.choice(kinds)
        lo, hi = KINDS[kind][1]
        out.append(Fault(index=len(out), at_s=round(t, 3), kind=kind, target=rng.random(),
                         hold_s=round(rng.uniform(lo, hi), 3) if hi else 0.0))
        t += every_s * rng.uniform(1 - JITTER, 1 + JITTER)
    return out


def pick(items: list[Any], target: float) -> Any:
    """The item a fault's target names among those live now."""
    return items[min(int(target * len(items)), len(items) - 1)]
