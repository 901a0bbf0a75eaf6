"""The Slurm job array of a sharded tokenization: its script (pure) and its submission.

One array task per shard still to do, `--array=IDS%K`; each runs
`PYTHON -m dslurm.data.task OUT $SLURM_ARRAY_TASK_ID OFFSET` (shard = offset + id) after the
site's setup lines and environment. More shards than the site's MaxArraySize are cut into
several arrays as sweeps are (`dslurm.slurm.job_array.split_arrays`: array k holds shards
k*size + id), each after the previous one (`--dependency=afterany`), so %K still bounds the
tasks running at once. `--cpus-per-task` N gives each task N CPUs and N encode threads
(RAYON_NUM_THREADS, the `tokenizers` pool). Every value that lands in the script goes through
`dslurm.render.q`; the setup lines are the site's own shell and go in as written (as in every
dslurm job script).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from dslurm.config import SiteConfig
from dslurm.slurm.job_array import array_ids, max_array_size, split_arrays


@dataclass(frozen=True, kw_only=True, slots=True)
class ArraySpec:
    out: Path
    tasks: list[int]
    concurrency: int
    time: str
    cpus_per_task: int = 1
    name: str = "dslurm-tokenize"
    offset: int = 0
    """shard = offset + $SLURM_ARRAY_TASK_ID (one part of a split array); `tasks` are the ids"""


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
    lines += [f"export TOKENIZERS_PARALLELISM={q('true')}",
              f"export RAYON_NUM_THREADS={q(str(spec.cpus_per_task))}", *site.setup]
    argv = [*site.python_argv, "-m", "dslurm.data.task", str(spec.out)]
    lines.append(f'exec {words(argv)} "$SLURM_ARRAY_TASK_ID" {q(str(spec.offset))}')
    return "\n".join(lines) + "\n"


def array_parts(spec: ArraySpec, max_array_size: int) -> list[ArraySpec]:
    """The array jobs of `spec.tasks` (shard numbers) under MaxArraySize: each part's ids and
    offset (shard = offset + id), as sweeps split theirs. Pure."""
    return [replace(spec, tasks=list(p.ids), offset=p.offset) for p in split_arrays(spec.tasks, max_array_size)]


def submit_array(site: SiteConfig, spec: ArraySpec, *, wait: bool,
                 env: Mapping[str, str] | None = None) -> tuple[list[int], int]:
    """Write the script(s) into OUT (durably) and sbatch them; (job ids, the last sbatch's code).

    The shards in `spec.tasks` are split at the site's MaxArraySize; each array after the first
    depends (afterany) on the one before. With `wait`, `sbatch --wait` on the last returns when
    every task of every array has ended (non-zero when one failed); the caller then reads the
    shards, not the code.
    """
    from dslurm import slurm
    from dslurm.durable import atomic_write_text
    from dslurm.errors import SlurmError

    (spec.out / "logs").mkdir(parents=True, exist_ok=True)
    parts = array_parts(spec, max_array_size(env)[0])
    ids: list[int] = []
    rc = 0
    for n, part in enumerate(parts):
        name = "tokenize.sbatch" if len(parts) == 1 else f"tokenize-{n + 1}.sbatch"
        script = spec.out / name
        atomic_write_text(script, render_array(site, part), mode=0o755)
        last = n == len(parts) - 1
        cmd = ["sbatch", "--parsable", *(["--wait"] if wait and last else []),
               *([f"--dependency=afterany:{ids[-1]}"] if ids else []), str(script)]
        proc = slurm.run_cmd(cmd, timeout=7 * 24 * 3600 if wait and last else 60, check=not (wait and last))
        if wait and last and not proc.stdout.strip():
            raise SlurmError(slurm.failure_message(cmd, proc.returncode, proc.stderr, proc.stdout))
        ids.append(slurm.parse_parsable_job_id(proc.stdout))
        rc = proc.returncode
    return ids, rc
