"""The one validated config tree: a site (the cluster) and a job (what to run on it).

`load_site` / `load_job` read YAML and return frozen-in-spirit dataclasses; `resolve`
checks the two together and computes the numbers every later link uses (nodes,
processes per node, world size, the parallel layout), once.

The tree's dataclasses live by half: site.py (`SiteConfig` and its sections), training.py (the
sections the trainer is built from: model, parallel, train, data, checkpoint) and job.py
(`JobSpec` and its other sections). This module loads them (the checks that need a whole site
or job), parses and formats Slurm times, and re-exports every name of the tree: import them from
`dslurm.config`.
"""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path
from typing import Any

from dslurm.config.job import HealthSpec, JobSpec, MetricsSpec, PreflightSpec, RecoverySpec, RequeueSpec
from dslurm.config.schema import Where, apply_overrides, build, load_yaml
from dslurm.config.site import (
    BurninSpec,
    NetworkSpec,
    NodeSpec,
    RemoteSpec,
    SiteConfig,
    SiteRecoverySpec,
    SiteRequeueSpec,
    SlurmSpec,
    StorageSpec,
)
from dslurm.config.training import CheckpointSpec, DataSpec, ModelSpec, ParallelSpec, SourceSpec, TrainSpec
from dslurm.errors import UserError

__all__ = [
    "BurninSpec", "CheckpointSpec", "DataSpec", "HealthSpec", "JobSpec", "MetricsSpec", "ModelSpec", "NetworkSpec",
    "NodeSpec", "ParallelSpec", "PreflightSpec", "RecoverySpec", "RemoteSpec", "RequeueSpec", "SiteConfig",
    "SiteRecoverySpec", "SiteRequeueSpec", "SlurmSpec", "SourceSpec", "StorageSpec", "TrainSpec", "format_time",
    "load_job", "load_site", "parse_time",
]


def _check_site_values(site: SiteConfig, where: Where) -> None:
    """Values that land in #SBATCH lines or `export` lines must be single-line and sane."""
    directive_values = {
        "slurm.partition": site.slurm.partition, "slurm.account": site.slurm.account,
        "slurm.qos": site.slurm.qos, "slurm.gres_name": site.slurm.gres_name,
        "slurm.constraint": site.slurm.constraint, "slurm.log_dir": site.slurm.log_dir,
    }
    for name, value in directive_values.items():
        if value is not None and (not value.strip() or any(c in value for c in "\n\r\t\0 ")):
            raise _at(where, name).fail(f"{value!r} must be one non-empty word without spaces or newlines",
                                        "use the name Slurm shows for it")
    for i, line in enumerate(site.setup):
        if "\0" in line or "\n" in line:
            raise _at(where, f"setup.{i}").fail("one shell line per list item, no newlines",
                                                "split it into several list items")
    try:
        words = site.python_argv
    except ValueError as exc:  # shlex: unbalanced quotes
        raise where.child("python").fail(f"{site.python!r} is not a command line ({exc})",
                                         "write the interpreter and its arguments as you would in a shell, "
                                         "e.g. python3 -X dev") from None
    if not words or any(c in site.python for c in "\n\r\0"):
        raise where.child("python").fail(f"{site.python!r} names no interpreter",
                                         "give the interpreter, e.g. python3 or /opt/venv/bin/python -X dev")
    parse_time(site.slurm.default_time, _at(where, "slurm.default_time").label())
    _check_remote(site, where)


