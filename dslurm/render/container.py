"""The site's container as command words. Pure: argv lists, quoted by the renderer.

What runs inside and what stays outside:
- inside: `dslurm launch` on every node, and with it the burn-in (`--preflight`: torch, NVML,
  NCCL) and every training process torchrun (or srun mode) starts: all that imports torch.
- outside: the batch shell with the site setup, `dslurm requeue-me` and `dslurm supervise`. They
  are torch-free and call scontrol, sacct and srun, which reach slurmctld through the host's
  Slurm install and munge socket; images carry neither.

Apptainer/Singularity wrap the launcher: `apptainer exec --nv --bind .. --pwd .. IMAGE python -m
dslurm launch ..`. Pyxis is a SPANK plugin: its flags go on the srun that starts the launcher
(`srun --container-image=.. --container-mounts=.. --container-workdir=..`), and only there.

Bound automatically, each at the same path inside, because the in-job parts read or write them:
the submit dir (the batch shell's working directory: relative config paths, `python -m train` from
the checkout), the run dir when absolute (ledger, facts, checkpoints, frozen configs; a relative
one is inside the submit dir), the directory of an absolute `data.path`, and for two-tier
checkpoints the fixed part of `storage.scratch` (up to its first `%n`, `$VAR` or `~`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from dslurm.config.container import APPTAINER_FAMILY, ContainerSpec, bindable
from dslurm.config.resolve import Resolved
from dslurm.errors import UserError

# The batch shell's working directory (the submit dir). Known only where the job runs: the
# renderer writes it as "$PWD"; `dslurm supervise`, already there, puts in its own cwd (`with_cwd`).
# NUL cannot occur in a value that reaches a script (render._one_line refuses it).
PWD = "\0PWD\0"


def _fixed_prefix(template: str) -> str | None:
    """The leading directories of a path template that are the same on every node."""
    kept: list[str] = []
    for part in template.split("/"):
        if any(c in part for c in "%$~"):
            break
        kept.append(part)
    path = "/".join(kept).rstrip("/")
    return path if path.startswith("/") else None


def auto_paths(r: Resolved) -> list[str]:
    """Host paths bound into the container at the same path (see the module docstring)."""
    paths = [PWD]
    if r.run_dir.is_absolute():
        paths.append(str(r.run_dir))
    if r.job.data.path and r.job.data.path.startswith("/"):
        paths.append(os.path.dirname(os.path.normpath(r.job.data.path)) or "/")
    if r.job.checkpoint.tiers == "two_tier" and r.site.storage.scratch:
        root = _fixed_prefix(r.site.storage.scratch)
        if root:
            paths.append(root)
    paths = [p for p in dict.fromkeys(paths) if p != "/"]  # never the host's root over the image's
    runtime = r.site.container.runtime if r.site.container else "apptainer"
    for p in paths:
        need = None if p == PWD else bindable(runtime, p)
        if need:
            raise UserError(f"{r.site_path}: field 'container': {p!r} (the run dir, data dir or scratch) is bound "
                            f"into the container, and {runtime} binds only a path {need}. "
                            "Fix: move the run dir (checkpoint.run_dir), data.path or storage.scratch to such a path")
    return paths


def exec_prefix(c: ContainerSpec, paths: Sequence[str]) -> list[str]:
    """`apptainer exec ... IMAGE`: the words before the launcher's `python -m dslurm launch`."""
    argv = [c.runtime, "exec", *(["--nv"] if c.nv is not False else [])]
    argv += ["--pwd", PWD]  # relative config paths and `python -m train` resolve as in the submit dir
    for p in paths:
        argv += ["--bind", f"{p}:{p}"]
    for spec in c.binds:
        argv += ["--bind", spec]
    for key, value in c.env.items():
        argv += ["--env", f"{key}={value}"]
    return [*argv, c.image]


def srun_flags(c: ContainerSpec, paths: Sequence[str]) -> list[str]:
    """Pyxis flags for the srun that starts the launcher. One --container-mounts: pyxis keeps
    only the last one given."""
    mounts = [f"{p}:{p}" for p in paths] + list(c.mounts)
    return [f"--container-image={c.image}", f"--container-mounts={','.join(mounts)}",
            f"--container-workdir={c.workdir or PWD}"]


def launcher_prefix(r: Resolved) -> list[str]:
    """Words before the launcher command: apptainer/singularity exec, or nothing."""
    c = r.site.container
    return exec_prefix(c, auto_paths(r)) if c is not None and c.runtime in APPTAINER_FAMILY else []


def srun_container_flags(r: Resolved) -> list[str]:
    """Flags for the srun that starts the launcher: pyxis's, or nothing."""
    c = r.site.container
    return srun_flags(c, auto_paths(r)) if c is not None and c.runtime == "pyxis" else []


def with_cwd(argv: Sequence[str], cwd: str) -> list[str]:
    """The words with the submit dir filled in (for a caller that runs in the batch shell's cwd)."""
    return [w.replace(PWD, cwd) for w in argv]
