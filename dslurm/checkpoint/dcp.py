"""In-job checkpoints: torch.distributed.checkpoint under the pointer protocol of dslurm.checkpoint.

Imported only by code running inside the job (it imports torch); the CLI uses dslurm.checkpoint.

`CheckpointManager` is the facade a trainer calls; how a save is written is its tier's
(dslurm.checkpoint.tier: `DurableTier` straight to the run directory, `TwoTier` node-local first),
and what both share is the tier context (settings, control group, ledger, stager, the durable
commit). A save, on every rank: capture RNG and extra state, stage (async) or use the live
tensors (sync), write a new generation with DCP, its crc32s computed while writing
(dslurm.checkpoint.io: no re-read on the save path), gather them. Rank 0 then writes the
manifest, checks sizes, restore-tests (reads .metadata, loads the smallest tensor back), and only
then moves the pointer and prunes (dslurm.checkpoint.generation). The outcome is broadcast so
every rank logs it and applies `on_error` the same way. A restore checks each candidate while it
loads it: manifest, sizes and small files first, then the shards' crc32s from the bytes dcp.load
read (CrcReader; dslurm.checkpoint.coverage), agreed on rank 0; a mismatch loads the next candidate.
Collectives run on gloo groups of our own: the background thread's must never interleave with
training's (dcp.async_save on the default group crashes, ARCHITECTURE.md traps), and gloo moves
the small plan objects whatever the device.
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

from dslurm import checkpoint as ck
from dslurm import faults
from dslurm.checkpoint import fingerprint, per_rank, replay
from dslurm.checkpoint.core import Comm, Ledger, SaveOutcome, failure_hint, reason, to_state_dict
from dslurm.checkpoint.coverage import is_shard, verify_reads
from dslurm.checkpoint.durable_tier import DurableTier
from dslurm.checkpoint.generation import nonfinite_keys
from dslurm.checkpoint.io import CrcReader, SafeLoadPlanner, SafeReader
from dslurm.checkpoint.rng import apply_rng
from dslurm.checkpoint.staging import HostStager
from dslurm.checkpoint.tier import Context, Settings, Tier
from dslurm.checkpoint.twotier import TwoTier
from dslurm.errors import UserError
from dslurm.observe import events

if TYPE_CHECKING:
    from dslurm.config import CheckpointSpec

__all__ = ["CheckpointManager", "Ledger", "RestoreResult", "SaveOutcome", "TrainState", "failure_hint",
           "nonfinite_keys", "optimizer_state_dict"]

log = logging.getLogger(__name__)
# Single-process use (no process group) is deliberate here; DCP warns about it on every call.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


# What Adam/AdamW hold before their first step (all zeros once lazily made): see optimizer_state_dict.
_FIRST_STEP_ZEROS = frozenset({"step", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"})


def _as_never_stepped(sd: Any) -> Any:
    """`sd` with every step counter and Adam moment of its state replaced by zeros (nested
    {"state": {fqn: {name: t}}} or flattened "state.<fqn>.<name>" keys; param groups kept)."""
    if not isinstance(sd, dict):
        return sd
    out = {}
    for k, v in sd.items():
        if str(k).startswith("param_groups"):
            out[k] = v
        elif isinstance(v, torch.Tensor) and str(k).rsplit(".", 1)[-1] in _FIRST_STEP_ZEROS:
            out[k] = torch.zeros_like(v)
        else:
            out[k] = _as_never_stepped(v)
    return out


def optimizer_state_dict(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         options: Any = None) -> dict[str, Any]:
    """`get_optimizer_state_dict`, exact for an optimizer that has not stepped yet (a save before
    the first step). DCP materializes an empty optimizer's state with a step of zero gradients at
    lr 0 (torch's `_init_optim_state`): parameters stay, but Adam's step counter becomes 1 (and
    with coupled weight decay its moments move), so a run resumed from that save -- and the live
    run itself -- would take its first real step with the bias correction of step 2. Here the
    saved state is the one a fresh optimizer builds at its first step (counters and moments 0:
    the same update, bit for bit) and the live optimizer is left empty, as it was."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    never_stepped = not optimizer.state
    sd = get_optimizer_state_dict(model, optimizer, options=options)
    if not never_stepped:
        return sd
    optimizer.state.clear()
    return _as_never_stepped(sd)  # type: ignore[no-any-return]


class TrainState(Stateful):
    """Model + optimizer (+ LR scheduler) through get_state_dict/set_state_dict, so FSDP2/TP
    DTensors are saved sharded and load into whatever layout the resumed job has."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 scheduler: Any | None = None):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict
        out: dict[str, Any] = {"model": get_model_state_dict(self.model)}
        if self.optimizer is not None:
            out["optim"] = optimizer_state_dict(self.model, self.optimizer)
        if self.scheduler is not None:
            out["scheduler"] = self.scheduler.state_dict()
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict
        optims = [self.optimizer] if self.optimizer is not None else []
        set_state_dict(self.model, optims, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict.get("optim", {}))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state_dict["scheduler"])


@dataclass
class RestoreResult:
    step: int
    generation: str
    path: Path
    fell_back: bool  # True: the pointer's target (or the pointer) was unusable; write a ledger event
    reason: str  # e.g. "LATEST -> step-..." or "fell back to ... because ...: crc32 ..."
    extra: dict[str, Any]  # the caller's non-tensor state as saved (sampler position, tokens seen)
    rng_restored: bool  # False when the world size changed (per-rank RNG streams cannot map)
    saved_world_size: int
    saved_layout: dict[str, Any]
    rejected: list[tuple[str, list[str]]] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)  # seconds: precheck, load, verify, total
    tier: str = "durable"  # "local": node-local copies (two tiers); "partner": some pulled from partner copies
    tier_reason: str = ""  # why that tier (two tiers)
    last_step: dict[str, Any] = field(default_factory=dict)  # the saved step's loss and grad norm (replay.last_step)
    suspect: str = ""  # why that record is suspect (replay.suspect), "" when it is not


class CheckpointManager:
    """Save/restore one run directory. Every method is collective: call it on every rank."""

    def __init__(self, run_dir: str | os.PathLike[str], *, keep: int = 2, keep_every: int | None = None,
                 async_mode: bool = False, on_inflight: str = "wait", on_error: str = "continue",
                 config_hash: str | None = None, model_shape: dict[str, Any] | None = None,
                 layout: dict[str, Any] | None = None, ledger: Ledger | None = None,
                 verify_on_restore: str = "full", io_threads: int = 1, scratch: str | None = None,
                 keep_local: int = 2, on_lag: str = "wait", overlap_staging: bool = True,
                 per_rank_state: list[per_rank.Entry] | None = None, partner: bool = False,
                 partner_mbps: float = 0.0, verify_resume: str = "fingerprint"):
        for name, value, allowed in (("on_inflight", on_inflight, ("wait", "skip")),
                                     ("on_error", on_error, ("continue", "stop")),
                                     ("verify_on_restore", verify_on_restore, ("full", "size")),
                                     ("verify_resume", verify_resume, replay.MODES)):
            if value not in allowed:
                raise UserError(f"CheckpointManager {name}={value!r}: use one of {allowed}")
        ck.plan_retention([], None, keep)  # validates keep >= 2 before anything is written
        self.run_dir, self.gdir = Path(run_dir), ck.generations_dir(run_dir)
        self.settings = Settings(keep=keep, keep_every=keep_every, async_mode=async_mode, on_inflight=on_inflight,
                                 on_error=on_error, verify_on_restore=verify_on_restore, io_threads=io_threads,
                                 verify_resume=verify_resume,
                                 overlap_staging=overlap_staging, config_hash=config_hash,
                                 model_shape=model_shape, layout=layout or {})
        on = dist.is_available() and dist.is_initialized()
        self._ctl = Comm.new(on)
        self.rank, self.world = self._ctl.rank, self._ctl.world
        self.ctx = Context(self.run_dir, self.settings, ledger, per_rank_state or [], self._ctl)
        self._lock = ck.RunDirLock(self.run_dir)
        err = None
        if self.rank == 0:
            try:
                self._lock.acquire()
            except ck.RunLocked as exc:
                err = str(exc)
        if err := self._ctl.bcast(err):
            raise ck.RunLocked(err)
        if self.rank == 0:  # what a killed process left (its reaper died with it); we own the run now
            self.ctx.reap(self.run_dir)
        self.tier: Tier
        if scratch is not None:  # node-local scratch first
            self.tier = TwoTier(self.ctx, scratch, keep_local, on_lag, partner, partner_mbps)
        else:
            self.tier = DurableTier(self.ctx)

    @classmethod
    def from_spec(cls, run_dir: str | os.PathLike[str], spec: CheckpointSpec, *, scratch: str | None = None,
                  ledger: Ledger | None = None, config_hash: str | None = None,
                  model_shape: dict[str, Any] | None = None, layout: dict[str, Any] | None = None,
                  per_rank_state: list[per_rank.Entry] | None = None, site_partner: bool = False) -> CheckpointManager:
        """The manager of a run from the job's `checkpoint` section as it is (retention, async,
        in-flight and error policies, tiers); `scratch`, the site's node-local storage, is used
        only when the spec says `tiers: two_tier`. What the spec does not hold is the caller's:
        the ledger, what a resume is checked against (config hash, model shape, layout), the
        per-rank state. Partner copies: the spec's `partner`, else the site's (`site_partner`).
        Collective: call on every rank."""
        two = spec.tiers == "two_tier"
        return cls(run_dir, keep=spec.keep, keep_every=spec.keep_every, async_mode=spec.async_save,
                   on_inflight=spec.on_inflight, on_error=spec.on_error,
                   scratch=scratch if two else None, keep_local=spec.keep_local, partner_mbps=spec.partner_mbps,
                   partner=two and (spec.partner if spec.partner is not None else site_partner),
                   on_lag=spec.on_lag, ledger=ledger, config_hash=config_hash, model_shape=model_shape,
                   layout=layout, per_rank_state=per_rank_state, verify_resume=spec.verify_resume)

    @property
    def last_outcome(self) -> SaveOutcome | None:
        """The last finished save's outcome (this rank's view; the same verdict on every rank)."""
        return self.ctx.last_outcome

    @property
    def _stager(self) -> HostStager | None:  # tests/integration/test_overlap_staging.py looks at it
        return self.ctx.stager

    # ------------------------------------------------------------ restore

    def restore(self, state: dict[str, Any], extra: dict[str, Any] | None = None,
                probe: Callable[[dict[str, Any]], float] | None = None) -> RestoreResult | None:
        """Load the pointer's generation (or a verified fallback) into `state`, resharding to the
        current layout; fill `extra` in place. None means a fresh start (truly nothing saved).
        `probe` (verify_resume: replay): given a candidate's saved `extra`, the probe loss of the
        state now loaded (collective, the same number on every rank); a candidate whose probe
        differs from the one its save recorded is refused (dslurm.checkpoint.replay)."""
        self.ctx.probe = probe
        try:
            return self._restore(state, extra)
        finally:
            self.ctx.probe = None

    def _restore(self, state: dict[str, Any], extra: dict[str, Any] | None) -> RestoreResult | None:
        self.wait()
        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        plan = self._ctl.bcast(ck.plan_restore(self.run_dir) if self.rank == 0 else None)
        tier, why, gdir, copies = "durable", "", self.gdir, {}
        try:  # each candidate is checked while it loads; a mismatch moves on to the next one
            pick = self.tier.restore_first(state, plan.pointer, phases)
            if pick is not None and pick.name is not None and pick.gdir is not None:
                tier, why, gdir, copies = pick.tier, pick.why, pick.gdir, pick.copies
                sel = ck.Selection(pick.name, ck.parse_step(pick.name) or 0, False, f"local tier: {why}")
            elif pick is not None:
                why = pick.why
                log.info("[rank %d] restoring from the durable tier: %s", self.rank, why)
            if tier == "durable":
                sel = ck.select_generation(plan, lambda name, crc: self._load_checked(name, crc, state, phases))
        except ck.CheckpointError as exc:
            log.error("[rank %d] checkpoint restore refused: %s", self.rank, exc)
            self.ctx.event(events.CkptRestoreFailed(run_dir=str(self.run_dir), reason=str(exc)))
            raise
        if sel.generation is None:
            log.info("[rank %d] %s: %s", self.rank, self.run_dir, sel.reason)
            self.ctx.event(events.CkptFreshStart(run_dir=str(self.run_dir), reason=sel.reason))
            return None
        for name, problems in sel.rejected:
            log.error("[rank %d] CHECKPOINT %s REJECTED: %s", self.rank, name, "; ".join(problems))
            if self.rank == 0:
                ck.mark_rejected(self.gdir / name, problems)
            tensor = next((fingerprint.tensor_of(p) for p in problems if fingerprint.tensor_of(p)), "")
            self.ctx.event(events.RestoreRejected(run_dir=str(self.run_dir), generation=name, copy="durable",
                                                  tensor=tensor, reason="; ".join(problems[:3])[:1000]))
        if sel.fell_back:
            log.error("[rank %d] CHECKPOINT FALLBACK: %s", self.rank, sel.reason)
        gen = gdir / sel.generation
        meta = json.loads((gen / ck.META).read_text())  # its crc32 was checked before the load
        rng_ok = meta["world_size"] == self.world
        if rng_ok:
            apply_rng(json.loads((gen / ck.RANKS / f"rank-{self.rank:05d}.json").read_text())["rng"])
        elif self.rank == 0:  # said once, and in the ledger (the report and doctor name it)
            log.warning("RNG STREAMS NOT RESTORED: world size %d -> %d; each rank's saved Python/numpy/torch/CUDA "
                        "streams have no meaning for another set of ranks, so dropout and sampling continue from "
                        "the script's own seeds (resume with %d ranks for the saved streams)", meta["world_size"],
                        self.world, meta["world_size"])
        if suspect := replay.suspect(meta):
            log.warning("[rank %d] %s: restoring a generation whose record is suspect: %s", self.rank,
                        sel.generation, suspect)
        for how in per_rank.restore(self.ctx.per_rank, gen, meta["world_size"], self.rank, self.world):
            log.info("[rank %d] per-rank state %s", self.rank, how)
        if extra is not None:
            extra.update(meta["extra"])
        phases["total"] = time.perf_counter() - t0
        res = RestoreResult(meta["step"], sel.generation, gen, sel.fell_back, sel.reason,
                            dict(meta["extra"]), rng_ok, meta["world_size"], meta["layout"], sel.rejected,
                            {k: round(v, 4) for k, v in phases.items()}, tier, why,
                            dict(meta.get("last_step") or {}), suspect)
        log.info("[rank %d] restored step %d from %s in %.2f s (%s)", self.rank, res.step, gen,
                 phases["total"], ", ".join(f"{k} {v:.3f} s" for k, v in phases.items() if k != "total"))
        kind = events.CkptFallback if sel.fell_back else events.CkptRestore
        self.ctx.event(kind(run_dir=str(self.run_dir), step=res.step, generation=res.generation,
                           reason=res.reason, rejected=[n for n, _ in sel.rejected], tier=tier, tier_reason=why,
                           rng_restored=rng_ok, saved_world_size=int(meta["world_size"]), copies=copies,
                           restore_s=round(phases["total"], 4), last_step=res.last_step, suspect=suspect,
                           replay_s=round(phases["replay"], 4) if "replay" in phases else None))
        return res

    def _load_checked(self, name: str, pointer_crc: str | None, state: dict[str, Any],
                      phases: dict[str, float]) -> list[str]:
        """The verify callback of select_generation, with the load folded in: cheap checks first
        (manifest, sizes, small files), then dcp.load through CrcReader, then the shards' crc32s
        from what the ranks read. Problems (the same on every rank) reject the generation; the
        state may hold part of it then, and the next candidate's load overwrites all of it."""
        t = time.perf_counter()
        problems, entries = self._precheck(name, pointer_crc)
        phases["precheck"] = phases.get("precheck", 0.0) + time.perf_counter() - t
        if problems:
            return problems
        gen = self.gdir / name
        self.ctx.check_compat(json.loads((gen / ck.META).read_text()), state, gen)
        full = self.settings.verify_on_restore == "full"
        reader = CrcReader(gen, faults.durable_mbps())  # the knob emulates a loaded shared file system
        t, err = time.perf_counter(), None
        try:
            dcp.load(state, storage_reader=reader if full else SafeReader(gen), planner=SafeLoadPlanner(),
                     process_group=self._ctl.group, no_dist=self._ctl.group is None)
        except (Exception, CheckpointException) as exc:  # corrupt bytes may fail to unpickle
            err = reason(exc)
        phases["load"] = phases.get("load", 0.0) + time.perf_counter() - t
        t, reread = time.perf_counter(), 0
        if full:
            problems, reread = verify_reads(self._ctl, gen, entries, reader.sums)
        phases["verify"] = phases.get("verify", 0.0) + time.perf_counter() - t
        if not problems and not any(self._ctl.gather(err)):
            problems = self._fingerprint(gen, state, phases) or self.ctx.replay_problems(gen, phases)
        if reread:
            log.info("[rank %d] %s: %d bytes nobody's load read were read for their crc32", self.rank,
                     name, reread)
        errors = [e for e in self._ctl.gather(err) if e]
        if problems or not errors:
            return problems
        raise ck.CheckpointError(f"{gen}: dcp.load failed although its files match the manifest "
                                 f"({'crc32' if full else 'sizes'}): {errors[0]}")

    def _fingerprint(self, gen: Path, state: dict[str, Any], phases: dict[str, float]) -> list[str]:
        """Each rank's loaded tensors against the fingerprint it saved (dslurm.checkpoint.fingerprint);
        skipped after a reshard, where no rank holds what one saved."""
        meta = json.loads((gen / ck.META).read_text())
        if meta["world_size"] != self.world or meta["layout"] != self.settings.layout:
            return []
        t = time.perf_counter()
        local = fingerprint.check(gen / ck.RANKS / f"rank-{self.rank:05d}.json", to_state_dict(state))
        phases["fingerprint"] = phases.get("fingerprint", 0.0) + time.perf_counter() - t
        return sorted(f"rank {r}: {p}" if not p.startswith("tensor ") else p
                      for r, ps in enumerate(self._ctl.gather(local)) for p in ps)

    def _precheck(self, name: str, pointer_crc: str | None) -> tuple[list[str], dict[str, Any]]:
        """Manifest checks on rank 0; sizes of every file and crc32s of the small ones (not
        shards: those are checked while they load) split across ranks. -> (problems, entries)."""
        gen = self.gdir / name
        head = None
        if self.rank == 0:
            head = ck.manifest_problems(gen, pointer_crc)
            if not head[0]:  # a hostile .metadata is refused here, before DCP reads it
                head = (ck.metadata_problems(gen), head[1])
        problems, entries = self._ctl.bcast(head)
        if problems:
            return problems, entries
        mine = sorted(entries.items())[self.rank::self.world]
        full = self.settings.verify_on_restore == "full"
        local = ck.file_problems(gen, {n: e for n, e in mine if is_shard(n)}, full=False)
        local += ck.file_problems(gen, {n: e for n, e in mine if not is_shard(n)}, full=full)
        return sorted(p for ps in self._ctl.gather(local) for p in ps), entries

    # ------------------------------------------------------------ save

    def save(self, step: int, state: dict[str, Any], extra: dict[str, Any] | None = None, *,
             blocking: bool = False, files: Path | None = None, loss: float | None = None,
             grad_norm: float | None = None, probe: float | None = None) -> bool:
        """Start (async) or do (sync, or blocking=True for signal saves) a save of `state` at `step`.
        Returns False when skipped (on_inflight="skip", or two tiers' on_lag) or, for sync saves,
        when it failed. `files`: a finished folder of this rank's (a library's own checkpoint,
        written under `generations/.incoming` on the same file system) moved into the generation
        as `files/` before it commits: listed in its manifest with crc32s, verified on restore,
        collected with it. Durable tier only: two tiers would commit it on one node's scratch.
        `loss`, `grad_norm`: the saved step's, recorded (dslurm.checkpoint.replay.last_step);
        `probe`: the state's probe loss for verify_resume: replay (the number `restore`'s probe
        computes from the `extra` saved here)."""
        if files is not None and self.tier.kind != "durable":
            raise UserError(f"checkpoint.tiers: {self.tier.kind}: a library's own checkpoint folder ({files.name}) "
                            "is committed straight into the run directory. Fix: set checkpoint.tiers: durable "
                            "for this job")
        self.ctx.attach = files
        self.ctx.stamp = {}  # what meta.json records about the saved step (dslurm.checkpoint.replay)
        if loss is not None or grad_norm is not None:
            self.ctx.stamp["last_step"] = replay.last_step(loss, grad_norm)
        if probe is not None:
            self.ctx.stamp["replay"] = replay.probe_record(probe)
        try:
            return self.tier.save(step, state, extra or {}, blocking)
        finally:
            # a save skipped before its generation existed leaves its folder to the caller
            self.ctx.attach, self.ctx.stamp = None, {}

    def wait(self) -> None:
        """Block until the saves in flight (if any) are committed or failed; apply on_error."""
        self.tier.wait()

    def stage(self, sd: dict[str, Any], state: dict[str, Any]) -> Any:
        """Start the host copy of `sd` (the state dict of `state`): once the future is done,
        training may change the live tensors; the next optimizer step waits for that."""
        return self.ctx.stage(sd, state)

    def fence(self) -> None:
        """Wait for the host copy of the save in flight. Torch optimizers' steps do this by
        themselves; call it before changing the saved state any other way."""
        if self.ctx.stager is not None:
            self.ctx.stager.fence()

    def take_blocked(self) -> float:
        """Seconds training waited at the fence since the last call (part of a save's stall)."""
        return self.ctx.stager.take_blocked() if self.ctx.stager is not None else 0.0

    def close(self) -> None:
        """Finish the saves in flight, then the trash deletion (joined without a bound: see
        tier.Context.close), then release the run lock."""
        try:
            self.wait()
        finally:
            self.ctx.close()
            if self.rank == 0:
                self._lock.release()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def failure(self, out: SaveOutcome) -> ck.SaveFailed:
        """The error a caller raises when a save it needs (the final one, a stop's) failed."""
        return self.ctx.failure(out)
