"""The checkpoint events: what a start restored (or why it started fresh), each save and how it
went (committed, locally committed, skipped, failed), and `model.init_from`'s load at a fresh start.

Producers: dslurm/checkpoint/ (the manager, its tiers, init_from); readers: report (save stalls,
lost work), observe.durability (durable lag, RPO), doctor. The catalogue and the reading rules
are in dslurm/observe/events/__init__.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dslurm.observe.events.base import Event


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
    """"local" (node-local copies, same nodes and layout), "partner" (some ranks pulled theirs from
    partner copies over the network) or "durable" (the run dir)"""
    tier_reason: str = ""
    """why that tier: the local candidate used, or why no local generation qualified"""
    rng_restored: bool | None = None
    """False: the world size changed, so the ranks' saved RNG streams (Python, numpy, torch, CUDA)
    were not restored: dropout and sampling start from the script's seeds (None: older ledgers)"""
    saved_world_size: int | None = None
    """the world size the generation was saved with"""
    copies: dict[str, list[int]] = field(default_factory=dict)
    """node-local restores: the ranks that loaded each copy, {"local": [...], "partner": [...]}"""
    restore_s: float | None = None
    """seconds from the restore's start to the state loaded and checked (partner pulls included)"""
    last_step: dict[str, float | str | None] = field(default_factory=dict)
    """the saved step's loss and grad norm as recorded at the save (non-finite ones as strings)"""
    suspect: str = ""
    """why that record is suspect (a non-finite loss or grad norm), empty when it is not"""
    replay_s: float | None = None
    """verify_resume: replay: seconds the probe loss took (every candidate tried)"""


@dataclass(frozen=True, kw_only=True)
class CkptFallback(CkptRestore):
    """A restore that skipped the pointer's generation (rejected or garbage pointer)."""
    NAME = "ckpt_fallback"


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
    last_step: dict[str, float | str | None] = field(default_factory=dict)
    """the saved step's loss and grad norm, as recorded in the generation (dslurm.checkpoint.replay)"""
    probe_loss: float | str | None = None
    """verify_resume: replay: the probe loss recorded with the generation"""


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
class CkptPartnerCommit(Event):
    """Two tiers with partner copies: each node's locally committed shards also reached the next
    node's local tier (or did not: ok false and why). From then on a generation survives the
    loss of any one node at local speed, whatever the durable copy's state."""
    NAME = "ckpt_partner_commit"
    run_dir: str | None = None
    step: int | None = None
    generation: str | None = None
    ok: bool = True
    bytes: int = 0
    """bytes every rank sent, summed"""
    partner_s: float = 0.0
    """from the local commit to the partner commit"""
    mb_per_s: float = 0.0
    """the slowest rank's send rate"""
    reason: str = ""


@dataclass(frozen=True, kw_only=True)
class RestoreRejected(Event):
    """A restore refused one copy of a generation before the first step (a crc32 or the state's
    fingerprint disagreed) and went on to the next copy: own local, partner, durable, then the
    previous generation. The copy is withdrawn, so no later start tries it again."""
    NAME = "restore_rejected"
    run_dir: str | None = None
    generation: str | None = None
    copy: str = ""
    """local, partner or durable"""
    node: str = ""
    """the node holding the copy (partner: the holder; durable: empty)"""
    ranks: list[int] = field(default_factory=list)
    tensor: str = ""
    """the first tensor whose fingerprint disagreed (empty when a file's crc32 did)"""
    reason: str = ""


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
