"""`dslurm submit --sweep` / `dslurm render --sweep`: freeze every task's run directory, write
the sweep map, submit the tasks still to train as `sbatch --array` job(s).

A task whose run already completed at its train.steps is skipped (`dslurm.submission.completed_note`);
the others resume from their checkpoint pointers. A sweep larger than the site's MaxArraySize
is split into several arrays, each after the previous one (afterany), so at most max_parallel
tasks run at once.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dslurm.durable import atomic_write_text
from dslurm.errors import UserError, check_output_file
from dslurm.slurm.job_array import ArrayPart, max_array_size, split_arrays
from dslurm.sweep.build import MAP_FILE, Sweep, check_map, render_array, sweep_map, task_logs


@dataclass(frozen=True, kw_only=True, slots=True)
class SweepSubmission:
    dir: Path
    array_ids: list[int]
    submitted: list[int]
    """sweep task indices submitted"""
    skipped: dict[int, str] = field(default_factory=dict)
    """task index -> why it was not submitted (its run completed)"""
    scripts: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def split_note(sw: Sweep, parts: list[ArrayPart], size: int, source: str) -> str | None:
    if len(parts) < 2:
        return None
    return (f"sweep {sw.spec.name}: {sum(len(p.ids) for p in parts)} tasks exceed the site's {source}: split "
            f"into {len(parts)} arrays of at most {size} tasks, each starting after the previous one ends "
            f"(afterany), so at most {sw.spec.max_parallel or 'all'} run at once")


def read_map(sweep_dir: Path) -> dict[str, Any] | None:
    path = Path(sweep_dir) / MAP_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise UserError(f"{path}: not valid JSON ({exc}). Fix: restore it, or give the sweep another 'dir'") from None
    if not isinstance(data, dict) or not isinstance(data.get("tasks"), list):
        raise UserError(f"{path}: not a dslurm sweep map (no 'tasks' list). Fix: give a sweep directory")
    return data


def write_map(sweep_dir: Path, data: dict[str, Any]) -> None:
    Path(sweep_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(sweep_dir) / MAP_FILE, json.dumps(data, indent=2, default=str) + "\n")


def _active_arrays(recorded: dict[str, Any] | None, env: Mapping[str, str] | None) -> list[str]:
    from dslurm import slurm
    from dslurm.errors import SlurmError

    ids = [a["job_id"] for a in (recorded or {}).get("arrays", []) if isinstance(a, dict) and "job_id" in a]
    if not ids:
        return []
    try:
        jobs = slurm.squeue(job_ids=ids, env=env)
    except SlurmError as exc:
        if "Invalid job id" in str(exc):
            return []  # squeue refuses ids it has forgotten: none active
        raise UserError(f"sweep: cannot tell whether array job(s) {', '.join(map(str, ids))} still run: {exc}. "
                        "Fix: retry once `squeue` answers (a submission now could run tasks twice)") from None
    return sorted({str(j["job_id"]) for j in jobs if j["state"] in ("PENDING", "RUNNING", "CONFIGURING",
                                                                     "REQUEUED", "COMPLETING")})


def refuse_while_running(sw: Sweep, env: Mapping[str, str] | None = None) -> None:
    """No second submission while an array of this sweep is queued or running (its tasks would
    run twice); `dslurm submit --sweep` and `api.sweep` both ask. An squeue that fails is not
    "nothing active": the refusal then says so and asks for a retry."""
    busy = _active_arrays(read_map(sw.dir), env)
    if busy:
        raise UserError(f"sweep {sw.dir}: array job(s) {', '.join(busy)} of this sweep are still queued or "
                        "running; a second submission would run their tasks twice. Fix: wait for them, or "
                        f"scancel {' '.join(busy)}")


def sweep_blocklist(sw: Sweep, tasks: list[int] | None = None) -> list[str]:
    """Nodes any task's burn-in found bad (each run's blocklist.txt): one array has one
    --exclude, and a node bad for one task is bad hardware for all of them."""
    from dslurm.run import read_blocklist

    return sorted({h for t in sw.tasks if tasks is None or t.index in tasks for h in read_blocklist(t.r.run_dir)})


def prepare(sw: Sweep, *, force: bool = False, check_done: bool = True) -> tuple[list[int], dict[int, str]]:
    """Freeze every task's run directory (site.yaml, job.yaml, job.sbatch) and the sweep map;
    return (tasks to submit, skipped task -> why)."""
    from dslurm.submission import completed_note, freeze_and_render

    recorded = read_map(sw.dir)
    if recorded is not None:
        check_map(sw, recorded)
    todo, skipped = [], {}
    for t in sw.tasks:
        note = completed_note(t.r) if check_done and not force else None
        if note:
            skipped[t.index] = note
            continue
        freeze_and_render(t.r)
        todo.append(t.index)
    data = sweep_map(sw)
    data["arrays"] = list((recorded or {}).get("arrays", []))
    (sw.dir / "logs").mkdir(parents=True, exist_ok=True)
    write_map(sw.dir, data)
    return todo, skipped


def submit_sweep(sw: Sweep, *, dry_run: bool = False, force: bool = False,
                 env: Mapping[str, str] | None = None) -> SweepSubmission:
    """Freeze, render and submit the sweep's unfinished tasks as job array(s)."""
    import os
    import time

    from dslurm import slurm
    from dslurm.submission import record_submission

    if not dry_run:
        refuse_while_running(sw, env)
    todo, skipped = prepare(sw, force=force, check_done=not dry_run)
    size, source = max_array_size(env)
    parts = split_arrays(todo, size) if todo else []
    note = split_note(sw, parts, size, source)
    scripts = []
    for n, part in enumerate(parts, 1):
        script = sw.dir / (f"array-{n}.sbatch" if len(parts) > 1 else "array.sbatch")
        script.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(script, render_array(sw, part, n, len(parts)), 0o755)
        scripts.append(script)
    out = SweepSubmission(dir=sw.dir, array_ids=[], submitted=[] if dry_run else todo, skipped=skipped,
                          scripts=scripts, notes=[note] if note else [])
    if dry_run or not parts:
        return out
    data = read_map(sw.dir) or {}
    blocked = sweep_blocklist(sw, todo)
    for part, script in zip(parts, scripts):
        dep = [f"--dependency=afterany:{out.array_ids[-1]}"] if out.array_ids else []
        dep += [f"--exclude={','.join(blocked)}"] if blocked else []
        array_id = slurm.sbatch(script, dep, cwd=os.getcwd(), env=env)
        out.array_ids.append(array_id)
        data.setdefault("arrays", []).append({"job_id": array_id, "offset": part.offset, "tasks": part.tasks,
                                              "script": str(script), "t": time.time()})
        write_map(sw.dir, data)
        for t in part.tasks:
            record_submission(sw.tasks[t].r, [array_id], via=f"sweep {sw.spec.name} task {t}: array "
                                                               f"{array_id}_{t - part.offset}",
                              logs=task_logs(sw, array_id, t - part.offset))
    return out


