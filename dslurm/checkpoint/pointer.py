"""The checkpoint pointer protocol, torch-free (ARCHITECTURE.md, "Checkpoint pointer protocol"):
names on disk, generations, manifest, verification, the pointer, the restore plan and retention.
Re-exported by dslurm.checkpoint (its public names); the CLI uses it without importing torch.

On disk, per run directory::

    <run_dir>/LATEST                        the pointer: JSON naming ONE committed generation
    <run_dir>/.lock, lock-holder.json       run-directory lock (flock; dslurm.checkpoint.lock)
    <run_dir>/generations/step-00000120-20260101T120000Z-a1b2c3/
        .metadata, __<rank>_<i>.distcp      torch.distributed.checkpoint files
        meta.json                           step, extra state, config hash, layout, versions
        ranks/rank-00000.json               per-rank RNG states
        MANIFEST.json                       every file, size and crc32; written last (commit marker)

Restore trusts only the pointer; other generations matter only as verified fallback candidates.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import logging
import os
import re
import secrets
import shutil
import socket
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dslurm import exitcodes as X
from dslurm.checkpoint import unpickle
from dslurm.durable import atomic_write_bytes as atomic_write_bytes  # re-exported: other modules use it
from dslurm.durable import fsync_dir as fsync_dir
from dslurm.errors import UserError

log = logging.getLogger(__name__)

GENERATIONS = "generations"
POINTER = "LATEST"
MANIFEST = "MANIFEST.json"
META = "meta.json"
RANKS = "ranks"
REJECTED = "REJECTED.json"  # written into a generation a restore found corrupt
LOCK = ".lock"
HOLDER = "lock-holder.json"
TRASH = ".trash-"
FORMAT = 1
# Files the manifest must list for a generation to be restorable at all.
REQUIRED = (".metadata", META)
_NAME_RE = re.compile(r"^step-(\d{8,})-(\d{8}T\d{6}Z)-([0-9a-f]{6})$")
_CHUNK = 8 << 20


class CheckpointError(UserError):
    """The run's checkpoints cannot be used or written; the message says which file and why."""

    exit_code = 1


class RunLocked(CheckpointError):
    """Another job holds the run directory: this one is refused, and must not be retried."""

    exit_code = X.REFUSED


class SaveFailed(CheckpointError):
    """A save failed with on_error=stop, or the final save failed: the state is not durable."""

    exit_code = X.SAVE_FAILED


# ---------------------------------------------------------------- durable small writes
# fsync_dir and atomic_write_bytes come from dslurm.durable (re-exported: other modules use them).


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode())


