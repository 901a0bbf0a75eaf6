"""The Slurm job array of a sharded tokenization: its script (pure) and its submission.

One array task per shard still to do, `--array=IDS%K`; each runs
`PYTHON -m dslurm.data.task OUT $SLURM_ARRAY_TASK_ID` after the site's setup lines and
environment. Every value that lands in the script goes through `dslurm.render.q`; the setup
lines are the site's own shell and go in as written (as in every dslurm job script).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dslurm.config import SiteConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class ArraySpec:
    out: Path
    tasks: list[int]
    concurrency: int
    time: str
    cpus_per_task: int = 1
    name: str = "dslurm-tokenize"


def array_ids(tasks: list[int], concurrency: int) -> str:
    """`0-2%2` for a run of ids, `1,4%2` otherwise. Pure."""
    if tasks == list(range(tasks[0], tasks[0] + len(tasks))) and len(tasks) > 1:
        ids = f"{tasks[0]}-{tasks[-1]}"
    else:
        ids = ",".join(map(str, tasks))
    return f"{ids}%{concurrency}" if concurrency > 0 else ids


def render_array(site: SiteConfig, spec: ArraySpec) -> str:
    """The sbatch script. Pure."""
    from dslurm.render import _directive_lines, q, words

    logs = spec.out / "logs"
    flags: list[tuple[str, str | None]] = [
        ("job-name", spec.name), ("array", array_ids(spec.tasks, spec.concurrency)),
        ("nodes", "1"), ("ntasks", "1"), ("cpus-per-task", str(spec.cpus_per_task)),
        ("time", spec.time), ("no-requeue", None),
    ]
    for name in ("partition", "account", "qos", "constraint"):
        value = getattr(site.slurm, name)
        if value:
            flags.append((name, value))
    flags += [("output", f"{logs}/%x-%A_%a.out"), ("error", f"{logs}/%x-%A_%a.err")]
    lines = ["#!/bin/bash", *_directive_lines(flags), "set -euo pipefail",
             "# dslurm data tokenize: one shard per array task (docs/data.md)"]
    lines += [f"export {k}={q(v)}" for k, v in site.env.items()]
    lines += [f"export TOKENIZERS_PARALLELISM={q('true')}", *site.setup]
    argv = [*site.python_argv, "-m", "dslurm.data.task", str(spec.out)]
    lines.append(f'exec {words(argv)} "$SLURM_ARRAY_TASK_ID"')
    return "\n".join(lines) + "\n"


def submit_array(site: SiteConfig, spec: ArraySpec, *, wait: bool) -> tuple[int, int]:
    """Write the script into OUT (durably) and sbatch it; (job id, sbatch's exit code).

    With `wait`, `sbatch --wait` returns when every task has ended (its exit code is non-zero
    when one failed); the caller then reads the shards, not the code.
    """
    from dslurm import slurm
    from dslurm.durable import atomic_write_text
    from dslurm.errors import SlurmError

    (spec.out / "logs").mkdir(parents=True, exist_ok=True)
    script = spec.out / "tokenize.sbatch"
    atomic_write_text(script, render_array(site, spec), mode=0o755)
    cmd = ["sbatch", "--parsable", *(["--wait"] if wait else []), str(script)]
    proc = slurm.run_cmd(cmd, timeout=7 * 24 * 3600 if wait else 60, check=not wait)
    if wait and not proc.stdout.strip():
        raise SlurmError(slurm.failure_message(cmd, proc.returncode, proc.stderr, proc.stdout))
    return slurm.parse_parsable_job_id(proc.stdout), proc.returncode