def _check_remote(site: SiteConfig, where: Where) -> None:
    """`login` becomes an ssh argument and `remote.*` words of a remote shell line: one safe word each."""
    rem = site.remote
    if site.login is None:
        return
    if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.@:%+-]*", site.login):
        raise where.child("login").fail(f"{site.login!r} is not an ssh host alias",
                                        "give the Host name of your ssh config, e.g. mycluster or me@login1")
    if rem.workdir is None or not rem.workdir.startswith("/") or any(c in rem.workdir for c in "\n\r\0"):
        raise _at(where, "remote.workdir").fail(
            f"{'is not set' if rem.workdir is None else repr(rem.workdir) + ' is not absolute'}; with `login` "
            "it must be an absolute path on the cluster",
            "add remote.workdir: the directory on the cluster that holds your runs, e.g. /scratch/me/runs")
    try:
        words = shlex.split(rem.dslurm)
    except ValueError as exc:
        words = []
        why = str(exc)
    else:
        why = "names no command"
    if not words or any(c in rem.dslurm for c in "\n\r\0"):
        raise _at(where, "remote.dslurm").fail(f"{rem.dslurm!r} {why}",
                                               "give the command, e.g. dslurm or /opt/venv/bin/dslurm")


def _at(where: Where, dotted: str) -> Where:
    for part in dotted.split("."):
        where = where.child(part)
    return where


def load_site(path: str | Path | None = None, overrides: list[str] | None = None,
              data: dict[str, Any] | None = None) -> SiteConfig:
    """Read and validate a site config from a YAML file (or a dict), with `--site-set` overrides."""
    source = str(path) if path is not None else "site"
    raw = load_yaml(path) if path is not None else dict(data or {})
    data, origins = apply_overrides(raw, overrides or [], "--site-set")
    where = Where(source, origins=origins)
    site = build(SiteConfig, data, where)
    _check_site_values(site, where)
    return site


def load_job(path: str | Path | None = None, overrides: list[str] | None = None,
             data: dict[str, Any] | None = None) -> JobSpec:
    """Read and validate a job spec from a YAML file (or a dict), with `--set` overrides."""
    source = str(path) if path is not None else "job"
    raw = load_yaml(path) if path is not None else dict(data or {})
    raw, origins = apply_overrides(raw, overrides or [])
    where = Where(source, origins=origins)
    job = build(JobSpec, raw, where)
    if job.time is not None:
        parse_time(job.time, where.child("time").label())
    try:
        shape = job.model.shape()  # with model.init_from: its config.json
    except UserError as exc:
        raise UserError(f"{source}: {exc}") from None
    problems = shape.problems()
    if problems:
        raise where.child("model").fail(
            f"{'; '.join(problems)} (preset {job.model.preset!r} with the fields set here)",
            "choose model fields that divide as stated, or remove the overrides to keep the preset's shape")
    return job


_TIME_FORMS = re.compile(
    r"(?:(?P<d>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?)"  # D-H[:M[:S]]
    r"|(?P<h>\d+):(?P<hm>\d+):(?P<hs>\d+)"  # H:M:S
    r"|(?P<m>\d+)(?::(?P<ms>\d+))?"  # M[:S]
)


def parse_time(value: str, where: str = "time") -> int:
    """Slurm time limit -> seconds. Accepts M, M:S, H:M:S, D-H, D-H:M, D-H:M:S."""
    m = _TIME_FORMS.fullmatch(value.strip()) if isinstance(value, str) else None
    if not m:
        raise UserError(f"{where}: {value!r} is not a Slurm time. Fix: use MM, HH:MM:SS or D-HH:MM:SS, "
                        "e.g. 00:30:00")
    g = {k: int(v) if v else 0 for k, v in m.groupdict().items()}
    seconds = (g["d"] * 86400 + g["dh"] * 3600 + g["dm"] * 60 + g["ds"]
               + g["h"] * 3600 + g["hm"] * 60 + g["hs"] + g["m"] * 60 + g["ms"])
    if seconds <= 0:
        raise UserError(f"{where}: {value!r} is zero. Fix: give a positive time limit")
    return seconds


def format_time(seconds: int) -> str:
    """Seconds -> Slurm's D-HH:MM:SS (rounded up to whole minutes: Slurm's granularity)."""
    minutes = math.ceil(seconds / 60)
    d, rem = divmod(minutes, 1440)
    h, mi = divmod(rem, 60)
    return f"{d}-{h:02d}:{mi:02d}:00" if d else f"{h:02d}:{mi:02d}:00"
