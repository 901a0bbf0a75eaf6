"""Check a site and a job together and compute, once, the numbers every link uses.

Node count, processes per node, world size, the resolved parallel degrees, the time
limit, the requeue policy (with the effective signal lead) and the run directory are decided
here and nowhere else: the sbatch renderer, `dslurm submit`, the launcher, the trainer, the
notebook API and `dslurm requeue-me` all read them from a `Resolved`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from dslurm.config import JobSpec, ParallelSpec, SiteConfig, format_time, parse_time
from dslurm.config.envvars import env_warnings
from dslurm.config.layout import Layout, stages_per_rank
from dslurm.config.models import ModelShape
from dslurm.errors import UserError


def check_model_layout(shape: ModelShape, layout: Layout, par: ParallelSpec, where: str = "job") -> None:
    """Layout rules that depend on the model shape and the schedule (before any process group work)."""
    v = stages_per_rank(par.pp_schedule)
    msgs = layout.shape_problems(shape, v) + [m for m in [layout.schedule_problem(v)] if m]
    if msgs:
        raise UserError(f"{where}: field 'parallel': " + "; ".join(msgs) + ". Fix: change the parallel degrees "
                        "(or parallel.microbatches) as stated, or pick a model whose shape they divide")


# Slurm checks time limits about every 30 s and may send the B: signal up to a minute
# early or late relative to the nominal lead, so no measured lead below a minute is trusted.
LEAD_FLOOR_S = 60


@dataclass(frozen=True, slots=True)
class LeadSample:
    """What `requeue.signal_lead: auto` measures in a run: its slowest step and its slowest save,
    in seconds (0: not measured yet). Read from the run's ledger by `dslurm.observe.lead`, which
    passes it to `resolve`: the config, the ground floor, never reads a ledger itself."""

    step_s: float = 0.0
    save_s: float = 0.0


def auto_signal_lead(measured: LeadSample | None, *, default_s: int, floor_s: int = LEAD_FLOOR_S,
                     safety: float = 2.0) -> tuple[int, str]:
    """`requeue.signal_lead: auto`: the warning a stop needs = finish the current step, then
    a synchronous save, times a safety factor, never below the floor. From what this run
    measured (slowest step window, slowest save); the site's default when the run has no
    measurements yet. Returns (seconds, how it was derived). Pure."""
    step_s, save_s = (measured.step_s, measured.save_s) if measured is not None else (0.0, 0.0)
    if step_s == 0.0 and save_s == 0.0:
        return max(default_s, floor_s), f"site default {default_s}s (no measurements in this run yet), floor {floor_s}s"
    need = safety * (step_s + save_s)
    lead = max(floor_s, int(need + 0.999))
    return lead, (f"{safety:g} x (step {step_s:.2f}s + save {save_s:.2f}s) = {need:.1f}s, "
                  f"floor {floor_s}s")


@dataclass(frozen=True, kw_only=True, slots=True)
class RequeuePolicy:
    """The requeue policy of one job, computed once (here) and read by every path: the rendered
    script, `dslurm submit`, the notebook API and `dslurm requeue-me` (from the frozen run config)."""

    enabled: bool
    """requeue on a warned stop or a failure (and render --requeue); false: --no-requeue"""
    lead_setting: int | Literal["auto"]
    """what the job or site asked for"""
    lead_s: int
    """the effective --signal=B:USR2@lead_s"""
    lead_reason: str
    """how lead_s was derived (explicit, site default, or measured with its floor)"""
    max_restarts: int
    """restart budget for failures (crash, node failure, burn-in); preemptions spend none"""
    no_progress_limit: int
    """stop after this many starts without the pointer advancing (0: never)"""
    max_stray_stops: int
    """requeues per job after stray stops (a TERM that reached the job step, not the batch shell,
    while Slurm still ran the job: docs/endings.md); counted apart from max_restarts"""


def requeue_policy(site: SiteConfig, job: JobSpec, measured: LeadSample | None = None) -> RequeuePolicy:
    """The policy from job, site and (for `auto`) what the run measured. Pure; `resolve`
    checks the lead against the time limit."""
    rq = job.requeue
    setting = rq.signal_lead if rq.signal_lead is not None else site.requeue.signal_lead_s
    if setting == "auto":
        lead, how = auto_signal_lead(measured, default_s=site.requeue.signal_lead_s)
        how = f"auto: {how}"
    else:
        lead = int(setting)
        how = "job requeue.signal_lead" if rq.signal_lead is not None else "site requeue.signal_lead_s"
    return RequeuePolicy(
        enabled=site.requeue.enabled if rq.enabled is None else rq.enabled, lead_setting=setting, lead_s=lead,
        lead_reason=how,
        max_restarts=site.requeue.max_restarts if rq.max_restarts is None else rq.max_restarts,
        no_progress_limit=site.requeue.no_progress_limit if rq.no_progress_limit is None else rq.no_progress_limit,
        max_stray_stops=site.requeue.max_stray_stops if rq.max_stray_stops is None else rq.max_stray_stops)


@dataclass(frozen=True, kw_only=True, slots=True)
class Resolved:
    site: SiteConfig
    job: JobSpec
    site_path: str
    job_path: str
    nnodes: int
    procs_per_node: int
    layout: Layout
    time_s: int
    policy: RequeuePolicy
    run_dir: Path
    shape: ModelShape
    """the model: the preset and fields of job.model, or model.init_from's config.json (read once, here)"""

    @property
    def world_size(self) -> int:
        return self.nnodes * self.procs_per_node

    @property
    def spares(self) -> int:
        """spare nodes allocated beyond the training nodes (job.spares)"""
        return self.job.spares

    @property
    def alloc_nodes(self) -> int:
        """whole nodes the script allocates: the training nodes plus the spares"""
        return self.nnodes + self.job.spares

    @property
    def time_str(self) -> str:
        return format_time(self.time_s)


