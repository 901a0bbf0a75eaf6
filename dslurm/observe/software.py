"""The software of every start, on record, and what changed between starts (issue 53).

A requeued start can land on nodes with another driver, NCCL or container image, or run code a
resubmit changed; when the loss jumps at start 4, the ledger should say what changed there. Rank 0
of the trainer writes one `start_env` event per start (train/software.py probes torch, CUDA, NCCL,
the GPU and driver); this module holds what needs no torch: the installed packages (and the
file, `<run_dir>/packages.json`, the next start compares against), the code's git identity, the
NCCL_*/TORCH_* variables, and `changes` / `change_lines`, which `dslurm report` and `dslurm
doctor` print. Everything but the probes is pure.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from dslurm.durable import atomic_write_text
from dslurm.observe import events as ev
from dslurm.run import PACKAGES

log = logging.getLogger(__name__)
ENV_PREFIXES = ("NCCL_", "TORCH_")
FIELDS = ("torch", "cuda", "nccl", "driver", "gpu", "image", "image_digest", "python")
"""the versions compared one by one between starts"""


def installed() -> dict[str, str]:
    """Installed distributions, name (normalized) -> version."""
    out = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").strip().lower().replace("_", "-")
        if name:
            out[name] = dist.version
    return dict(sorted(out.items()))


def package_changes(before: Mapping[str, str], now: Mapping[str, str]) -> dict[str, list[str | None]]:
    """name -> [before or None, now or None] for every package added, removed or changed. Pure."""
    return {n: [before.get(n), now.get(n)] for n in sorted(set(before) | set(now)) if before.get(n) != now.get(n)}


def packages_since_last(run_dir: Path) -> tuple[int, dict[str, list[str | None]]]:
    """(installed count, changes since the previous start's packages.json); the file is rewritten
    for the next start. A run's first start (no file) has no changes."""
    now = installed()
    path = run_dir / PACKAGES
    try:
        before = json.loads(path.read_text())
        changed = package_changes(before, now) if isinstance(before, dict) else {}
    except (OSError, ValueError):
        changed = {}
    try:
        atomic_write_text(path, json.dumps(now, indent=0, sort_keys=True) + "\n")
    except OSError as exc:  # the next start names no change: said, not fatal
        log.warning("could not write %s: %s", path, exc)
    return len(now), changed


def env_vars(environ: Mapping[str, str]) -> dict[str, str]:
    """The NCCL_* and TORCH_* variables. Pure."""
    return {k: v for k, v in sorted(environ.items()) if k.startswith(ENV_PREFIXES)}


def code_identity(root: Path) -> tuple[str | None, bool | None]:
    """(git commit, uncommitted changes) of the checkout holding `root`; (None, None) outside git."""
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10)
        if sha.returncode != 0:
            return None, None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() or None, bool(dirty.stdout.strip()) if dirty.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None, None


def image_digest(image: str | None) -> str | None:
    """The digest an image reference names (`repo@sha256:...`, enroot's `repo#img@sha256:...`). Pure."""
    if image and "@sha256:" in image:
        return "sha256:" + image.split("@sha256:", 1)[1]
    return None


def nodes_from_env(environ: Mapping[str, str]) -> list[str]:
    from dslurm.slurm.hosts import expand_hosts

    nodelist = environ.get("SLURM_JOB_NODELIST")
    if not nodelist:
        return [os.uname().nodename]
    try:
        return expand_hosts(nodelist)
    except Exception:  # a list this code cannot expand is still on record as written
        return [nodelist]


# ------------------------------------------------------------------ what changed (pure)


def _short(value: Any) -> str:
    if value is None:
        return "none"
    text = str(value)
    return text[:12] if len(text) == 40 and all(c in "0123456789abcdef" for c in text) else text


def changes(before: ev.StartEnv, now: ev.StartEnv) -> list[str]:
    """What differs between two starts' software, one phrase each. Pure."""
    out = [f"{f} {_short(getattr(before, f))} -> {_short(getattr(now, f))}"
           for f in FIELDS if getattr(before, f) != getattr(now, f)]
    if (before.code_sha, before.code_dirty) != (now.code_sha, now.code_dirty):
        out.append(f"code {_short(before.code_sha)}{' (dirty)' if before.code_dirty else ''} -> "
                   f"{_short(now.code_sha)}{' (dirty)' if now.code_dirty else ''}")
    if now.packages_changed:
        names = [f"{n} {a or 'none'} -> {b or 'none'}" for n, (a, b) in list(now.packages_changed.items())[:4]]
        more = len(now.packages_changed) - len(names)
        out.append("packages: " + ", ".join(names) + (f" (+{more} more)" if more > 0 else ""))
    if set(before.nodes) != set(now.nodes):
        gone, new = sorted(set(before.nodes) - set(now.nodes)), sorted(set(now.nodes) - set(before.nodes))
        out.append("nodes" + (f" -{','.join(gone)}" if gone else "") + (f" +{','.join(new)}" if new else ""))
    for k in sorted(set(before.env) | set(now.env)):
        if before.env.get(k) != now.env.get(k):
            out.append(f"{k} {before.env.get(k, 'unset')} -> {now.env.get(k, 'unset')}")
    return out


def change_lines(events: Sequence[ev.Event]) -> list[str]:
    """One line per start whose software differs from the start before it, with the step it
    resumed from (where a change shows on the curves). Pure."""
    envs = list(ev.of(events, ev.StartEnv))
    out = []
    for i in range(1, len(envs)):
        diff = changes(envs[i - 1], envs[i])
        if diff:
            out.append(f"software changed at start {i + 1} of {len(envs)} (from step {envs[i].step}): "
                       + "; ".join(diff))
    if envs:
        last = envs[-1]
        out.insert(0, f"software (last start): torch {last.torch or '?'}, CUDA {last.cuda or 'none'}, NCCL "
                      f"{last.nccl or 'none'}, driver {last.driver or 'none'}, GPU {last.gpu or 'none'}, image "
                      f"{last.image or 'none'}, code {_short(last.code_sha)}{' (dirty)' if last.code_dirty else ''}")
    return out
