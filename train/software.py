"""This start's software, probed where torch lives (rank 0 writes it: `start_env`, issue 53), and
the site's refusal of named versions (`site.refuse.nccl`), checked by every rank before any
process-group work. The torch-free parts (packages, git, variables, what changed) are in
dslurm/observe/software.py."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path

import torch

from dslurm.config.resolve import Resolved
from dslurm.errors import UserError
from dslurm.observe import events, software


def nccl_version() -> str | None:
    """The NCCL torch was built with ("2.21.5"); None without CUDA (this CPU build) or NCCL."""
    if not torch.cuda.is_available():
        return None
    try:
        v = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]
    except (RuntimeError, AttributeError):
        return None
    return ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)


def driver_version() -> str | None:
    """The NVIDIA driver (nvidia-smi), None where there is none."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.stdout.strip().splitlines()[:1]
    return first[0].strip() if out.returncode == 0 and first else None


def refuse(resolved: Resolved) -> None:
    """Exit 2 (UserError) when the site refuses this start's NCCL (`site.refuse.nccl`)."""
    version = nccl_version()
    entry = resolved.site.refuse.refused_nccl(version)
    if entry is not None:
        raise UserError(f"{resolved.site_path}: refuse.nccl: this start runs NCCL {version}, which the site refuses "
                        f"({entry!r}). Fix: run an image or torch with another NCCL, or take {entry!r} out of "
                        "refuse.nccl if the site has cleared it")


def start_env(resolved: Resolved, step: int, run_dir: Path) -> events.StartEnv:
    """This start's software (rank 0; also rewrites <run_dir>/packages.json for the next start)."""
    cuda = torch.cuda.is_available()
    container = resolved.site.container
    image = container.image if container is not None else None
    sha, dirty = software.code_identity(Path(__file__).resolve().parent)
    count, changed = software.packages_since_last(run_dir)
    return events.StartEnv(
        step=step, torch=torch.__version__, cuda=torch.version.cuda, nccl=nccl_version(),
        driver=driver_version() if cuda else None, gpu=torch.cuda.get_device_name(0) if cuda else None,
        image=image, image_digest=software.image_digest(image), code_sha=sha, code_dirty=dirty,
        python=platform.python_version(), packages=count, packages_changed=changed,
        nodes=software.nodes_from_env(os.environ), env=software.env_vars(os.environ))
