"""A run directory's files, with one owner (as submitit's `JobPaths` owns a job folder).

Torch-free and light: it sits just above the config, so every link (submit, the burn-in gate,
requeue-me, the in-allocation recovery, the API) reads and writes a run's files through here.
"""

from __future__ import annotations

from pathlib import Path

from dslurm.durable import atomic_write_text

BLOCKLIST = "blocklist.txt"
"""nodes the run's burn-in (or its recovery) found bad; later submissions of the run --exclude them"""


def blocklist_path(run_dir: Path) -> Path:
    """Nodes the run's burn-in found bad; later submissions of the run --exclude them."""
    return run_dir / BLOCKLIST


def read_blocklist(run_dir: Path) -> list[str]:
    try:
        lines = blocklist_path(run_dir).read_text().split()
    except FileNotFoundError:
        return []
    return sorted(set(lines))


def add_to_blocklist(run_dir: Path, hosts: list[str]) -> list[str]:
    """Merge hosts into the run's blocklist atomically; return the whole list."""
    merged = sorted(set(read_blocklist(run_dir)) | set(hosts))
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(blocklist_path(run_dir), "\n".join(merged) + "\n")
    return merged
