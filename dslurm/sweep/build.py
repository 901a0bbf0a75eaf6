"""A sweep resolved: every task through the normal config path (load + overrides + resolve), its
run directory, the array's #SBATCH flags and the array scripts. The one place the array
directives and each task's run directory come from; `render_array` is pure.

Each task's run directory gets what `dslurm submit` freezes for a single run (site.yaml,
job.yaml, job.sbatch). The array script only picks the task's run directory by
SLURM_ARRAY_TASK_ID from a map written at submit and `exec`s that task's frozen job.sbatch:
same batch shell (Slurm's B: signal reaches its traps), DSLURM_RUN_DIR the task's own, and
requeue-me requeues `ARRAYJOB_TASK`, never the array (dslurm.requeue.job_ref).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dslurm import __version__
from dslurm.config.resolve import Resolved
from dslurm.errors import UserError
from dslurm.run import SCRIPT
from dslurm.slurm.job_array import ArrayPart, array_ids
from dslurm.sweep.spec import SweepSpec, override_text, task_dir_name

MAP_FILE = "sweep.json"
# Flags Slurm takes per array, not per task: the array writes its own log files.
_PER_ARRAY = ("output", "error")


@dataclass(frozen=True, kw_only=True, slots=True)
class Task:
    index: int
    overrides: tuple[tuple[str, Any], ...]
    r: Resolved

    @property
    def label(self) -> str:
        return ", ".join(f"{k}={json.dumps(v)}" for k, v in self.overrides) or "(base)"


@dataclass(frozen=True, kw_only=True, slots=True)
class Sweep:
    spec: SweepSpec
    dir: Path
    tasks: tuple[Task, ...]
    flags: tuple[tuple[str, str | None], ...]
    """the #SBATCH flags every task shares (output/error excluded: the array's own)"""


def sweep_dir(spec: SweepSpec, first: Resolved, base_dir: str | Path) -> Path:
    raw = spec.dir or os.path.join(first.site.storage.durable, spec.name)
    p = Path(os.path.expandvars(os.path.expanduser(raw)))
    return (p if p.is_absolute() else Path(base_dir) / p).resolve()


def task_overrides(spec: SweepSpec, index: int, run_dir: Path | None) -> list[str]:
    own = [override_text(k, v) for k, v in spec.tasks[index]]
    return [*spec.common, *own, *([f"checkpoint.run_dir={run_dir}"] if run_dir else [])]


def _resolve_task(spec: SweepSpec, index: int, run_dir: Path | None, base_dir: str | Path) -> Resolved:
    from dslurm.observe.lead import load

    try:
        return load(spec.site, spec.job, task_overrides(spec, index, run_dir), list(spec.site_common),
                    base_dir=base_dir)
    except UserError as exc:
        what = ", ".join(f"{k}={json.dumps(v)}" for k, v in spec.tasks[index]) or "no overrides"
        raise type(exc)(f"sweep {spec.path}: task {index} ({what}): {exc}") from None


def shared_flags(tasks: list[Task], log_dir: str) -> tuple[tuple[str, str | None], ...]:
    """The #SBATCH flags of the array: every task's must be the same (one array has one set).
    Pure: `render.directives` of each task, compared."""
    from dslurm.render import directives

    def flags(t: Task) -> list[tuple[str, str | None]]:
        return [(k, v) for k, v in directives(t.r, log_dir) if k not in _PER_ARRAY]

    first = flags(tasks[0])
    for t in tasks[1:]:
        mine = flags(t)
        if mine != first:
            a, b = dict(first), dict(mine)
            diff = sorted(k for k in set(a) | set(b) if a.get(k, "-") != b.get(k, "-"))
            shown = "; ".join(f"--{k}: task 0 {a.get(k, '(none)')}, task {t.index} {b.get(k, '(none)')}"
                              for k in diff)
            raise UserError(f"sweep {t.r.job_path}: task {t.index} ({t.label}) needs other #SBATCH flags than "
                            f"task 0 ({shown}); one job array has one set of flags. Fix: sweep only fields that "
                            "keep nodes, time, requeue and signal the same, or make a sweep per setting")
    return tuple(first)