def config_digest(obj: Any) -> str:
    """Stable hash of a JSON-able config (key order does not matter)."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


# ---------------------------------------------------------------- generations


def generation_name(step: int, now: _dt.datetime | None = None, token: str | None = None) -> str:
    """Unique, sortable name: step first, then UTC time, then randomness for same-second saves."""
    now = now or _dt.datetime.now(_dt.timezone.utc)
    return f"step-{step:08d}-{now.strftime('%Y%m%dT%H%M%SZ')}-{token or secrets.token_hex(3)}"


def parse_step(name: str) -> int | None:
    m = _NAME_RE.match(name)
    return int(m.group(1)) if m else None


def _sort_key(name: str) -> tuple[int, str]:
    # Numeric step first: names with 9+ digit steps must still sort after 8-digit ones.
    return (parse_step(name) or -1, name)


def generations_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / GENERATIONS


@dataclass
class GenInfo:
    name: str
    step: int
    path: Path
    committed: bool  # has a manifest (the commit marker) and was never rejected by a restore


def list_generations(run_dir: str | os.PathLike[str]) -> list[GenInfo]:
    """Generation directories, oldest first; trash and foreign names are ignored."""
    gdir = generations_dir(run_dir)
    if not gdir.is_dir():
        return []
    out = []
    for p in gdir.iterdir():
        step = parse_step(p.name)
        if step is not None and p.is_dir():
            out.append(GenInfo(p.name, step, p, (p / MANIFEST).is_file() and not (p / REJECTED).exists()))
    return sorted(out, key=lambda g: _sort_key(g.name))


def mark_rejected(gen_dir: Path, problems: list[str]) -> None:
    """A restore found this generation corrupt: from now on it counts as uncommitted, so it is
    never a fallback again and retention deletes it instead of an older generation that verifies."""
    try:
        atomic_write_json(gen_dir / REJECTED, {"problems": problems[:20], "by": holder_identity()})
    except OSError as exc:
        log.error("could not mark %s rejected: %s", gen_dir, exc)


# ---------------------------------------------------------------- checksums and manifest


def file_crc32(path: Path) -> tuple[int, str]:
    """(size, crc32 hex). crc32 runs at ~2 GB/s here vs ~0.55 GB/s for blake2b (docs/checkpoint.md);
    it catches truncation and bit rot, which is what it is for, not tampering."""
    crc, size = 0, 0
    with open(path, "rb", buffering=0) as f:
        # No larger than the file: a fresh 8 MiB buffer costs ~1 ms of page faults, more than
        # summing the small JSON files a save and a restore check.
        buf = bytearray(min(_CHUNK, os.fstat(f.fileno()).st_size + 1))
        view = memoryview(buf)
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return size, f"{crc:08x}"


FULL_BELOW_BYTES = 1 << 20  # a file system with less free than this cannot take a generation


def disk_full_fact(path: Path) -> str:
    """'No space left …' when the file system holding path is (nearly) full, else ''.

    Asked right after a write failed, before the partial files are removed: a short write
    does not always surface as ENOSPC (torch's zip writer reports "unexpected pos"), but the
    free space says what happened."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return ""
    free = st.f_bavail * st.f_frsize
    if free >= FULL_BELOW_BYTES:
        return ""
    return (f"No space left on device (ENOSPC): the file system holding {path} has {free} bytes free "
            f"of {st.f_blocks * st.f_frsize}")


def full_disk(reason: str) -> bool:
    """Does a save's failure reason say the disk was full (ENOSPC, however the writer put it)?"""
    return "No space left" in reason or "ENOSPC" in reason or "Errno 28" in reason


def checksum_files(root: Path, relpaths: Iterable[str]) -> dict[str, dict[str, Any]]:
    out = {}
    for rel in relpaths:
        size, crc = file_crc32(root / rel)
        out[rel] = {"size": size, "crc32": crc}
    return out


def write_manifest(gen_dir: Path, step: int, files: dict[str, dict[str, Any]]) -> None:
    doc = {"format": FORMAT, "generation": gen_dir.name, "step": step, "algo": "crc32",
           "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "files": dict(sorted(files.items()))}
    atomic_write_json(gen_dir / MANIFEST, doc)


def read_manifest(gen_dir: Path) -> dict[str, Any]:
    path = gen_dir / MANIFEST
    try:
        doc: dict[str, Any] = json.loads(path.read_text())
        files = doc["files"]
        if not isinstance(files, dict):
            raise TypeError("files is not a mapping")
        for name, entry in files.items():
            if not isinstance(entry, dict) or not isinstance(entry.get("size"), int) or entry["size"] < 0 \
                    or not isinstance(entry.get("crc32"), str):
                raise TypeError(f"entry {name!r} is {entry!r}, not {{\"size\": BYTES, \"crc32\": HEX}}")
        return doc
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (partial or in-flight generation)") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: unreadable manifest ({exc.strerror})") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: unreadable manifest ({exc}); this generation cannot be trusted: "
                              "use another (`dslurm ckpt ls`)") from None


def manifest_problems(gen_dir: Path, pointer_crc: str | None = None) -> tuple[list[str], dict[str, Any]]:
    """Checks on the manifest itself: (problems, its file entries)."""
    if not gen_dir.is_dir():
        return [f"{gen_dir}: generation directory missing"], {}
    try:
        doc = read_manifest(gen_dir)
    except CheckpointError as exc:
        return [str(exc)], {}
    problems = [f"{gen_dir / r}: not listed in {MANIFEST}" for r in REQUIRED if r not in doc["files"]]
    if pointer_crc is not None:
        _, crc = file_crc32(gen_dir / MANIFEST)
        if crc != pointer_crc:
            problems.append(f"{gen_dir / MANIFEST}: crc32 {crc} != {pointer_crc} recorded in {POINTER}")
    return problems, doc["files"]


def file_problems(gen_dir: Path, entries: dict[str, dict[str, Any]], full: bool = True) -> list[str]:
    """Each listed file exists with its size (and crc32 when `full`); problems name the file."""
    problems = []
    for rel, want in sorted(entries.items()):
        path = gen_dir / rel
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"{path}: missing")
            continue
        if size != want["size"]:
            problems.append(f"{path}: size {size} != {want['size']} in manifest (truncated?)")
        elif full:
            _, crc = file_crc32(path)
            if crc != want["crc32"]:
                problems.append(f"{path}: crc32 {crc} != {want['crc32']} in manifest (altered)")
    return problems


