"""Whether a run's warm restarts are on (`recovery.warm: auto`, the default), and the one record
that can prove them on a site: the warm row of `dslurm site check`.

The record lives beside the site file (`SITE.yaml` -> `SITE.warm-check.json`): the site check writes
it each time its warm row is decided (a forced crash, then a warm attempt that reached its first
step with the cold attempt's devices: dslurm/site/jobs.py), and every submit of a job on that site
file reads it. It names the site's digest (every field but `recovery`): a site file edited since its
check, or overridden at submit (`--site-set`), is not the site that was proven.

The choice, in order: the job's `recovery.warm: true|false`; else the site's `recovery.warm:
true|false` (the site says so); else the record's row (ok: warm; fail or skip: cold); no record:
cold. Without spares there is no recovery inside the allocation, so nothing to warm. Submit freezes
the choice into the run's job.yaml (true or false) and writes it with its reason in the submit event;
`dslurm report` shows it.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dslurm.config import JobSpec, SiteConfig

SUFFIX = ".warm-check.json"


@dataclass(frozen=True, slots=True)
class Choice:
    warm: bool
    reason: str


def record_path(site_path: str | Path) -> Path:
    p = Path(site_path)
    return p.with_name(p.stem + SUFFIX)


def site_digest(site: SiteConfig) -> str:
    """The proven site: every field but `recovery` (which only says what to do with the proof)."""
    from dslurm.config.schema import to_dict

    data = to_dict(site)
    data.pop("recovery", None)
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def write_record(site_path: str | Path, site: SiteConfig, status: str, detail: str, job: str | None) -> Path:
    from dslurm.durable import atomic_write_text

    path = record_path(site_path)
    atomic_write_text(path, json.dumps({"site": site.name, "digest": site_digest(site), "status": status,
                                        "detail": detail, "job": job, "t": round(time.time(), 3)}, indent=1) + "\n")
    return path


def read_record(site_path: str | Path) -> dict[str, Any] | None:
    """The record beside the site file, or None (none, unreadable, not a record)."""
    try:
        rec = json.loads(record_path(site_path).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and "status" in rec and "digest" in rec else None


def choose(job: JobSpec, site: SiteConfig, record: dict[str, Any] | None, site_path: str = "the site") -> Choice:
    """Warm or cold, and why. Pure."""
    if not job.spares:
        return Choice(False, "no spares: no recovery inside the allocation")
    if isinstance(job.recovery.warm, bool):
        return Choice(job.recovery.warm, f"the job sets recovery.warm: {str(job.recovery.warm).lower()}")
    if isinstance(site.recovery.warm, bool):
        return Choice(site.recovery.warm, f"site {site.name!r} sets recovery.warm: {str(site.recovery.warm).lower()}")
    where = record_path(site_path).name
    if record is None:
        return Choice(False, f"no warm restart proven on site {site.name!r}: no {where}; run `dslurm site check "
                      f"{site_path}` on the cluster, or set recovery.warm in the site")
    if record.get("digest") != site_digest(site):
        return Choice(False, f"{where} checked another version of site {site.name!r} (edited or overridden "
                      "since): run `dslurm site check` again")
    when = time.strftime("%Y-%m-%d", time.gmtime(float(record.get("t") or 0)))
    if record.get("status") == "ok":
        return Choice(True, f"`dslurm site check` proved a warm restart on site {site.name!r} ({when}, "
                      f"job {record.get('job')})")
    return Choice(False, f"`dslurm site check` did not prove a warm restart on site {site.name!r} ({when}: "
                  f"{record.get('status')}: {str(record.get('detail'))[:200]})")


def choice_for(job: JobSpec, site: SiteConfig, site_path: str) -> Choice:
    """`choose` with the record beside `site_path` (a frozen run's site.yaml has none: its job.yaml
    holds the choice made at submit)."""
    return choose(job, site, read_record(site_path), site_path)