def resolve(site: SiteConfig, job: JobSpec, *, site_path: str = "site", job_path: str = "job",
            base_dir: str | Path | None = None, measured: LeadSample | None = None) -> Resolved:
    """Cross-field checks of site + job; every message names the file, field and numbers. Pure:
    `measured` is what the run measured for `signal_lead: auto` (None: nothing yet, the site's
    default); `dslurm.observe.lead` reads it from the run's ledger for the commands that submit."""
    ppn = job.procs_per_node or site.procs_per_node
    if site.node.gpus and ppn > site.node.gpus:
        raise UserError(f"{job_path}: field 'procs_per_node': {ppn} > GPUs per node ({site.node.gpus}) "
                        f"on site {site.name!r}. Fix: at most {site.node.gpus}")
    world = job.nodes * ppn
    par = job.parallel
    layout = Layout.for_world(
        world, pp=par.pp, dp_replicate=par.dp_replicate, dp_shard=par.dp_shard, cp=par.cp, tp=par.tp,
        microbatches=par.microbatches, where=f"{job_path}: field 'parallel': ",
        fix=f"make the product equal nodes({job.nodes}) x processes per node({ppn}), or set parallel.dp_shard: -1")
    if par.tp > site.node.nvlink_domain and not par.allow_tp_outside_nvlink:
        raise UserError(
            f"{job_path}: field 'parallel.tp': tp({par.tp}) > NVLink domain({site.node.nvlink_domain}) of "
            f"site {site.name!r}: tensor parallel would cross the slow network every layer. Fix: lower tp, "
            f"or set parallel.allow_tp_outside_nvlink: true if you mean it")
    if par.tp > 1 and ppn % par.tp:
        raise UserError(f"{job_path}: field 'parallel.tp': tp({par.tp}) does not divide processes per "
                        f"node({ppn}), so a TP group would span nodes. Fix: pick a divisor of {ppn}")
    shape = job.model.shape()
    check_model_layout(shape, layout, par, job_path)
    layout.micro_batch(job.train.global_batch, job.train.grad_accum, where=f"{job_path}: field 'train.global_batch': ")
    if site.node.gpus == 0 and job.train.dtype == "bf16":
        raise UserError(f"{job_path}: field 'train.dtype': bf16 training needs GPUs; site {site.name!r} has "
                        "none. Fix: dtype: fp32")
    time_s = parse_time(job.time or site.slurm.default_time,
                        f"{job_path}: field 'time'" if job.time else f"{site_path}: field 'slurm.default_time'")
    if job.checkpoint.tiers == "two_tier" and not site.storage.scratch:
        raise UserError(f"{job_path}: field 'checkpoint.tiers': two_tier needs node-local storage, but site "
                        f"{site.name!r} ({site_path}) has no storage.scratch. Fix: set storage.scratch in the site "
                        "(e.g. /local/$USER/%n), or checkpoint.tiers: durable")
    if job.checkpoint.verify_resume == "replay" and par.pp > 1:
        raise UserError(f"{job_path}: field 'checkpoint.verify_resume': replay recomputes a probe loss with one "
                        f"forward of the whole model, which pipeline parallel (pp={par.pp}) splits across ranks. "
                        "Fix: checkpoint.verify_resume: fingerprint, or parallel.pp: 1")
    run_dir = run_dir_for(site, job, base_dir)
    policy = requeue_policy(site, job, measured)
    if not 0 <= policy.lead_s < time_s:
        raise UserError(f"{job_path}: field 'requeue.signal_lead': {policy.lead_s}s ({policy.lead_reason}) must be "
                        f"below the time limit ({time_s}s). Fix: lower the lead or raise the time")
    return Resolved(
        site=site, job=job, site_path=site_path, job_path=job_path, nnodes=job.nodes,
        procs_per_node=ppn, layout=layout, time_s=time_s, policy=policy, run_dir=run_dir,
        shape=shape)


