"""Checkpoint tiers as a strategy (in-job; imports torch): the one interface the manager talks to,
and the context a tier is given.

`CheckpointManager` (dslurm.checkpoint.dcp) owns a `Context` and one `Tier`: `DurableTier`
(dslurm.checkpoint.durable_tier: every save straight to the run directory, sync or async) or
`TwoTier` (dslurm.checkpoint.twotier: node-local scratch first, then copied). A tier decides how a
save is written and whether a restore has a faster source than the durable pointer; everything
both need -- the run directory, the control group, the settings, the ledger, the host stager,
the durable commit, reporting an outcome -- is the context's, in public names, so that no tier
reaches into the manager or another tier.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

import dslurm
from dslurm import checkpoint as ck
from dslurm.checkpoint import per_rank, replay
from dslurm.checkpoint.core import Comm, Job, Ledger, SaveOutcome, failure_hint, reason, to_state_dict
from dslurm.checkpoint.generation import commit_generation
from dslurm.checkpoint.io import SafeReader
from dslurm.checkpoint.rng import capture_rng
from dslurm.checkpoint.staging import HostStager, forward_written
from dslurm.errors import UserError
from dslurm.observe import events

log = logging.getLogger(__name__)


@dataclass
class LocalPick:
    """What a tier's own restore found: the generation it loaded (None: none of its own fit),
    where, why, and the ones it rejected on the way."""

    name: str | None
    gdir: Path | None
    why: str
    rejected: list[tuple[str, list[str]]] = field(default_factory=list)
    copies: dict[str, list[int]] = field(default_factory=dict)  # "local"/"partner" -> the ranks that loaded it
    tier: str = "local"  # "partner" when some rank's copy was pulled from its partner


class Tier(Protocol):
    """How saves are written and what a restore tries before the durable pointer. Every method
    is collective, like the manager's."""

    kind: str  # "durable" | "two_tier"

    def save(self, step: int, state: dict[str, Any], extra: dict[str, Any], blocking: bool) -> bool: ...

    def wait(self) -> None: ...

    def restore_first(self, state: dict[str, Any], pointer: ck.Pointer | None,
                      phases: dict[str, float]) -> LocalPick | None: ...


@dataclass
class Settings:
    """The manager's settings that tiers read (validated by the manager)."""

    keep: int = 2
    keep_every: int | None = None
    async_mode: bool = False
    on_inflight: str = "wait"
    on_error: str = "continue"
    verify_on_restore: str = "full"
    verify_resume: str = "fingerprint"  # dslurm.checkpoint.replay.MODES
    io_threads: int = 1
    overlap_staging: bool = True
    config_hash: str | None = None
    model_shape: dict[str, Any] | None = None
    layout: dict[str, Any] = field(default_factory=dict)


