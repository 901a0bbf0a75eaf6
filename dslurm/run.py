"""A run directory's files, with one owner (as submitit's `JobPaths` owns a job folder).

Every name under a run directory is spelled here: the frozen config (`site.yaml`, `job.yaml`,
`job.sbatch`), the blocklist, the per-start facts (`starts/`), the ledger, the operator's
request files, the logs, the code snapshots (`code/`), the trackers' run ids, the burn-in
reports. `RunDir(path)` hands them out as paths and loads the frozen config back, as the
`(site, job)` pair or as a `Resolved`. The checkpoint generations and the pointer are the
checkpoint protocol's own (dslurm/checkpoint/).

Torch-free and light: it sits just above the config, so every link (submit, the burn-in gate,
requeue-me, the in-allocation recovery, the API, the trainer) can read a run through here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dslurm.durable import atomic_write_text

if TYPE_CHECKING:
    from dslurm.config import JobSpec, SiteConfig
    from dslurm.config.resolve import Resolved

SITE = "site.yaml"
"""the site config as submitted (overrides applied): every start of the run reads this copy"""
JOB = "job.yaml"
"""the job spec as submitted, checkpoint.run_dir made absolute"""
SCRIPT = "job.sbatch"
"""the rendered batch script; a requeued job runs it again"""
FROZEN = (SITE, JOB, SCRIPT)
BLOCKLIST = "blocklist.txt"
"""nodes the run's burn-in (or its recovery) found bad; later submissions of the run --exclude them"""
LEDGER = "ledger.jsonl"
"""the run's events, one JSON line each (dslurm/observe/ledger.py)"""
STARTS = "starts"
"""one directory of facts per start: starts/<job_id>.<restart>[.<step>]/ (dslurm/endings/facts.py)"""
CTL_REQUEST, CTL_TAKEN, CTL_STALE = "ctl_request.json", "ctl_taken.json", "ctl_stale.json"
"""`dslurm ctl RUN save|stop|profile`: the request waiting for rank 0, the one it took, and one it
set aside as written for another start"""
CTL_TAKER = "ctl_taker.json"
"""who takes `dslurm ctl` requests here, written by rank 0 when it starts polling (the built-in
trainer or a `dslurm.runtime` script: the actions it takes, its start, host, pid, time): what
`dslurm ctl` needs of a run started by hand (`torchrun -m train ...` in an salloc), with no job.yaml"""
LOGS = "logs"
"""the jobs' --output/--error files (Slurm does not create the directory)"""
CODE = "code"
"""code snapshots a job runs (`--code`): code/<digest>/"""
CODE_CURRENT = "CURRENT"
"""code/CURRENT: the snapshot directory name the run's script runs"""
TRACKERS = "trackers.json"
"""one run id per tracker, so every start of the run feeds the same tracker run"""
PACKAGES = "packages.json"
"""the Python packages the last start ran with (name -> version), so the next names what changed"""
PREFLIGHT = "preflight"
"""the burn-in's reports: preflight/burnin-<job_id>-r<restart>.json"""
PROFILES = "profiles"
"""the trainer's profiles: profiles/<start>/steps-K-L/ (train/profile.py)"""
DATA = "data"
"""the synthetic corpora the trainer writes when a job names no data (train/data.py)"""


@dataclass(frozen=True)
class RunDir:
    """One run directory and the path of each file in it."""

    path: Path

    def __init__(self, path: str | Path) -> None:
        object.__setattr__(self, "path", Path(path))

    @property
    def site_yaml(self) -> Path:
        return self.path / SITE

    @property
    def job_yaml(self) -> Path:
        return self.path / JOB

    @property
    def script(self) -> Path:
        return self.path / SCRIPT

    @property
    def blocklist(self) -> Path:
        return self.path / BLOCKLIST

    @property
    def ledger(self) -> Path:
        return self.path / LEDGER

    @property
    def starts(self) -> Path:
        return self.path / STARTS

    @property
    def ctl_request(self) -> Path:
        return self.path / CTL_REQUEST

    @property
    def ctl_taken(self) -> Path:
        return self.path / CTL_TAKEN

    @property
    def ctl_stale(self) -> Path:
        return self.path / CTL_STALE

    @property
    def ctl_taker(self) -> Path:
        return self.path / CTL_TAKER

    @property
    def logs(self) -> Path:
        return self.path / LOGS

    @property
    def code(self) -> Path:
        return self.path / CODE

    @property
    def code_current(self) -> Path:
        return self.path / CODE / CODE_CURRENT

    @property
    def profiles(self) -> Path:
        return self.path / PROFILES

    @property
    def data(self) -> Path:
        return self.path / DATA

    @property
    def trackers(self) -> Path:
        return self.path / TRACKERS

    def burnin_report(self, job_id: str, restart: int) -> Path:
        return self.path / PREFLIGHT / f"burnin-{job_id}-r{restart}.json"

    def is_run(self) -> bool:
        """Whether `dslurm submit` froze a run here (its job.yaml exists)."""
        return self.job_yaml.is_file()

    def config(self) -> tuple[SiteConfig, JobSpec]:
        """(site, job) as `dslurm submit` froze them; a missing or bad file is a UserError naming it."""
        from dslurm.config import load_job, load_site

        return load_site(self.site_yaml), load_job(self.job_yaml)

    def frozen(self) -> tuple[SiteConfig, JobSpec] | None:
        """(site, job) as `dslurm submit` froze them; None when no run was frozen here."""
        return self.config() if self.is_run() else None

    def resolved(self, overrides: list[str] | None = None) -> Resolved:
        """The frozen config resolved, as every start of the run sees it (no ledger is read:
        an `auto` lead is the site default here; `dslurm.observe.lead` measures it at submit)."""
        from dslurm.config.resolve import load

        return load(self.site_yaml, self.job_yaml, overrides)

    def read_blocklist(self) -> list[str]:
        try:
            lines = self.blocklist.read_text().split()
        except FileNotFoundError:
            return []
        return sorted(set(lines))

    def add_to_blocklist(self, hosts: list[str]) -> list[str]:
        """Merge hosts into the run's blocklist atomically; return the whole list."""
        merged = sorted(set(self.read_blocklist()) | set(hosts))
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.blocklist, "\n".join(merged) + "\n")
        return merged


def read_blocklist(run_dir: Path) -> list[str]:
    return RunDir(run_dir).read_blocklist()


def add_to_blocklist(run_dir: Path, hosts: list[str]) -> list[str]:
    """Merge hosts into the run's blocklist atomically; return the whole list."""
    return RunDir(run_dir).add_to_blocklist(hosts)
