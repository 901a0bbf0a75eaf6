"""Which names a site's or a job's `env` may set (pure; site.py and job.py check with it).

Why: `env` is exported at the top of the job script, before dslurm's own lines and before the
launcher, so `SLURM_JOB_ID=1` there would make `requeue-me` requeue another job, `DSLURM_*` would
be dropped or fight dslurm's own values (DSLURM_RUN_DIR is written after it), and the rendezvous
variables torchrun and the launcher set per process (RANK, MASTER_ADDR, ...) would be overwritten
or ignored depending on who runs last. These are refused. `PATH` and `CUDA_VISIBLE_DEVICES` are
legal but rarely right (a PATH without the site's setup, devices Slurm already bound), so they
get a warning.
"""

from __future__ import annotations

import re

from dslurm.config.schema import FieldError

RESERVED_PREFIXES = ("SLURM_", "DSLURM_", "TORCHELASTIC_")
# The DSLURM_* names that are inputs a job may give (dslurm reads them, never sets them): the
# fault-injection knobs (dslurm/faults.py), the GPU device files of docs/site.md, the DCP reader
# switch (checkpoint/compat.py) and the burn-in's pseudo-nodes (preflight/run.py).
INPUTS = frozenset({"DSLURM_GPU_DEVICES", "DSLURM_DCP_PUBLIC", "DSLURM_PSEUDO_NODES"})
INPUT_PREFIXES = ("DSLURM_FAULT_",)
# What the launcher (dslurm/launch, torchrun) sets for each process or node.
LAUNCHER_SETS = frozenset({
    "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
    "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "NODE_RANK",
})
WARNED = {
    "PATH": "it replaces the job's PATH before the site's setup lines run; prefer a setup line "
            "(export PATH=/my/bin:$PATH) so nothing the site put there is lost",
    "CUDA_VISIBLE_DEVICES": "Slurm and the launcher already bind each process to its GPUs; a fixed list "
                            "overrides that on every node",
}


def reserved_why(name: str) -> str | None:
    """Why `name` may not be set in `env`, or None when it may."""
    if name in INPUTS or name.startswith(INPUT_PREFIXES):
        return None
    prefix = next((p for p in RESERVED_PREFIXES if name.startswith(p)), None)
    if prefix == "SLURM_":
        return "Slurm sets SLURM_* for each job; dslurm reads them (a job id set here would requeue another job)"
    if prefix is not None:
        return (f"{prefix}* are dslurm's and torchrun's own, set by the job script and the launcher "
                f"(the inputs a job may set: {', '.join(sorted(INPUTS))}, DSLURM_FAULT_*)")
    if name in LAUNCHER_SETS:
        return "the launcher sets it for each process (rendezvous and ranks)"
    return None


def warnings(env: dict[str, str], where: str) -> list[str]:
    """One line per legal but suspicious name in `env` (`where`: e.g. "job.yaml: field 'env'")."""
    return [f"{where}: {name}: {why}" for name, why in WARNED.items() if name in env]


def check_env(env: dict[str, str]) -> None:
    """An `env` section's names: valid, and none that Slurm, dslurm or the launcher set (envvars)."""
    for key in env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise FieldError("env", f"{key!r} is not a valid environment variable name",
                             "use letters, digits and '_', not starting with a digit")
        why = reserved_why(key)
        if why is not None:
            raise FieldError(f"env.{key}", f"{key} is reserved: {why}",
                             f"remove env.{key}; to pass a value to your script use a name of your own")


def env_warnings(site_env: dict[str, str], job_env: dict[str, str], site_path: str, job_path: str) -> list[str]:
    """The warnings of a site's and a job's env, as `render` and `submit` print them."""
    return [f"warning: {w}" for w in warnings(site_env, f"{site_path}: field 'env'")
            + warnings(job_env, f"{job_path}: field 'env'")]
