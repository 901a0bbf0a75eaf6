"""Checkpoints, the torch-free half: the package's public names (ARCHITECTURE.md, "Checkpoint
pointer protocol"). `from dslurm import checkpoint as ck` gives the protocol (`pointer.py`: names
on disk, generations, manifest, verification, the pointer, the restore plan, retention) and the
run lock (`lock.py`), plain file logic so that `dslurm ckpt` answers without importing torch.
The in-job half (torch) is `dslurm.checkpoint.dcp` (the manager) and its tiers.
"""

from __future__ import annotations

from dslurm.checkpoint.lock import RunDirLock, describe_holder
from dslurm.checkpoint.pointer import (
    FORMAT,
    FULL_BELOW_BYTES,
    GENERATIONS,
    HOLDER,
    LOCK,
    MANIFEST,
    META,
    POINTER,
    RANKS,
    REJECTED,
    REQUIRED,
    TRASH,
    CheckpointError,
    GenInfo,
    Pointer,
    RestorePlan,
    RunLocked,
    SaveFailed,
    Selection,
    atomic_write_bytes,
    atomic_write_json,
    checksum_files,
    collect_garbage,
    config_digest,
    disk_full_fact,
    empty_trash,
    field_differences,
    file_crc32,
    file_problems,
    fsync_dir,
    full_disk,
    generation_name,
    generations_dir,
    holder_identity,
    list_generations,
    manifest_problems,
    mark_rejected,
    metadata_problems,
    parse_step,
    plan_restore,
    plan_retention,
    read_manifest,
    read_pointer,
    remove_generation,
    select_generation,
    verify_generation,
    write_manifest,
    write_pointer,
)

__all__ = [
    "CheckpointError", "FORMAT", "FULL_BELOW_BYTES", "GENERATIONS", "GenInfo", "HOLDER", "LOCK",
    "MANIFEST", "META", "POINTER", "Pointer", "RANKS", "REJECTED", "REQUIRED", "RestorePlan",
    "RunDirLock", "RunLocked", "SaveFailed", "Selection", "TRASH", "atomic_write_bytes",
    "atomic_write_json", "checksum_files", "collect_garbage", "config_digest", "describe_holder",
    "disk_full_fact", "full_disk", "empty_trash", "field_differences", "file_crc32", "file_problems",
    "fsync_dir", "generation_name", "generations_dir", "holder_identity", "list_generations",
    "manifest_problems", "mark_rejected", "metadata_problems", "parse_step", "plan_restore", "plan_retention",
    "read_manifest", "read_pointer", "remove_generation", "select_generation", "verify_generation",
    "write_manifest", "write_pointer",
]
