"""A sweep file: read, check, expand into tasks, name each task's run directory. Pure except
for reading the file.

    name: lr-sweep                  # default: the file's stem
    site: site-configs/local.yaml   # paths relative to the working directory, as --site/--job
    job: examples/jobs/tiny-2node.yaml
    dir: checkpoints/sweeps/lr      # the sweep directory; default <site storage.durable>/<name>
    max_parallel: 2                 # tasks running at once (sbatch --array=...%K)
    set: [train.steps=40]           # overrides every task gets (optional)
    grid: {train.lr: [1e-4, 3e-4], train.seed: [0, 1]}     # the product, last key fastest
    # or, instead of grid, one override set per task:
    tasks: [{train.lr: 1e-4}, {train.lr: 3e-4, env.MY_FLAG: "1"}]

Task i's run directory is `<dir>/<i>-<slug>`, the slug made of its overrides (letters, digits,
`.`, `+`, `-`, `_` only): the index keeps names apart, the slug tells a person which is which.
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dslurm.errors import UserError

KEYS = ("name", "site", "job", "dir", "max_parallel", "set", "site_set", "grid", "tasks")
# Fields a sweep may not vary: the sweep gives every task its run directory, and one array has one
# job name (--job-name): varying them would make tasks share, or lose, their run's identity.
IDENTITY = ("checkpoint.run_dir", "name")
SLUG_MAX = 80


@dataclass(frozen=True, kw_only=True, slots=True)
class SweepSpec:
    path: str
    name: str
    site: str
    job: str
    dir: str | None
    max_parallel: int
    common: tuple[str, ...]
    site_common: tuple[str, ...]
    tasks: tuple[tuple[tuple[str, Any], ...], ...]
    """one override set per task: (dotted field, value) pairs, in the order given"""


def override_text(key: str, value: Any) -> str:
    """`key=value` for `--set`: the value as JSON, which the YAML 1.2 override reader gives back
    unchanged (a string stays a string, 1e-4 stays a float, a list stays a list)."""
    return f"{key}={json.dumps(value)}"


def _value_word(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
    return re.sub(r"[^A-Za-z0-9.+-]+", "_", text).strip("_") or "_"


def slug(overrides: tuple[tuple[str, Any], ...]) -> str:
    """`lr-0.0001_seed-0` for {train.lr: 1e-4, train.seed: 0}: each field by its last name (the
    whole dotted name when two share it), filesystem-safe, at most SLUG_MAX characters. Pure."""
    last = [k.rsplit(".", 1)[-1] for k, _ in overrides]
    parts = []
    for (key, value), short in zip(overrides, last):
        name = short if last.count(short) == 1 else key
        parts.append(f"{_value_word(name)}-{_value_word(value)}")
    return "_".join(parts)[:SLUG_MAX].rstrip("_.-") or "base"


def task_dir_name(index: int, overrides: tuple[tuple[str, Any], ...]) -> str:
    return f"{index}-{slug(overrides)}"


def _where(path: str, key: str) -> str:
    return f"{path}: field '{key}'"


def _override_sets(path: str, data: dict[str, Any]) -> list[tuple[tuple[str, Any], ...]]:
    grid, tasks = data.get("grid"), data.get("tasks")
    if (grid is None) == (tasks is None):
        raise UserError(f"{path}: give either 'grid' (every combination) or 'tasks' (a list of override "
                        "sets), not {}. Fix: e.g. grid: {{train.lr: [1e-4, 3e-4]}}"
                        .format("both" if grid is not None else "neither"))
    if grid is not None:
        if not isinstance(grid, dict) or not grid:
            raise UserError(f"{_where(path, 'grid')}: {grid!r} is empty or not a mapping; a sweep needs at "
                            "least one field with values. Fix: grid: {train.lr: [1e-4, 3e-4]}")
        for key, values in grid.items():
            if not isinstance(values, list) or not values:
                raise UserError(f"{_where(path, 'grid.' + str(key))}: {values!r} must be a non-empty list of "
                                f"values. Fix: {key}: [value1, value2]")
        keys = [str(k) for k in grid]
        return [tuple(zip(keys, combo)) for combo in itertools.product(*grid.values())]
    if not isinstance(tasks, list) or not tasks:
        raise UserError(f"{_where(path, 'tasks')}: {tasks!r} must be a non-empty list of override sets. "
                        "Fix: tasks: [{train.lr: 1e-4}, {train.lr: 3e-4}]")
    out = []
    for i, t in enumerate(tasks):
        if not isinstance(t, dict):
            raise UserError(f"{_where(path, 'tasks')}: item {i} {t!r} is not a mapping of field to value. "
                            "Fix: {train.lr: 1e-4}")
        out.append(tuple((str(k), v) for k, v in t.items()))
    return out


def _check_sets(path: str, sets: list[tuple[tuple[str, Any], ...]]) -> None:
    seen: dict[tuple[str, ...], int] = {}
    for i, s in enumerate(sets):
        for key, _ in s:
            if key in IDENTITY or key.startswith("checkpoint.run_dir."):
                raise UserError(f"{path}: task {i}: field '{key}' cannot be swept: the sweep names every task's "
                                f"run directory itself (<dir>/<index>-<overrides>) and one array has one job name. "
                                "Fix: remove it from the sweep; set the sweep's 'dir' or 'name' instead")
        texts = tuple(sorted(override_text(k, v) for k, v in s))
        if texts in seen:
            same = ", ".join(texts) or "none"
            raise UserError(f"{path}: tasks {seen[texts]} and {i} have the same overrides ({same}): they would "
                            "train the same run twice. Fix: remove the duplicate")
        seen[texts] = i


def _str_list(path: str, data: dict[str, Any], key: str) -> tuple[str, ...]:
    value = data.get(key) or []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UserError(f"{_where(path, key)}: {value!r} must be a list of KEY=VALUE strings. "
                        "Fix: set: [train.steps=40]")
    return tuple(value)


def parse(data: dict[str, Any], path: str = "sweep") -> SweepSpec:
    """Check a sweep file's data and expand its tasks. Pure."""
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise UserError(f"{path}: unknown key(s) {', '.join(map(repr, unknown))}. Valid: {', '.join(KEYS)}")
    for key in ("site", "job"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise UserError(f"{_where(path, key)}: missing; a sweep names its base {key} file. "
                            f"Fix: {key}: path/to/{key}.yaml")
    name = data.get("name", Path(path).stem)
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name):
        raise UserError(f"{_where(path, 'name')}: {name!r} may only hold letters, digits, '-', '_' and '.'. "
                        "Fix: name: lr-sweep")
    mp = data.get("max_parallel", 0)
    if isinstance(mp, bool) or not isinstance(mp, int) or mp < 0:
        raise UserError(f"{_where(path, 'max_parallel')}: {mp!r} must be a whole number >= 0 (0: no limit). "
                        "Fix: max_parallel: 2")
    sets = _override_sets(path, data)
    _check_sets(path, sets)
    d = data.get("dir")
    if d is not None and not isinstance(d, str):
        raise UserError(f"{_where(path, 'dir')}: {d!r} must be a path. Fix: dir: checkpoints/sweeps/{name}")
    return SweepSpec(path=path, name=name, site=data["site"], job=data["job"], dir=d, max_parallel=mp,
                     common=_str_list(path, data, "set"), site_common=_str_list(path, data, "site_set"),
                     tasks=tuple(sets))


def load(path: str | Path) -> SweepSpec:
    from dslurm.config.schema import load_yaml

    return parse(load_yaml(path), str(path))


