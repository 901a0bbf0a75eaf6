"""In-job checkpoints: torch.distributed.checkpoint under the pointer protocol of dslurm.checkpoint.

Imported only by code running inside the job (it imports torch); the CLI uses dslurm.checkpoint.

A save, on every rank: capture RNG and extra state, stage (async) or use the live tensors (sync),
write a new generation with DCP, its crc32s computed while writing (dslurm.checkpoint.io: no
re-read on the save path), gather them.
Rank 0 then writes the manifest, checks sizes, restore-tests (reads .metadata, loads the smallest
tensor back), and only then moves the pointer and prunes. The outcome is broadcast so every rank
logs it and applies `on_error` the same way. A restore checks each candidate while it loads it:
manifest, sizes and small files first, then the shards' crc32s from the bytes dcp.load read
(CrcReader; dslurm.checkpoint.coverage), agreed on rank 0; a mismatch loads the next candidate.
Collectives run on gloo groups of our own: the background thread's must never interleave with
training's (dcp.async_save on the default group crashes, ARCHITECTURE.md traps), and gloo moves
the small plan objects whatever the device.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful

import dslurm
from dslurm import checkpoint as ck
from dslurm import faults
from dslurm.checkpoint import per_rank
from dslurm.checkpoint.coverage import is_shard, verify_reads
from dslurm.checkpoint.io import CrcReader, crc_writer, restore_test
from dslurm.checkpoint.rng import apply_rng, capture_rng
from dslurm.checkpoint.staging import HostStager, forward_written
from dslurm.errors import UserError
from dslurm.observe import events

log = logging.getLogger(__name__)
# Single-process use (no process group) is deliberate here; DCP warns about it on every call.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class Ledger(Protocol):
    def append(self, ev: events.Event) -> Any: ...


class TrainState(Stateful):
    """Model + optimizer (+ LR scheduler) through get_state_dict/set_state_dict, so FSDP2/TP
    DTensors are saved sharded and load into whatever layout the resumed job has."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 scheduler: Any | None = None):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict
        optims = [self.optimizer] if self.optimizer is not None else []
        model_sd, optim_sd = get_state_dict(self.model, optims)
        out: dict[str, Any] = {"model": model_sd}
        if optims:
            out["optim"] = optim_sd
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
    tier: str = "durable"  # "local": node-local copies (two tiers, same nodes and layout)
    tier_reason: str = ""  # why that tier (two tiers)


@dataclass
class SaveOutcome:
    generation: str
    step: int
    ok: bool
    reason: str = ""
    bytes: int = 0
    stall_s: float = 0.0  # training blocked (state_dict + staging, or the whole sync save)
    total_s: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # rank 0: seconds since the save began
    tier: str = "durable"  # "two_tier": locally committed first, then copied (dslurm.checkpoint.twotier)
    durable: bool = True  # False: locally committed only (on_lag=skip_durable)
    local_s: float | None = None  # two tiers: seconds from the save's start to the local commit
    local_commit_t: float | None = None  # two tiers: unix time of the local commit
    lag_s: float | None = None  # two tiers: durable commit minus local commit


@dataclass
class _Job:
    name: str
    step: int
    nth: int
    meta: dict[str, Any]
    rng: dict[str, Any]
    t0: float
    phases: dict[str, float] = field(default_factory=dict)
    lag_wait_s: float = 0.0  # two tiers, on_lag=wait: training waited this long for the copier first
    state: dict[str, Any] = field(default_factory=dict)  # this rank's per-rank state (per_rank.capture)


class _Comm:
    """Object collectives on one group; a no-op world of one without torch.distributed."""

    def __init__(self, group: Any):
        self.group = group
        self.rank = dist.get_rank() if group is not None else 0
        self.world = dist.get_world_size() if group is not None else 1

    def bcast(self, obj: Any) -> Any:
        if self.group is None:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        if self.group is None:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out


