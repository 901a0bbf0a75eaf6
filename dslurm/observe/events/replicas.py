"""The events of replica groups (`recovery.replicas`, docs/recovery.md): a group lost and its
step started again (written by `dslurm supervise`, dslurm/recover/replicas.py), a group healed
from a live peer, each group's participants per step and its end (written by rank 0 of each
group, train/replicas.py). Every group writes its own; `group` says whose."""

from __future__ import annotations

from dataclasses import dataclass, field

from dslurm.observe.events.base import Event


@dataclass(frozen=True, kw_only=True)
class ReplicaLost(Event):
    """A replica group's job step ended in a failure while other groups trained on."""
    NAME = "replica_lost"
    group: int = 0
    step: int | None = None
    """the last step the group began (its own record), None when it began none"""
    cause: str = ""
    """the ending's class from the group's facts: crash, node_failure, hang, ..."""
    reason: str = ""
    hosts: list[str] = field(default_factory=list)
    """the group's nodes"""
    next_hosts: list[str] = field(default_factory=list)
    """where the group's step starts again (the same nodes, a spare); empty: it stays out"""
    failed_t: float | None = None


@dataclass(frozen=True, kw_only=True)
class ReplicaHealed(Event):
    """A restarted group took the live weights, optimizer and data state from a peer through
    torchft's transport (never from disk) and joined the quorum."""
    NAME = "replica_healed"
    group: int = 0
    step: int = 0
    """the step it joined at (the peers' committed step)"""
    heal_s: float = 0.0
    """seconds of the quorum that healed it: the state's transfer and its load"""
    bytes: int = 0
    """bytes this rank received (the group's rank 0; every rank of the group takes its own shard)"""
    peer: str = ""
    """the address the state came from (the peer group's checkpoint server)"""
    peer_replica_rank: int | None = None
    missed_steps: int | None = None
    """steps the group did not train (from the step it was lost at to this one)"""
    missed_samples: int | None = None
    """the samples of those steps that were the group's: counted, not trained"""


@dataclass(frozen=True, kw_only=True)
class ReplicaSteps(Event):
    """One group's steps `first`..`first + len(participants) - 1` (1-based): how many groups
    took part in each committed step, and the steps it discarded (the commit protocol)."""
    NAME = "replica_steps"
    group: int = 0
    first: int = 0
    participants: list[int] = field(default_factory=list)
    discarded: int = 0
    """attempts of a step that did not commit (a peer failed during it): trained again"""


@dataclass(frozen=True, kw_only=True)
class ReplicaEnd(Event):
    """A group's last word: the step it ended at and a digest of its parameters (the groups must
    agree: the commit protocol keeps them identical)."""
    NAME = "replica_end"
    group: int = 0
    step: int = 0
    params_crc: str = ""
    code: int = 0