# ------------------------------------------------------------------------------ CLI


def load_sweep(path: str) -> Sweep:
    from dslurm.sweep.build import resolve_sweep
    from dslurm.sweep.spec import load

    return resolve_sweep(load(path))


def run_submit(args: Any) -> int:
    """`dslurm submit --sweep FILE`."""
    for flag in ("site", "job", "run_dir"):
        if getattr(args, flag, None):
            raise UserError(f"dslurm submit --sweep {args.sweep}: --{flag.replace('_', '-')} cannot go with it (the "
                            "sweep file names its site and job). Fix: drop it")
    if getattr(args, "overrides", None) or getattr(args, "site_overrides", None) or getattr(args, "chain", 1) != 1:
        raise UserError(f"dslurm submit --sweep {args.sweep}: --set/--site-set/--chain cannot go with it. Fix: put "
                        "common overrides under the sweep file's 'set:' or 'site_set:'")
    sw = load_sweep(args.sweep)
    sub = submit_sweep(sw, dry_run=args.dry_run, force=args.force)
    for note in sub.notes:
        print(note, file=sys.stderr)
    for i, why in sorted(sub.skipped.items()):
        print(f"task {i}: skipped: {why}")
    if args.dry_run:
        print(f"dry run: wrote {', '.join(map(str, sub.scripts))} and {sw.dir / MAP_FILE} (not submitted)")
        return 0
    if not sub.array_ids:
        print(f"sweep {sw.dir}: every task's run already completed; nothing submitted")
        return 0
    print(f"submitted sweep {sw.spec.name}: array job {','.join(map(str, sub.array_ids))} "
          f"({len(sub.submitted)} task(s): {','.join(map(str, sub.submitted))})")
    print(f"  sweep dir: {sw.dir}")
    print(f"  logs     : {sw.dir}/logs/{sw.tasks[0].r.job.name}-<arrayjob>_<task>.out|.err")
    return 0


def run_render(args: Any) -> int:
    """`dslurm render --sweep FILE`: the array script(s) on stdout (nothing written)."""
    sw = load_sweep(args.sweep)
    size, source = max_array_size()
    parts = split_arrays([t.index for t in sw.tasks], size)
    note = split_note(sw, parts, size, source)
    if note:
        print(note, file=sys.stderr)
    text = "\n".join(render_array(sw, p, n, len(parts)) for n, p in enumerate(parts, 1))
    if args.output:
        check_output_file(Path(args.output), "-o", "sweep.sbatch")
        atomic_write_text(Path(args.output), text, 0o755)
        print(f"wrote {args.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0