def warnings(r: Resolved) -> list[str]:
    """What is legal but rarely meant, one line each, as `render` and `submit` print them: env
    names that override what Slurm binds (envvars), and a stop warning that takes half the job."""
    out = env_warnings(r.site.env, r.job.env, r.site_path, r.job_path)
    lead, time_s = r.policy.lead_s, r.time_s
    if lead * 2 > time_s:
        out.append(f"warning: {r.job_path}: field 'requeue.signal_lead': the stop warning comes {lead}s before the "
                   f"{time_s}s limit ({r.policy.lead_reason}), so each start trains at most {time_s - lead}s "
                   "before it saves and stops. Fix: raise the job's time, or lower the lead")
    return out


def raw_run_dir(site: SiteConfig, job: JobSpec) -> str:
    """The run directory as written (before `~` and $VARS expand): explicit, else <durable storage>/<job name>."""
    return job.checkpoint.run_dir or os.path.join(site.storage.durable, job.name)


def run_dir_for(site: SiteConfig, job: JobSpec, base_dir: str | Path | None = None) -> Path:
    """The run directory: explicit, else <durable storage>/<job name>. `~` and $VARS expand
    here (not in the shell) so the value is the same on every node."""
    raw = raw_run_dir(site, job)
    p = Path(os.path.expandvars(os.path.expanduser(raw)))
    return p if p.is_absolute() or base_dir is None else Path(base_dir) / p


def load(site_path: str | Path, job_path: str | Path, overrides: list[str] | None = None,
         site_overrides: list[str] | None = None, base_dir: str | Path | None = None,
         measure: Callable[[SiteConfig, JobSpec, str | Path | None], LeadSample | None] | None = None) -> Resolved:
    """Load, override and resolve a site and a job from their files. `measure` (site, job,
    base_dir) -> what the run measured: `dslurm.observe.lead.load` passes the ledger's."""
    from dslurm.config import load_job, load_site

    site = load_site(site_path, site_overrides)
    job = load_job(job_path, overrides)
    measured = measure(site, job, base_dir) if measure is not None else None
    with naming_overrides(overrides, site_overrides):
        return resolve(site, job, site_path=str(site_path), job_path=str(job_path), base_dir=base_dir,
                       measured=measured)


@contextmanager
def naming_overrides(overrides: list[str] | None, site_overrides: list[str] | None) -> Iterator[None]:
    """A cross-field error may come from a value the user typed on the command line, not from
    the file it names: add the overrides in effect to its message."""
    typed = [f"--site-set {o}" for o in site_overrides or ()] + [f"--set {o}" for o in overrides or ()]
    try:
        yield
    except UserError as exc:
        if not typed:
            raise
        raise type(exc)(f"{exc} (overrides in effect: {' '.join(typed)})") from None
