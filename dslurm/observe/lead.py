"""`requeue.signal_lead: auto`, measured: the run's slowest step and slowest save, read from its
ledger, for the commands that render or submit a job (`dslurm submit`, `render`, a sweep, the
notebook API). The policy itself is computed in `dslurm.config.resolve` (one home), which never
reads a ledger: the config sits on the ground floor, the ledger above it, so the ledger's
numbers are passed down as a `LeadSample`.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dslurm.config import JobSpec, SiteConfig
from dslurm.config.resolve import LeadSample, Resolved, run_dir_for
from dslurm.config.resolve import load as load_config
from dslurm.config.resolve import resolve as resolve_config
from dslurm.observe import events as ev


def sample(history: Iterable[ev.Event]) -> LeadSample:
    """The slowest step window and the slowest save of a run's events (0 for what is missing). Pure."""
    history = list(history)
    return LeadSample(step_s=max((e.step_time_s or 0.0 for e in ev.of(history, ev.Steps)), default=0.0),
                      save_s=max((e.total_s or e.stall_s for e in ev.of(history, ev.CkptSave)), default=0.0))


def measured(site: SiteConfig, job: JobSpec, base_dir: str | Path | None = None) -> LeadSample | None:
    """What the run directory's ledger measured, when the lead is `auto` (None otherwise: an
    explicit lead needs no measurement, and none is read)."""
    setting = job.requeue.signal_lead if job.requeue.signal_lead is not None else site.requeue.signal_lead_s
    if setting != "auto":
        return None
    return sample(ev.read(run_dir_for(site, job, base_dir)))


def resolve(site: SiteConfig, job: JobSpec, **kw: Any) -> Resolved:
    """`config.resolve.resolve` with what the run measured for an `auto` lead."""
    return resolve_config(site, job, measured=measured(site, job, kw.get("base_dir")), **kw)


def load(site_path: str | Path, job_path: str | Path, overrides: list[str] | None = None,
         site_overrides: list[str] | None = None, base_dir: str | Path | None = None) -> Resolved:
    """`config.resolve.load` with what the run measured for an `auto` lead."""
    return load_config(site_path, job_path, overrides, site_overrides, base_dir, measure=measured)