def verify_generation(gen_dir: Path, full: bool = True, pointer_crc: str | None = None) -> list[str]:
    """All problems of one generation; empty means sound."""
    problems, entries = manifest_problems(gen_dir, pointer_crc)
    problems += file_problems(gen_dir, entries, full)
    return problems or metadata_problems(gen_dir)


def metadata_problems(gen_dir: Path) -> list[str]:
    """DCP's `.metadata` read with stand-ins (dslurm.checkpoint.unpickle): a class no checkpoint
    holds, or bytes that are no pickle, is a problem, found without loading anything."""
    if not (gen_dir / ".metadata").is_file():  # absent: the manifest's REQUIRED check names it
        return []
    try:
        why = unpickle.check_file(gen_dir / ".metadata")
    except unpickle.UnsafePickle as exc:
        return [str(exc)]
    return [why] if why else []


# ---------------------------------------------------------------- pointer


@dataclass
class Pointer:
    generation: str
    step: int
    manifest_crc32: str | None = None


def read_pointer(run_dir: str | os.PathLike[str]) -> Pointer | None:
    """None when absent; CheckpointError when present but not a pointer."""
    path = Path(run_dir) / POINTER
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:  # a directory, unreadable
        raise CheckpointError(f"{path}: not the pointer file ({exc.strerror}). Fix: move it away; the restore "
                              "then falls back to the newest verified generation") from None
    try:
        doc = json.loads(raw)
        ptr = Pointer(str(doc["generation"]), int(doc["step"]), doc.get("manifest_crc32"))
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: garbage pointer ({len(raw)} bytes, {exc})") from None
    if parse_step(ptr.generation) is None:
        raise CheckpointError(f"{path}: names {ptr.generation!r}, not a generation name")
    return ptr