def resolve_sweep(spec: SweepSpec, base_dir: str | Path | None = None) -> Sweep:
    """Every task resolved (validation errors name the task and its field) before anything is
    written or submitted; run directories `<sweep dir>/<index>-<slug>`."""
    base = Path(base_dir or os.getcwd())
    first = _resolve_task(spec, 0, None, base)
    root = sweep_dir(spec, first, base)
    tasks = []
    for i, own in enumerate(spec.tasks):
        run_dir = root / task_dir_name(i, own)
        tasks.append(Task(index=i, overrides=own, r=_resolve_task(spec, i, run_dir, base)))
    return Sweep(spec=spec, dir=root, tasks=tuple(tasks), flags=shared_flags(tasks, str(root / "logs")))


def sweep_map(sw: Sweep) -> dict[str, Any]:
    """What sweep.json holds: task -> overrides -> run directory (`arrays` are added at submit)."""
    return {"sweep": sw.spec.name, "file": sw.spec.path, "site": sw.spec.site, "job": sw.spec.job,
            "max_parallel": sw.spec.max_parallel,
            "tasks": [{"index": t.index, "overrides": dict(t.overrides), "run_dir": str(t.r.run_dir)}
                      for t in sw.tasks]}


def check_map(sw: Sweep, existing: dict[str, Any]) -> None:
    """A sweep directory serves one sweep: its recorded tasks must be these (same index, same
    overrides, same run directory), or a resubmission would resume another task's run."""
    mine = sweep_map(sw)["tasks"]
    theirs = existing.get("tasks", [])
    for a, b in zip(mine, theirs):
        if a != b:
            raise UserError(f"{sw.dir / MAP_FILE}: task {a['index']} was {b.get('overrides')} "
                            f"({b.get('run_dir')}); the sweep file now makes it {a['overrides']}. A sweep directory "
                            "holds one sweep. Fix: restore the sweep file, or give the changed sweep another 'dir'")
    if len(theirs) > len(mine):
        raise UserError(f"{sw.dir / MAP_FILE}: holds {len(theirs)} tasks; the sweep file now has {len(mine)}. "
                        "Fix: restore the sweep file, or give the changed sweep another 'dir'")


LOG_NAME = "%x-%A_%a"  # an array task's Slurm logs in <sweep dir>/logs: job name, array job id, task id


def task_logs(sw: Sweep, array_id: int, array_task: int) -> list[str]:
    """The .out and .err files of one array task (LOG_NAME filled in), for its run's ledger. Pure."""
    name = dict(sw.flags).get("job-name") or sw.tasks[0].r.job.name
    stem = LOG_NAME.replace("%x", str(name)).replace("%A", str(array_id)).replace("%a", str(array_task))
    return [str(sw.dir / "logs" / f"{stem}.{ext}") for ext in ("out", "err")]


def render_array(sw: Sweep, part: ArrayPart, number: int = 1, nparts: int = 1) -> str:
    """The sbatch script of array `number` (of `nparts`) of the sweep. Pure."""
    from dslurm.render import _directive_lines, q

    logs = sw.dir / "logs"
    flags = [*sw.flags, ("array", array_ids(list(part.ids), sw.spec.max_parallel)),
             ("output", f"{logs}/{LOG_NAME}.out"), ("error", f"{logs}/{LOG_NAME}.err")]
    cases = [f"  {t}) RUN_DIR={q(sw.tasks[t].r.run_dir)} ;;  # {sw.tasks[t].label}" for t in part.tasks]
    return "\n".join([
        "#!/bin/bash",
        f"# Generated by dslurm {__version__} from sweep {sw.spec.path}: array {number} of {nparts}, "
        f"{len(part.ids)} task(s). Do not edit: re-render.",
        *_directive_lines(flags),
        "set -euo pipefail",
        "",
        "# The sweep's task: this array's offset + the array task id; its run directory from the map",
        f"# written at submit ({sw.dir / MAP_FILE}). The task runs its own frozen {SCRIPT}: its own",
        "# config, ledger, checkpoints and requeue chain (requeue-me requeues ARRAYJOB_TASK, not the array).",
        f"TASK=$(( {part.offset} + SLURM_ARRAY_TASK_ID ))",
        'case "$TASK" in',
        *cases,
        '  *) echo "dslurm: sweep task $TASK is not in this array" >&2; exit 2 ;;',
        "esac",
        'echo "dslurm: sweep task $TASK (array ${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}) in $RUN_DIR" >&2',
        f'exec bash "$RUN_DIR/{SCRIPT}"',
        "",
    ])
