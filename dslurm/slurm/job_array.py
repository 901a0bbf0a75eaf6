"""Job arrays under a site's MaxArraySize, shared by sweeps (dslurm/sweep) and the tokenization
array (dslurm/data/array.py): the split of task numbers into array jobs, the `--array` value, and
the site's limit as slurmctld reports it. Pure but for `max_array_size` (one scontrol call)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from dslurm.errors import UserError

SLURM_MAX_ARRAY_SIZE = 1001  # Slurm's default MaxArraySize (task ids 0..1000)


@dataclass(frozen=True, kw_only=True, slots=True)
class ArrayPart:
    """One sbatch --array job: the sweep's tasks `offset + id` for each array task id."""

    offset: int
    ids: tuple[int, ...]

    @property
    def tasks(self) -> list[int]:
        return [self.offset + i for i in self.ids]


def split_arrays(tasks: list[int], max_array_size: int) -> list[ArrayPart]:
    """Tasks -> array jobs: task t goes to array t // size as array task id t % size, because a
    site's MaxArraySize bounds the ids (0..size-1) as well as the count. Pure."""
    if max_array_size < 1:
        raise UserError(f"MaxArraySize {max_array_size}: the site allows no job arrays. Fix: ask the admins")
    parts: dict[int, list[int]] = {}
    for t in sorted(tasks):
        parts.setdefault(t // max_array_size, []).append(t % max_array_size)
    return [ArrayPart(offset=k * max_array_size, ids=tuple(ids)) for k, ids in sorted(parts.items())]


def parse_max_array_size(scontrol_config: str) -> int | None:
    """MaxArraySize from `scontrol show config` (`MaxArraySize = 1001`). Pure."""
    m = re.search(r"^\s*MaxArraySize\s*=\s*(\d+)\s*$", scontrol_config, re.M)
    return int(m.group(1)) if m else None


def array_ids(tasks: list[int], concurrency: int) -> str:
    """`0-2%2` for a run of ids, `1,4%2` otherwise. Pure."""
    if tasks == list(range(tasks[0], tasks[0] + len(tasks))) and len(tasks) > 1:
        ids = f"{tasks[0]}-{tasks[-1]}"
    else:
        ids = ",".join(map(str, tasks))
    return f"{ids}%{concurrency}" if concurrency > 0 else ids


def max_array_size(env: Mapping[str, str] | None = None) -> tuple[int, str]:
    """The site's MaxArraySize (`scontrol show config`) and where it came from; Slurm's default
    when the controller cannot be asked (render without a cluster)."""
    from dslurm import slurm  # lazy: the pure parts are imported by render paths

    try:
        res = slurm.run_cmd(["scontrol", "show", "config"], check=False, env=env, timeout=20)
    except (OSError, UserError):
        res = None
    size = parse_max_array_size(res.stdout) if res is not None and res.returncode == 0 else None
    if size is None:
        return SLURM_MAX_ARRAY_SIZE, f"Slurm's default {SLURM_MAX_ARRAY_SIZE} (scontrol show config did not answer)"
    return size, f"MaxArraySize {size} (scontrol show config)"