def write_pointer(run_dir: str | os.PathLike[str], generation: str, step: int) -> None:
    gen_dir = generations_dir(run_dir) / generation
    _, crc = file_crc32(gen_dir / MANIFEST)
    atomic_write_json(Path(run_dir) / POINTER, {
        "generation": generation, "step": step, "manifest_crc32": crc,
        "updated": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")})


# ---------------------------------------------------------------- choosing what to restore


@dataclass
class RestorePlan:
    """What rank 0 saw on disk; broadcast so every rank walks the same candidates."""

    pointer: Pointer | None
    pointer_problem: str | None
    candidates: list[str]  # to try in order; the pointer's target first when there is one
    ignored_partials: list[str] = field(default_factory=list)


@dataclass
class Selection:
    generation: str | None  # None: fresh start
    step: int
    fell_back: bool
    reason: str
    rejected: list[tuple[str, list[str]]] = field(default_factory=list)


def plan_restore(run_dir: str | os.PathLike[str]) -> RestorePlan:
    gens = list_generations(run_dir)
    partials = [g.name for g in gens if not g.committed]
    committed = [g.name for g in gens if g.committed]
    try:
        ptr, problem = read_pointer(run_dir), None
    except CheckpointError as exc:
        ptr, problem = None, str(exc)
    if ptr is None:
        # No usable pointer: every committed generation is a candidate, newest first (they must verify).
        return RestorePlan(None, problem, committed[::-1], partials)
    older = [n for n in committed if _sort_key(n) < _sort_key(ptr.generation)]
    return RestorePlan(ptr, None, [ptr.generation] + older[::-1], partials)


def select_generation(plan: RestorePlan, verify: Callable[[str, str | None], list[str]]) -> Selection:
    """Walk the plan; `verify(name, pointer_crc)` returns problems. Raises CheckpointError when the
    run has committed state but none of it verifies: a silent fresh start would lose the run."""
    ptr = plan.pointer
    if ptr is None and plan.pointer_problem is None and not plan.candidates:
        why = "no pointer and no committed generation: fresh start"
        if plan.ignored_partials:
            why += f" (ignoring {len(plan.ignored_partials)} partial: {', '.join(plan.ignored_partials)})"
        return Selection(None, 0, False, why)
    rejected: list[tuple[str, list[str]]] = []
    for i, name in enumerate(plan.candidates):
        is_target = ptr is not None and i == 0
        problems = verify(name, ptr.manifest_crc32 if ptr is not None and is_target else None)
        if not problems:
            if is_target:
                return Selection(name, parse_step(name) or 0, False, f"{POINTER} -> {name}", rejected)
            first = plan.pointer_problem or (
                f"{POINTER} missing" if ptr is None else f"{ptr.generation}: {rejected[0][1][0]}")
            return Selection(name, parse_step(name) or 0, True,
                             f"fell back to {name} because {first}", rejected)
        rejected.append((name, problems))
    head = plan.pointer_problem or (f"{POINTER} -> {ptr.generation}" if ptr else f"{POINTER} missing")
    details = "; ".join(f"{n}: {p[0]}" for n, p in rejected) or "no committed generation"
    raise CheckpointError(
        f"{head}, and no generation verifies ({details}). Refusing to start fresh over a run "
        "with saved state: inspect with `dslurm ckpt ls/verify`, or move the run directory aside.")


# ---------------------------------------------------------------- retention


def plan_retention(gens: list[GenInfo], pointer: str | None, keep: int,
                   keep_every: int | None = None, in_flight: Iterable[str] = ()) -> list[str]:
    """Names to delete. Keeps the last `keep` committed generations up to the pointer's target,
    every `keep_every`-th step, the target itself, anything in flight, and committed generations
    newer than the target (never published, maybe the next fallback; they age out later)."""
    if keep < 2:
        raise UserError(f"keep={keep}: retention must keep at least 2 generations (the newest may be "
                        "the one that fails to verify)")
    busy = set(in_flight)
    ordered = sorted(gens, key=lambda g: _sort_key(g.name))
    limit = _sort_key(pointer) if pointer else None
    published = [g for g in ordered if g.committed and (limit is None or _sort_key(g.name) <= limit)]
    keepers = {g.name for g in published[-keep:]} | busy | ({pointer} if pointer else set())
    if keep_every:
        keepers |= {g.name for g in published if g.step % keep_every == 0}
    doomed = []
    for g in ordered:
        if g.name in keepers:
            continue
        newer = limit is not None and _sort_key(g.name) > limit
        if not (g.committed and newer):
            doomed.append(g.name)
    return doomed


def remove_generation(run_dir: str | os.PathLike[str], name: str, *, reap: bool = True) -> None:
    """Rename into trash first so no half-deleted directory ever looks like a generation; then
    delete it, or (reap=False) leave that to `empty_trash`."""
    gdir = generations_dir(run_dir)
    trash = gdir / f"{TRASH}{name}.{secrets.token_hex(2)}"
    os.replace(gdir / name, trash)
    fsync_dir(gdir)
    if reap:
        shutil.rmtree(trash, ignore_errors=True)


def empty_trash(run_dir: str | os.PathLike[str]) -> None:
    """Delete what removals renamed into trash (and what a kill during one left there)."""
    for p in generations_dir(run_dir).glob(f"{TRASH}*"):
        shutil.rmtree(p, ignore_errors=True)


def collect_garbage(run_dir: str | os.PathLike[str], keep: int, keep_every: int | None = None,
                    in_flight: Iterable[str] = (), dry_run: bool = False, reap: bool = True) -> list[str]:
    """Apply plan_retention; the caller must hold the run lock (another job's partial is not ours).
    reap=False: the doomed generations are only renamed into trash (gone as generations at once);
    the caller deletes their bytes with `empty_trash` when it suits it."""
    pointer = read_pointer(run_dir)  # garbage pointer: raise, deleting blind could lose the fallback
    doomed = plan_retention(list_generations(run_dir), pointer.generation if pointer else None,
                            keep, keep_every, in_flight)
    if not dry_run:
        for name in doomed:
            remove_generation(run_dir, name, reap=False)
        if reap:
            empty_trash(run_dir)
    if doomed:
        log.info("checkpoint gc in %s: %s %s", run_dir, "would remove" if dry_run else "removed",
                 ", ".join(doomed))
    return doomed


def field_differences(saved: dict[str, Any] | None, current: dict[str, Any] | None) -> list[str]:
    """'name: saved -> current' for every field that differs (missing on one side included)."""
    saved, current = saved or {}, current or {}
    return [f"{k}: {saved.get(k, '<absent>')!r} -> {current.get(k, '<absent>')!r}"
            for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]


def holder_identity() -> dict[str, Any]:
    """Who we are: the Slurm job (stable across requeue) when there is one, else pid@host."""
    env = os.environ
    job = env.get("SLURM_JOB_ID")
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return {"job_id": job, "pid": os.getpid(), "host": socket.gethostname(),
            "restart": int(env.get("SLURM_RESTART_COUNT", "0") or 0),
            "since": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