def floating_tensors(sd: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """(key, this rank's part) of every floating tensor in a (nested) state dict; DTensors by
    their local shard."""
    out: list[tuple[str, torch.Tensor]] = []
    if isinstance(sd, dict):
        for k, v in sd.items():
            out += floating_tensors(v, f"{prefix}{k}.")
    elif isinstance(sd, (list, tuple)):
        for i, v in enumerate(sd):
            out += floating_tensors(v, f"{prefix}{i}.")
    elif isinstance(sd, torch.Tensor) and sd.is_floating_point():
        local = sd.to_local() if hasattr(sd, "to_local") else sd
        if local.numel():
            out.append((prefix.rstrip("."), local))
    return out


def nonfinite_keys(sd: Any) -> list[str]:
    """Keys of floating tensors in a (nested) state dict holding NaN/inf in this rank's part.
    A generation with non-finite parameters or optimizer state is never committed: resuming
    from it would only reproduce the divergence, and retention would delete the good ones."""
    return [key for key, t in floating_tensors(sd) if not _all_finite(t)]


def _all_finite(t: torch.Tensor) -> bool:
    """Whether every element is finite. A finite sum proves it (a NaN or an inf anywhere makes the
    sum NaN or inf) in one pass that allocates nothing, ~6x faster than `isfinite(t).all()` on a
    stop save's critical path; only a non-finite sum, which large finite values can also give by
    overflowing, is settled element by element. 16-bit types sum in fp32 (no overflow at any
    realistic size)."""
    try:
        total = t.sum(dtype=torch.float32 if t.element_size() < 4 else t.dtype)
        if bool(torch.isfinite(total)):
            return True
    except (RuntimeError, TypeError):  # a dtype sum does not support (fp8): the exact check
        pass
    return bool(torch.isfinite(t).all())


def failure_hint(reason: str, run_dir: Path) -> str:
    """What a person should do about a failed save, from its reason. Pure."""
    if "No space left" in reason or "ENOSPC" in reason or "Errno 28" in reason:
        return (f"the disk holding {run_dir} is full (ENOSPC): free space (e.g. `dslurm ckpt gc {run_dir}`) "
                "or point checkpoint.run_dir at a larger file system, then resubmit; it resumes from the pointer")
    if "non-finite" in reason:
        return ("the model or optimizer state is not finite (training diverged): lower train.lr or enable "
                "clipping, then resubmit; it resumes from the pointer's (finite) generation")
    return "see the reason above; the pointer still names the last verified generation"


def _reason(exc: BaseException) -> str:
    # DCP wraps per-rank failures (e.g. ENOSPC) in CheckpointException; name each rank's cause.
    if isinstance(exc, CheckpointException):
        causes = {r: (e[0] if isinstance(e, tuple) else e) for r, e in exc.failures.items()}
        return "; ".join(f"rank {r}: {_reason(e)}" for r, e in sorted(causes.items()))[:2000]
    return f"{type(exc).__name__}: {exc}"[:2000]


def _write_reason(exc: BaseException, path: Path) -> str:
    """The reason a write failed, with the disk's state when that is the cause."""
    reason, full = _reason(exc), ck.disk_full_fact(path)
    return f"{full}; {reason}" if full and "No space left" not in reason else reason


@functools.cache
def _side_pool() -> ThreadPoolExecutor:
    """The helper threads of `prepare_generation`, made on the first save of the process."""
    return ThreadPoolExecutor(2, thread_name_prefix="dslurm-ckpt-prep")


def prepare_generation(gen: Path, job: _Job, sd: dict[str, Any], rank: int, world: int, *,
                       leader: bool) -> tuple[str | None, Future[str | None]]:
    """A rank's part of a generation besides its shards: the directory now; its rank file (RNG,
    per-rank state), the metadata (leader) and the refusal of non-finite state on a helper thread,
    *while* DCP writes the shards: the finiteness check is a pass over the whole state and the
    small files are each fsync'd, and neither need delay the shards of a stop's save. Nothing
    commits before the future's result, an error or None, is in. -> (error now, the rest).
    Shared by both tiers; callers wait for the future whatever happens (no thread left writing
    into a generation being removed)."""
    try:
        (gen / ck.RANKS).mkdir(parents=True, exist_ok=True)
        faults.ckpt_kill("before_write", rank, job.nth)
        tensors = floating_tensors(sd)  # listed here: DCP may rebuild the dicts meanwhile
    except Exception as exc:
        failed: Future[str | None] = Future()
        failed.set_result(_write_reason(exc, gen))
        return failed.result(), failed
    return None, _side_pool().submit(_prepare_rest, gen, job, tensors, rank, world, leader)


def _prepare_rest(gen: Path, job: _Job, tensors: list[tuple[str, torch.Tensor]], rank: int, world: int,
                  leader: bool) -> str | None:
    try:
        ck.atomic_write_json(gen / ck.RANKS / f"rank-{rank:05d}.json",
                             {"rank": rank, "world_size": world, "rng": job.rng, "state": job.state})
        if leader:
            ck.atomic_write_json(gen / ck.META, job.meta)
        bad = [key for key, t in tensors if not _all_finite(t)]
        if bad:
            return f"non-finite values (NaN/inf) in {len(bad)} tensor(s), e.g. {', '.join(bad[:3])}"
    except Exception as exc:
        return _write_reason(exc, gen)
    return None


def _own_sums(gen: Path, rank: int, streamed: dict[str, Any]) -> dict[str, Any]:
    """This rank's files of a generation with size and crc32: its shards' as streamed; anything
    not streamed (its small JSON, a file DCP wrote another way) read back."""
    own = [p.name for p in gen.iterdir() if p.name.startswith(f"__{rank}_")]
    sums = {n: streamed[n] for n in own if n in streamed}
    sums.update(ck.checksum_files(gen, [n for n in own if n not in streamed] + [f"{ck.RANKS}/rank-{rank:05d}.json"]))
    return sums


def _to_state_dict(state: dict[str, Any]) -> dict[str, Any]:
    return {k: (v.state_dict() if isinstance(v, Stateful) else v) for k, v in state.items()}


class CheckpointManager:
    """Save/restore one run directory. Every method is collective: call it on every rank."""

    def __init__(self, run_dir: str | os.PathLike[str], *, keep: int = 2, keep_every: int | None = None,
                 async_mode: bool = False, on_inflight: str = "wait", on_error: str = "continue",
                 config_hash: str | None = None, model_shape: dict[str, Any] | None = None,
                 layout: dict[str, Any] | None = None, ledger: Ledger | None = None,
                 verify_on_restore: str = "full", io_threads: int = 1, scratch: str | None = None,
                 keep_local: int = 2, on_lag: str = "wait", overlap_staging: bool = True,
                 per_rank_state: list[per_rank.Entry] | None = None):
        for name, value, allowed in (("on_inflight", on_inflight, ("wait", "skip")),
                                     ("on_error", on_error, ("continue", "stop")),
                                     ("verify_on_restore", verify_on_restore, ("full", "size"))):
            if value not in allowed:
                raise UserError(f"CheckpointManager {name}={value!r}: use one of {allowed}")
        ck.plan_retention([], None, keep)  # validates keep >= 2 before anything is written
        self.run_dir, self.gdir = Path(run_dir), ck.generations_dir(run_dir)
        self.keep, self.keep_every, self.async_mode = keep, keep_every, async_mode
        self.on_inflight, self.on_error, self.verify_on_restore = on_inflight, on_error, verify_on_restore
        self.config_hash, self.model_shape, self.layout = config_hash, model_shape, layout or {}
        self.ledger, self.io_threads = ledger, io_threads
        self.overlap_staging = overlap_staging  # host copy during the next step (dslurm.checkpoint.staging)
        self.per_rank = per_rank_state or []  # saved by each rank into its rank file (checkpoint.per_rank)
        on = dist.is_available() and dist.is_initialized()
        self._ctl = _Comm(dist.new_group(backend="gloo") if on else None)
        self._bg = _Comm(dist.new_group(backend="gloo") if on and async_mode else None)
        self.rank, self.world = self._ctl.rank, self._ctl.world
        self._lock = ck.RunDirLock(self.run_dir)
        err = None
        if self.rank == 0:
            try:
                self._lock.acquire()
            except ck.RunLocked as exc:
                err = str(exc)
        if err := self._ctl.bcast(err):
            raise ck.RunLocked(err)
        # Threads deleting trash (old generations' bytes), joined by close(): the trainer leaves
        # through os._exit right after close(), which would kill a daemon thread mid-delete.
        self._reapers: list[threading.Thread] = []
        if self.rank == 0:  # what a killed process left (its reaper died with it); we own the run now
            self._reap(self.run_dir)
        self._stager: HostStager | None = None
        self._thread: threading.Thread | None = None
        self._outcome: SaveOutcome | None = None
        self._saves = 0
        self.last_outcome: SaveOutcome | None = None
        self._tiers: Any = None  # two tiers when `scratch` is set (dslurm.checkpoint.twotier)
        if scratch is not None:
            from dslurm.checkpoint.twotier import TwoTier
            self._tiers = TwoTier(self, scratch, keep_local, on_lag)

    # ------------------------------------------------------------ restore

    def restore(self, state: dict[str, Any], extra: dict[str, Any] | None = None) -> RestoreResult | None:
        """Load the pointer's generation (or a verified fallback) into `state`, resharding to the
        current layout; fill `extra` in place. None means a fresh start (truly nothing saved)."""
        self.wait()
        t0 = time.perf_counter()
        phases: dict[str, float] = {}
        plan = self._ctl.bcast(ck.plan_restore(self.run_dir) if self.rank == 0 else None)
        tier, why, gdir = "durable", "", self.gdir
        try:  # each candidate is checked while it loads; a mismatch moves on to the next one
            if self._tiers is not None:
                name, why, _ = self._tiers.restore_local(state, plan.pointer, phases)
                if name is not None:
                    tier, gdir = "local", self._tiers.lgdir
                    sel = ck.Selection(name, ck.parse_step(name) or 0, False, f"local tier: {why}")
                else:
                    log.info("[rank %d] restoring from the durable tier: %s", self.rank, why)
            if tier == "durable":
                sel = ck.select_generation(plan, lambda name, crc: self._load_checked(name, crc, state, phases))
        except ck.CheckpointError as exc:
            log.error("[rank %d] checkpoint restore refused: %s", self.rank, exc)
            self._event(events.CkptRestoreFailed(run_dir=str(self.run_dir), reason=str(exc)))
            raise
        if sel.generation is None:
            log.info("[rank %d] %s: %s", self.rank, self.run_dir, sel.reason)
            self._event(events.CkptFreshStart(run_dir=str(self.run_dir), reason=sel.reason))
            return None
        for name, problems in sel.rejected:
            log.error("[rank %d] CHECKPOINT %s REJECTED: %s", self.rank, name, "; ".join(problems))
            if self.rank == 0:
                ck.mark_rejected(self.gdir / name, problems)
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
        for how in per_rank.restore(self.per_rank, gen, meta["world_size"], self.rank, self.world):
            log.info("[rank %d] per-rank state %s", self.rank, how)
        if extra is not None:
            extra.update(meta["extra"])
        phases["total"] = time.perf_counter() - t0
        res = RestoreResult(meta["step"], sel.generation, gen, sel.fell_back, sel.reason,
                            dict(meta["extra"]), rng_ok, meta["world_size"], meta["layout"], sel.rejected,
                            {k: round(v, 4) for k, v in phases.items()}, tier, why)
        log.info("[rank %d] restored step %d from %s in %.2f s (%s)", self.rank, res.step, gen,
                 phases["total"], ", ".join(f"{k} {v:.3f} s" for k, v in phases.items() if k != "total"))
        kind = events.CkptFallback if sel.fell_back else events.CkptRestore
        self._event(kind(run_dir=str(self.run_dir), step=res.step, generation=res.generation,
                         reason=res.reason, rejected=[n for n, _ in sel.rejected], tier=tier, tier_reason=why,
                         rng_restored=rng_ok, saved_world_size=int(meta["world_size"])))
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
        self._check_compat(json.loads((gen / ck.META).read_text()), state, gen)
        full = self.verify_on_restore == "full"
        reader = CrcReader(gen, faults.durable_mbps())  # the knob emulates a loaded shared file system
        t, err = time.perf_counter(), None
        try:
            dcp.load(state, storage_reader=reader if full else dcp.FileSystemReader(gen),
                     process_group=self._ctl.group, no_dist=self._ctl.group is None)
        except (Exception, CheckpointException) as exc:  # corrupt bytes may fail to unpickle
            err = _reason(exc)
        phases["load"] = phases.get("load", 0.0) + time.perf_counter() - t
        t, reread = time.perf_counter(), 0
        if full:
            problems, reread = verify_reads(self._ctl, gen, entries, reader.sums)
        phases["verify"] = phases.get("verify", 0.0) + time.perf_counter() - t
        if reread:
            log.info("[rank %d] %s: %d bytes nobody's load read were read for their crc32", self.rank,
                     name, reread)
        errors = [e for e in self._ctl.gather(err) if e]
        if problems or not errors:
            return problems
        raise ck.CheckpointError(f"{gen}: dcp.load failed although its files match the manifest "
                                 f"({'crc32' if full else 'sizes'}): {errors[0]}")

    def _precheck(self, name: str, pointer_crc: str | None) -> tuple[list[str], dict[str, Any]]:
        """Manifest checks on rank 0; sizes of every file and crc32s of the small ones (not
        shards: those are checked while they load) split across ranks. -> (problems, entries)."""
        gen = self.gdir / name
        head = ck.manifest_problems(gen, pointer_crc) if self.rank == 0 else None
        problems, entries = self._ctl.bcast(head)
        if problems:
            return problems, entries
        mine = sorted(entries.items())[self.rank::self.world]
        full = self.verify_on_restore == "full"
        local = ck.file_problems(gen, {n: e for n, e in mine if is_shard(n)}, full=False)
        local += ck.file_problems(gen, {n: e for n, e in mine if not is_shard(n)}, full=full)
        return sorted(p for ps in self._ctl.gather(local) for p in ps), entries

    def _check_compat(self, meta: dict[str, Any], state: dict[str, Any], gen: Path) -> None:
        if meta.get("model_shape") is not None and self.model_shape is not None:
            diffs = ck.field_differences(meta["model_shape"], self.model_shape)
        elif meta.get("config_hash") and self.config_hash and meta["config_hash"] != self.config_hash:
            # Without shape fields a changed hash may be a changed model: refuse, say how to relax.
            diffs = [f"config_hash: {meta['config_hash']} -> {self.config_hash} (pass model_shape= "
                     "so that only shape changes are refused)"]
        else:
            diffs = []
        diffs = diffs or self._tensor_shape_diffs(state, gen)
        if diffs:
            raise ck.CheckpointError(
                f"{gen}: model shape changed since this generation was saved: {'; '.join(diffs[:10])}. "
                "Resume with the saved model config, or start a new run directory.")
        if meta.get("config_hash") != self.config_hash:
            log.warning("[rank %d] config hash %s -> %s (model shape unchanged): resuming",
                        self.rank, meta.get("config_hash"), self.config_hash)
        if meta["layout"] != self.layout or meta["world_size"] != self.world:
            log.info("[rank %d] resharding: saved layout %s on %d ranks -> %s on %d ranks", self.rank,
                     meta["layout"], meta["world_size"], self.layout, self.world)

    def _tensor_shape_diffs(self, state: dict[str, Any], gen: Path) -> list[str]:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata
        saved = dcp.FileSystemReader(gen).read_metadata().state_dict_metadata
        current, _ = flatten_state_dict(_to_state_dict(state))
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

    # ------------------------------------------------------------ save

    def save(self, step: int, state: dict[str, Any], extra: dict[str, Any] | None = None, *,
             blocking: bool = False) -> bool:
        """Start (async) or do (sync, or blocking=True for signal saves) a save of `state` at `step`.
        Returns False when skipped (on_inflight="skip") or, for sync saves, when it failed."""
        if self._tiers is not None:
            return bool(self._tiers.save(step, state, extra or {}, blocking))
        if self._thread is not None:
            busy = any(self._ctl.gather(self._thread.is_alive()))  # one decision for all ranks
            if busy and not blocking and self.on_inflight == "skip":
                log.warning("[rank %d] step %d: save skipped, previous save still in flight "
                            "(on_inflight=skip)", self.rank, step)
                self._event(events.CkptSaveSkipped(run_dir=str(self.run_dir), step=step, reason="in_flight"))
                return False
            if busy:
                log.info("[rank %d] step %d: waiting for the in-flight save (on_inflight=%s)",
                         self.rank, step, "wait" if not blocking else "blocking save")
            self.wait()
        job = self._new_job(step, extra or {})
        sd = _to_state_dict(state)
        if self.async_mode and not blocking:
            staged = self.stage(sd, state)
            stall = time.perf_counter() - job.t0
            self._thread = threading.Thread(target=self._background, args=(job, staged, stall),
                                            name="dslurm-ckpt", daemon=True)
            self._thread.start()
            return True
        out = self._write(job, sd, self._ctl)
        out.stall_s = out.total_s
        self._finish(out)
        return out.ok

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed or failed; apply on_error."""
        if self._tiers is not None:
            self._tiers.wait()
        if self._thread is None:
            return
        self._thread.join()
        self._thread, out = None, self._outcome
        assert out is not None  # _background always sets it
        out.stall_s += self.take_blocked()
        self._finish(out)

    def stage(self, sd: dict[str, Any], state: dict[str, Any]) -> Future[dict[str, Any]]:
        """Start the host copy of `sd` (the state dict of `state`): once the future is done,
        training may change the live tensors; the next optimizer step waits for that."""
        if self._stager is None:
            self._stager = HostStager(self.overlap_staging)
        return self._stager.stage(sd, forward_written(state))

    def fence(self) -> None:
        """Wait for the host copy of the save in flight. Torch optimizers' steps do this by
        themselves; call it before changing the saved state any other way."""
        if self._stager is not None:
            self._stager.fence()

    def take_blocked(self) -> float:
        """Seconds training waited at the fence since the last call (part of a save's stall)."""
        return self._stager.take_blocked() if self._stager is not None else 0.0

    def close(self) -> None:
        """Finish the in-flight save, then the trash deletion: unbounded, since unlinking runs at
        ~0.2 s per GB, and trash left behind would hold a generation's bytes for good (or, after
        a requeue, during the next start's first save: ENOSPC with a quota sized for keep+1)."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
            for t in self._reapers:
                t.join()
            self._reapers.clear()
            if self.rank == 0:
                self._lock.release()

    def _reap(self, run_dir: Path) -> None:
        """Delete the trash of run_dir on a thread of its own: unlinking a generation's shards
        takes ~0.2 s per GB, after the pointer moved, nothing a stop's save need wait for.
        close() joins it."""
        self._reapers = [t for t in self._reapers if t.is_alive()]
        t = threading.Thread(target=ck.empty_trash, args=(run_dir,), name="dslurm-ckpt-reap", daemon=True)
        t.start()
        self._reapers.append(t)

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _new_job(self, step: int, extra: dict[str, Any]) -> _Job:
        t0 = time.perf_counter()
        try:
            extra = json.loads(json.dumps(extra))  # a snapshot: the caller keeps mutating theirs
        except (TypeError, ValueError) as exc:
            raise UserError(f"checkpoint extra state must be JSON-serialisable: {exc}") from None
        self._saves += 1
        name = self._ctl.bcast(ck.generation_name(step) if self.rank == 0 else None)
        meta = {"format": ck.FORMAT, "generation": name, "step": step, "extra": extra,
                "world_size": self.world, "layout": self.layout, "config_hash": self.config_hash,
                "model_shape": self.model_shape, "torch_version": torch.__version__,
                "dslurm_version": dslurm.__version__, "saved_by": ck.holder_identity(),
                "per_rank": [e.name for e in self.per_rank]}
        return _Job(name, step, self._saves, meta, capture_rng(), t0, state=per_rank.capture(self.per_rank))

    def _background(self, job: _Job, staged: Future[dict[str, Any]], stall: float) -> None:
        try:
            host = staged.result()  # the host copy, made while training goes on
            faults.save_sleep()
            out = self._write(job, host, self._bg)
        except BaseException as exc:  # a dead peer, say; never lose the reason in a thread
            out = SaveOutcome(job.name, job.step, False, _reason(exc))
        out.stall_s = stall
        self._outcome = out

    def _write(self, job: _Job, sd: dict[str, Any], comm: _Comm) -> SaveOutcome:
        gen, r = self.gdir / job.name, comm.rank
        # local preparation; gathered before DCP so that no rank waits in a collective alone
        err, rest = prepare_generation(gen, job, sd, r, comm.world, leader=r == 0)
        sums: dict[str, Any] = {}
        job.phases["prep"] = time.perf_counter() - job.t0
        if not any(comm.gather(err)):
            try:  # dcp.save is collective and raises on every rank if any rank's write failed
                writer, streamed = crc_writer(gen, self.io_threads)  # crc32 while writing
                dcp.save(sd, storage_writer=writer, process_group=comm.group,
                         no_dist=comm.group is None)
                job.phases["dcp"] = time.perf_counter() - job.t0
                err = rest.result()
                if err is None:
                    faults.ckpt_kill("after_write", r, job.nth)
                    sums = _own_sums(gen, r, streamed)
                    job.phases["crc32"] = time.perf_counter() - job.t0
            except (Exception, CheckpointException) as exc:  # the latter is a BaseException
                err = _write_reason(exc, gen)
        err = err or rest.result()
        results = comm.gather((err, sums))
        verdict = self._commit(gen, job, results) if r == 0 else None
        ok, reason, nbytes = comm.bcast(verdict)
        return SaveOutcome(job.name, job.step, ok, reason, nbytes, 0.0, time.perf_counter() - job.t0,
                           dict(job.phases))

    def _commit(self, gen: Path, job: _Job, results: list[Any]) -> tuple[bool, str, int]:
        """Rank 0, after every rank finished: manifest, verify, restore-test, pointer, prune."""
        errors = [f"rank {i}: {e}" for i, (e, _) in enumerate(results) if e]
        try:
            if errors:
                raise RuntimeError("; ".join(errors))
            files: dict[str, Any] = {}
            for _, sums in results:
                files.update(sums)
            rest = [str(p.relative_to(gen)) for p in gen.rglob("*")
                    if p.is_file() and str(p.relative_to(gen)) not in files]
            files.update(ck.checksum_files(gen, rest))
            ck.fsync_dir(gen / ck.RANKS)  # the rank files' names (copied ones too) before the manifest
            ck.write_manifest(gen, job.step, files)  # atomic: its fsync of gen covers every name in gen
            ck.fsync_dir(self.gdir)
            job.phases["manifest"] = time.perf_counter() - job.t0
            problems = ck.verify_generation(gen, full=False) + restore_test(gen, files, _reason)
            job.phases["verify"] = time.perf_counter() - job.t0
            if problems:
                raise RuntimeError("verification failed: " + "; ".join(problems))
            faults.ckpt_kill("before_pointer", 0, job.nth)
            ck.write_pointer(self.run_dir, job.name, job.step)
            job.phases["pointer"] = time.perf_counter() - job.t0
        except Exception as exc:
            if gen.exists():  # every rank is past its writes: free the space (ENOSPC) now
                ck.remove_generation(self.run_dir, job.name)
            return False, _reason(exc), 0
        try:  # the old generations leave at once; their bytes are deleted off the save's path
            ck.collect_garbage(self.run_dir, self.keep, self.keep_every, in_flight={job.name}, reap=False)
            self._reap(self.run_dir)
        except Exception as exc:  # pruning must never turn a committed save into a failure
            log.warning("checkpoint gc in %s failed: %s", self.run_dir, _reason(exc))
        return True, "", sum(f["size"] for f in files.values())

    def _finish(self, out: SaveOutcome) -> None:
        self.last_outcome = out
        if out.ok:
            log.info("[rank %d] checkpoint step %d committed: %s, %.1f MB, training blocked %.3f s, "
                     "total %.2f s", self.rank, out.step, out.generation, out.bytes / 1e6,
                     out.stall_s, out.total_s)
            self._event(events.CkptSave(run_dir=str(self.run_dir), step=out.step, generation=out.generation,
                                        bytes=out.bytes, stall_s=round(out.stall_s, 4),
                                        total_s=round(out.total_s, 4), tier=out.tier,
                                        local_commit_t=out.local_commit_t, lag_s=out.lag_s))
            return
        log.error("[rank %d] checkpoint save at step %d FAILED, pointer unchanged (%s), on_error=%s: %s",
                  self.rank, out.step, self._pointer_desc(), self.on_error, out.reason)
        self._event(events.CkptSaveFailed(run_dir=str(self.run_dir), step=out.step, generation=out.generation,
                                          reason=out.reason, policy=self.on_error))
        if self.on_error == "stop":
            raise self.failure(out)

    def failure(self, out: SaveOutcome) -> ck.SaveFailed:
        """The error a caller raises when a save it needs (the final one, a stop's) failed."""
        return ck.SaveFailed(f"checkpoint save at step {out.step} failed: {out.reason}. Fix: "
                             f"{failure_hint(out.reason, self.run_dir)}. The pointer still names "
                             f"{self._pointer_desc()}.")

    def _pointer_desc(self) -> str:
        """What the pointer names now, for messages (a garbage pointer names nothing)."""
        try:
            ptr = ck.read_pointer(self.run_dir)
        except ck.CheckpointError:
            ptr = None
        return f"step {ptr.step} ({ptr.generation})" if ptr else "no generation"

    def _event(self, ev: events.Event) -> None:
        if self.ledger is not None and self.rank == 0:
            self.ledger.append(ev)