class Context:
    """What a tier shares with the manager (collective where it says so)."""

    def __init__(self, run_dir: Path, settings: Settings, ledger: Ledger | None,
                 per_rank_state: list[per_rank.Entry], comm: Comm) -> None:
        self.run_dir, self.gdir = run_dir, ck.generations_dir(run_dir)
        self.settings, self.ledger, self.per_rank, self.comm = settings, ledger, per_rank_state, comm
        self.rank, self.world = comm.rank, comm.world
        self.last_outcome: SaveOutcome | None = None
        self.stager: HostStager | None = None
        # Threads deleting trash (old generations' bytes), joined by close(): the trainer leaves
        # through os._exit right after close(), which would kill a daemon thread mid-delete.
        self.reapers: list[threading.Thread] = []
        self.attach: Path | None = None  # the next save's folder to move in (CheckpointManager.save files=)
        self.stamp: dict[str, Any] = {}  # the next save's last_step / replay records (CheckpointManager.save)
        self.stamped: dict[str, dict[str, Any]] = {}  # generation -> its records, until its ckpt_save (finish)
        self.probe: Callable[[dict[str, Any]], float] | None = None  # during a restore (CheckpointManager.restore)
        self._saves = 0

    # ------------------------------------------------------------ a save's life

    def new_job(self, step: int, extra: dict[str, Any]) -> Job:
        """Collective: the generation's name from rank 0, this rank's RNG and per-rank state."""
        t0 = time.perf_counter()
        try:
            extra = json.loads(json.dumps(extra))  # a snapshot: the caller keeps mutating theirs
        except (TypeError, ValueError) as exc:
            raise UserError(f"checkpoint extra state must be JSON-serialisable: {exc}") from None
        self._saves += 1
        s = self.settings
        name = self.comm.bcast(ck.generation_name(step) if self.rank == 0 else None)
        meta = {"format": ck.FORMAT, "generation": name, "step": step, "extra": extra,
                "world_size": self.world, "layout": s.layout, "config_hash": s.config_hash,
                "model_shape": s.model_shape, "torch_version": torch.__version__,
                "dslurm_version": dslurm.__version__, "saved_by": ck.holder_identity(),
                "per_rank": [e.name for e in self.per_rank]}
        meta.update(self.stamp)
        if self.stamp:
            self.stamped[name] = self.stamp
        files, self.attach, self.stamp = self.attach, None, {}
        return Job(name, step, self._saves, meta, capture_rng(), t0, state=per_rank.capture(self.per_rank),
                   files=files)

    def stage(self, sd: dict[str, Any], state: dict[str, Any]) -> Any:
        """Start the host copy of `sd` (the state dict of `state`): a future of the copy."""
        if self.stager is None:
            self.stager = HostStager(self.settings.overlap_staging)
        return self.stager.stage(sd, forward_written(state))

    def take_blocked(self) -> float:
        """Seconds training waited at the fence since the last call (part of a save's stall)."""
        return self.stager.take_blocked() if self.stager is not None else 0.0

    def commit(self, gen: Path, job: Job, results: list[Any]) -> tuple[bool, str, int]:
        """Rank 0: the durable commit of `gen` in the run directory (generation.commit_generation)."""
        s = self.settings
        return commit_generation(self.run_dir, gen, job, results, s.keep, s.keep_every, self.reap)

    def finish(self, out: SaveOutcome) -> None:
        """Log a finished save and write its ledger event; a failure under on_error=stop raises."""
        self.last_outcome = out
        stamp = self.stamped.pop(out.generation, {})
        if out.ok:
            log.info("[rank %d] checkpoint step %d committed: %s, %.1f MB, training blocked %.3f s, "
                     "total %.2f s", self.rank, out.step, out.generation, out.bytes / 1e6,
                     out.stall_s, out.total_s)
            self.event(events.CkptSave(run_dir=str(self.run_dir), step=out.step, generation=out.generation,
                                       bytes=out.bytes, stall_s=round(out.stall_s, 4),
                                       total_s=round(out.total_s, 4), tier=out.tier,
                                       local_commit_t=out.local_commit_t, lag_s=out.lag_s,
                                       last_step=stamp.get("last_step") or {},
                                       probe_loss=(stamp.get("replay") or {}).get("probe_loss")))
            return
        log.error("[rank %d] checkpoint save at step %d FAILED, pointer unchanged (%s), on_error=%s: %s",
                  self.rank, out.step, self.pointer_desc(), self.settings.on_error, out.reason)
        self.event(events.CkptSaveFailed(run_dir=str(self.run_dir), step=out.step, generation=out.generation,
                                         reason=out.reason, policy=self.settings.on_error))
        if self.settings.on_error == "stop":
            raise self.failure(out)

    def skipped(self, step: int, why: str, text: str) -> bool:
        log.warning("[rank %d] step %d: save skipped, %s", self.rank, step, text)
        self.event(events.CkptSaveSkipped(run_dir=str(self.run_dir), step=step, reason=why))
        return False

    def failure(self, out: SaveOutcome) -> ck.SaveFailed:
        """The error a caller raises when a save it needs (the final one, a stop's) failed."""
        return ck.SaveFailed(f"checkpoint save at step {out.step} failed: {out.reason}. Fix: "
                             f"{failure_hint(out.reason, self.run_dir)}. The pointer still names "
                             f"{self.pointer_desc()}.")

    def pointer_desc(self) -> str:
        """What the pointer names now, for messages (a garbage pointer names nothing)."""
        try:
            ptr = ck.read_pointer(self.run_dir)
        except ck.CheckpointError:
            ptr = None
        return f"step {ptr.step} ({ptr.generation})" if ptr else "no generation"

    def event(self, ev: events.Event) -> None:
        if self.ledger is not None and self.rank == 0:
            self.ledger.append(ev)

    def reap(self, run_dir: Path) -> None:
        """Delete the trash of run_dir on a thread of its own: unlinking a generation's shards
        takes ~0.2 s per GB, after the pointer moved, nothing a stop's save need wait for.
        close() joins it."""
        self.reapers = [t for t in self.reapers if t.is_alive()]
        t = threading.Thread(target=ck.empty_trash, args=(run_dir,), name="dslurm-ckpt-reap", daemon=True)
        t.start()
        self.reapers.append(t)

    def close(self) -> None:
        """The stager's thread, then every reaper, without a bound: unlinking runs at ~0.2 s per
        GB, and trash left behind would hold a generation's bytes for good (or, after a requeue,
        during the next start's first save: ENOSPC with a quota sized for keep+1)."""
        if self.stager is not None:
            self.stager.close()
        for t in self.reapers:
            t.join()
        self.reapers.clear()

    # ------------------------------------------------------------ restore

    def check_compat(self, meta: dict[str, Any], state: dict[str, Any], gen: Path) -> None:
        """Refuse a generation whose model shape differs from the current one (naming the
        fields or tensors); log a config-hash change and a reshard."""
        s = self.settings
        if meta.get("model_shape") is not None and s.model_shape is not None:
            diffs = ck.field_differences(meta["model_shape"], s.model_shape)
        elif meta.get("config_hash") and s.config_hash and meta["config_hash"] != s.config_hash:
            # Without shape fields a changed hash may be a changed model: refuse, say how to relax.
            diffs = [f"config_hash: {meta['config_hash']} -> {s.config_hash} (pass model_shape= "
                     "so that only shape changes are refused)"]
        else:
            diffs = []
        diffs = diffs or _tensor_shape_diffs(state, gen)
        if diffs:
            raise ck.CheckpointError(
                f"{gen}: model shape changed since this generation was saved: {'; '.join(diffs[:10])}. "
                "Resume with the saved model config, or start a new run directory.")
        if meta.get("config_hash") != s.config_hash:
            log.warning("[rank %d] config hash %s -> %s (model shape unchanged): resuming",
                        self.rank, meta.get("config_hash"), s.config_hash)
        if meta["layout"] != s.layout or meta["world_size"] != self.world:
            log.info("[rank %d] resharding: saved layout %s on %d ranks -> %s on %d ranks", self.rank,
                     meta["layout"], meta["world_size"], s.layout, self.world)

    def replay_problems(self, gen: Path, phases: dict[str, float]) -> list[str]:
        """Collective, after a load whose files and fingerprints passed: with verify_resume:
        replay, the caller's probe loss of the restored state (on the batch the generation's data
        position fixes) against the one recorded at the save (dslurm.checkpoint.replay). One
        verdict for every rank: rank 0's number is judged (the probe is all-reduced, so every
        rank computed the same one). -> problems, the same on every rank."""
        if self.settings.verify_resume != "replay" or self.probe is None:
            return []
        meta = json.loads((gen / ck.META).read_text())
        t, err = time.perf_counter(), ""
        try:
            now = float(self.probe(meta["extra"]))
        except Exception as exc:  # a state that loads but cannot run is refused like one that runs wrong
            now, err = float("nan"), f"replay: the probe failed on rank {self.rank}: {reason(exc)}"
        phases["replay"] = phases.get("replay", 0.0) + time.perf_counter() - t
        errs = [e for e in self.comm.gather(err) if e]
        if errs:
            return errs[:1]
        now = self.comm.bcast(now)
        same = meta["world_size"] == self.world and meta["layout"] == self.settings.layout
        if meta.get("replay") is None:
            log.warning("[rank %d] %s: no probe loss recorded (saved without verify_resume: replay): only "
                        "checked finite (%r)", self.rank, gen.name, now)
        bad = replay.verdict(meta.get("replay"), now, same_layout=same)
        if not bad:
            log.info("[rank %d] %s: replay probe loss %r %s", self.rank, gen.name, now,
                     "matches the saved one" if meta.get("replay") else "is finite")
        return [bad] if bad else []


def _tensor_shape_diffs(state: dict[str, Any], gen: Path) -> list[str]:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    saved = SafeReader(gen).read_metadata().state_dict_metadata
    current, _ = flatten_state_dict(to_state_dict(state))
    diffs = []
    for key, value in current.items():
        if not isinstance(value, torch.Tensor):
            continue
        md = saved.get(key)
        if md is None:
            diffs.append(f"{key}: not in checkpoint")
        elif isinstance(md, TensorStorageMetadata) and tuple(md.size) != tuple(value.shape):
            diffs.append(f"{key}: {tuple(md.size)} -> {tuple(value.shape)}")
    return diffs


def thread_outcome(job: Job, run: Callable[[], SaveOutcome], tier: str = "durable") -> SaveOutcome:
    """Run a background save's body; never lose the reason in a thread (a dead peer, say)."""
    try:
        return run()
    except BaseException as exc:
        return SaveOutcome(job.name, job.step, False, reason(exc), tier=tier)
