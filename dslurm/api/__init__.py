"""A small Python API for notebooks: submit a dslurm job through submitit, or run it here.

    from dslurm import api
    job = api.submit("examples/jobs/tiny-2node.yaml", site="site-configs/local.yaml",
                     overrides=["train.steps=10"])
    summary = job.result()      # RunSummary(final_step=10, final_loss=..., goodput=..., ...)
    summary = api.run_local("examples/jobs/tiny-2node.yaml", site="site-configs/local.yaml")

Nothing is decided twice. The site and job are validated and resolved by dslurm.config and
dslurm.config.resolve; the Slurm flags are dslurm.render.directives, renamed for submitit by
`executor_parameters`; inside the allocation every submitit task runs dslurm.launch.launch
(dslurm/api/job.py), like the `srun ... dslurm launch` line of a rendered script. submitit is
imported only when a function here needs it, so `import dslurm` stays light.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from dslurm.config import JobSpec, SiteConfig
from dslurm.config.resolve import Resolved
from dslurm.errors import UserError
from dslurm.run import RunDir

if TYPE_CHECKING:
    import submitit

    from dslurm.api.job import RunSummary
    from dslurm.remote.proxy import RemoteRun

JobLike = Union[JobSpec, dict[str, Any], str, Path]
SiteLike = Union[SiteConfig, dict[str, Any], str, Path]

# directives() flags that submitit has its own parameters for. It needs them by name:
# `nodes` x `ntasks_per_node` is how many task results job.result() waits for.
_NATIVE = {"job-name": "job_name", "nodes": "nodes", "ntasks-per-node": "ntasks_per_node"}
# submitit writes these itself: its own log files (job.stdout()/stderr() read them), appended.
_SUBMITIT_OWNS = {"output", "error", "open-mode"}
ACCOUNTING_FIX = ("Fix: on the built-in cluster run `dslurm cluster up --accounting`; on a real "
                  "cluster ask the admins for slurmdbd accounting (AccountingStorageType="
                  "accounting_storage/slurmdbd), or use `dslurm submit` instead of the API")


# ------------------------------------------------------------------------ inputs


def load_inputs(job: JobLike, site: SiteLike, overrides: list[str] | None = None,
                site_overrides: list[str] | None = None) -> Resolved:
    """Validate and resolve a job and a site given as objects, dicts or YAML paths."""
    from dslurm.config import load_job, load_site
    from dslurm.config.resolve import naming_overrides
    from dslurm.config.schema import to_dict
    from dslurm.observe.lead import resolve

    if isinstance(site, (str, Path)):
        site_obj, site_path = load_site(site, site_overrides), str(site)
    else:
        data = to_dict(site) if isinstance(site, SiteConfig) else dict(site)
        site_obj, site_path = load_site(data=data, overrides=site_overrides), "site"
    if isinstance(job, (str, Path)):
        job_obj, job_path = load_job(job, overrides), str(job)
    else:
        job_obj = load_job(data=to_dict(job) if isinstance(job, JobSpec) else dict(job), overrides=overrides)
        job_path = "job"
    with naming_overrides(overrides, site_overrides):
        return resolve(site_obj, job_obj, site_path=site_path, job_path=job_path, base_dir=os.getcwd())


def executor_parameters(r: Resolved, exclude: list[str] | None = None) -> dict[str, Any]:
    """submitit `SlurmExecutor.update_parameters` kwargs for the flags of dslurm.render.directives.

    Two translations, both because submitit runs the Python process in every task itself:
    - `--signal=B:USR2@LEAD` becomes `--signal=USR2@LEAD` (submitit's `signal_delay_s`): the
      signal must reach every task, not the batch shell, which in submitit's script forwards
      nothing. The signal is USR2 in both.
    - `--time` goes to submitit as whole minutes: it also uses it to tell a time-out from a
      preemption. `--output/--error/--open-mode` are submitit's (its own log paths).
    srun gets `--kill-on-bad-exit=1` and `--cpus-per-task` like the rendered script's srun line
    (Slurm 22.05's srun no longer inherits --cpus-per-task from sbatch).
    """
    from dslurm.render import directives

    params: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    for key, value in directives(r, log_dir="unused"):
        if key in _NATIVE:
            params[_NATIVE[key]] = value if key == "job-name" else int(str(value))
        elif key == "time":  # typed values from the Resolved, never the rendered text parsed back
            params["time"] = math.ceil(r.time_s / 60)
        elif key == "signal":
            params["signal_delay_s"] = r.policy.lead_s
        elif key not in _SUBMITIT_OWNS:
            extra[key] = True if value is None else value
    params["additional_parameters"] = extra
    params["srun_args"] = ["--kill-on-bad-exit=1", f"--cpus-per-task={extra['cpus-per-task']}"]
    params["setup"] = list(r.site.setup)
    if exclude:
        params["exclude"] = ",".join(exclude)
    return params


def check_accounting() -> None:
    """submitit follows jobs with `sacct`; without accounting, job.result() would wait forever
    on a job that died before writing its result. Fail now, with the fix."""
    from dslurm import slurm

    res = slurm.run_cmd(["sacct", "-n", "-X", "-P", "-S", "now", "-o", "JobID"], check=False, timeout=20)
    if res.returncode != 0:
        reason = (res.stderr or res.stdout).strip() or f"exit {res.returncode}"
        raise UserError(f"`sacct` does not work here ({reason}); submitit needs it to follow jobs. "
                        + ACCOUNTING_FIX)


# ------------------------------------------------------------------------ submit


def _job_class() -> type:
    """A SlurmJob whose result() waits for every task and returns task 0's summary."""
    from submitit.core.utils import FailedJobError
    from submitit.slurm.slurm import SlurmJob

    class DslurmJob(SlurmJob):  # type: ignore[type-arg]  # generic in the result type only
        def result(self) -> Any:
            """Task 0's RunSummary; a task that failed raises its remote traceback (the first
            real failure wins over tasks that srun killed because of it)."""
            if not self._sub_jobs:
                return super().result()
            self.wait()
            first = self._sub_jobs[0].exception()
            if first is None:
                return self._sub_jobs[0].result()
            failures = [first] + [e for e in (j.exception() for j in self._sub_jobs[1:]) if e is not None]
            raise next((e for e in failures if isinstance(e, FailedJobError)), first)

    return DslurmJob


def submit(job: JobLike, *, site: SiteLike, overrides: list[str] | None = None,
           site_overrides: list[str] | None = None, folder: str | Path | None = None,
           force: bool = False, code: str | None = None) -> submitit.Job[RunSummary] | RemoteRun:
    """Submit `job` to Slurm through submitit; `job.result()` returns a RunSummary.

    The site and job are frozen into the run directory (like `dslurm submit`), so a requeue
    re-reads exactly them; `folder` (default `<run_dir>/submitit/%j`) holds submitit's
    pickles and per-task logs. A run directory whose run already completed at the job's
    train.steps is not submitted again (UserError saying so) unless `force`.

    A site with `login:` (docs/remote.md) submits over ssh like `dslurm submit` does: the code
    snapshot (`code`: `git`, the default, or a directory) runs on the cluster, and the result
    is a RemoteRun (`.status()`, `.report()`, `.run_dir`: the local handle).
    """
    r = load_inputs(job, site, overrides, site_overrides)
    if r.site.login is not None:
        from dslurm.remote import proxy
        from dslurm.remote.snapshot import take

        got = proxy.submit(r, take(code or "git"), cwd=os.getcwd(), force=force)
        if got.note:
            raise UserError(f"{r.site.login}: {got.note.replace('use --force', 'pass force=True')}")
        return proxy.RemoteRun(got.handle)
    return _submit_submitit(r, folder, force)


def _submit_submitit(r: Resolved, folder: str | Path | None, force: bool) -> submitit.Job[RunSummary]:
    import submitit

    from dslurm.api.job import TrainTask
    from dslurm.run import read_blocklist
    from dslurm.submission import completed_note, freeze_and_render, record_submission

    if not force and (note := completed_note(r)) is not None:
        raise UserError(note.replace("use --force", "pass force=True"))
    if r.site.container is not None:  # submitit's srun starts its pickled task with this Python, on the host
        raise UserError(f"{r.site_path}: field 'container': api.submit cannot run the job in the site's "
                        f"{r.site.container.runtime} container yet (submitit starts each task outside it). "
                        "Fix: submit with `dslurm submit`, whose script runs the launcher in the container")
    check_accounting()
    freeze_and_render(r)
    executor = submitit.SlurmExecutor(folder=str(folder or r.run_dir / "submitit" / "%j"),
                                      max_num_timeout=r.policy.max_restarts)
    executor.job_class = _job_class()  # type: ignore[assignment]
    executor.update_parameters(**executor_parameters(r, exclude=read_blocklist(r.run_dir)))
    rd = RunDir(r.run_dir)
    sub = executor.submit(TrainTask(str(rd.site_yaml), str(rd.job_yaml)))
    record_submission(r, [int(sub.job_id)], via="api")
    sub.run_dir = r.run_dir  # type: ignore[attr-defined]  # handy in a notebook
    return sub


# ------------------------------------------------------------------------- sweep


def sweep(job: str | Path, *, site: str | Path, grid: dict[str, list[Any]] | None = None,
          tasks: list[dict[str, Any]] | None = None, max_parallel: int = 0, overrides: list[str] | None = None,
          site_overrides: list[str] | None = None, dir: str | Path | None = None, name: str | None = None,
          force: bool = False) -> list[submitit.Job[RunSummary]]:
    """Submit a sweep (docs/sweeps.md) through submitit as job array(s); returns one job per
    task submitted, in task order (`job.sweep_task`, `job.run_dir`; `job.result()` is its RunSummary).

    The sweep is resolved and submitted like `dslurm submit --sweep` (dslurm.sweep: every task
    validated before anything is submitted, run directories `<dir>/<index>-<overrides>`, the sweep
    map; refused while an array of the sweep is still queued or running; split into arrays of at
    most the site's MaxArraySize tasks, each after the previous one; every task's blocklist
    excluded); each task runs the same TrainTask as `submit`, from its own frozen config. Tasks
    whose run completed are not submitted again unless `force`."""
    import submitit

    from dslurm.api.job import TrainTask
    from dslurm.slurm.job_array import max_array_size, split_arrays
    from dslurm.submission import record_submission
    from dslurm.sweep.build import resolve_sweep
    from dslurm.sweep.spec import parse
    from dslurm.sweep.submit import (
        prepare,
        read_map,
        refuse_while_running,
        split_note,
        sweep_blocklist,
        write_map,
    )

    data: dict[str, Any] = {"site": str(site), "job": str(job), "max_parallel": max_parallel,
                            "set": list(overrides or []), "site_set": list(site_overrides or [])}
    data.update({k: v for k, v in (("grid", grid), ("tasks", tasks), ("dir", None if dir is None else str(dir)),
                                    ("name", name or f"{Path(job).stem}-sweep")) if v is not None})
    sw = resolve_sweep(parse(data, f"api.sweep({Path(job).name})"))
    first = sw.tasks[0].r
    if first.site.container is not None:
        raise UserError(f"{first.site_path}: field 'container': api.sweep cannot run tasks in the site's container "
                        "yet (submitit starts each task outside it). Fix: `dslurm submit --sweep`")
    check_accounting()
    refuse_while_running(sw)
    todo, _skipped = prepare(sw, force=force)
    if not todo:
        return []
    size, source = max_array_size()
    parts = split_arrays(todo, size)
    if (note := split_note(sw, parts, size, source)) is not None:
        print(note, file=sys.stderr)
    executor = submitit.SlurmExecutor(folder=str(sw.dir / "submitit" / "%j"), max_num_timeout=first.policy.max_restarts)
    executor.job_class = _job_class()  # type: ignore[assignment]
    params = executor_parameters(first, exclude=sweep_blocklist(sw, todo))
    out: list[submitit.Job[RunSummary]] = []
    array_ids: list[int] = []
    for part in parts:
        extra = dict(params["additional_parameters"])
        if array_ids:  # each array after the previous one, as `dslurm submit --sweep` (afterany)
            extra["dependency"] = f"afterany:{array_ids[-1]}"
        executor.update_parameters(**{**params, "additional_parameters": extra},
                                   array_parallelism=max_parallel or len(part.tasks))
        with executor.batch():
            rds = [RunDir(sw.tasks[i].r.run_dir) for i in part.tasks]
            jobs = [executor.submit(TrainTask(str(rd.site_yaml), str(rd.job_yaml))) for rd in rds]
        array_id = int(str(jobs[0].job_id).split("_")[0])
        array_ids.append(array_id)
        record = read_map(sw.dir) or {}
        record.setdefault("arrays", []).append({"job_id": array_id, "offset": part.offset, "tasks": part.tasks,
                                                "via": "api"})
        write_map(sw.dir, record)
        for i, j in zip(part.tasks, jobs):
            record_submission(sw.tasks[i].r, [array_id], via=f"api sweep {sw.spec.name} task {i}: array {j.job_id}",
                              logs=[str(j.paths.stdout), str(j.paths.stderr)])
            j.sweep_task, j.run_dir = i, sw.tasks[i].r.run_dir  # type: ignore[attr-defined]  # handy in a notebook
        out += jobs
    return out


# --------------------------------------------------------------------- run_local


def run_local(job: JobLike, *, site: SiteLike, nproc: int | None = None, overrides: list[str] | None = None,
              site_overrides: list[str] | None = None) -> RunSummary:
    """Run the job on this machine without Slurm: torchrun with `nproc` processes (default:
    the job's world size, so the layout and the losses match the Slurm run), through the
    same dslurm.launch.launch. The output goes to `<run_dir>/logs/local-<id>.log`."""
    from dslurm import exitcodes as X
    from dslurm.api.job import TrainerFailed, launch_keeping_handlers, output_tail, summarize, trainer_argv
    from dslurm.observe import events
    from dslurm.submission import freeze_and_render

    r = load_inputs(job, site, overrides, site_overrides)
    freeze_and_render(r)
    # An outer allocation's SLURM_* (a notebook on a compute node) must not leak into derive().
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    env.update({**_one_node_env(), **_job_env(r)})
    rd = RunDir(r.run_dir)
    log = rd.logs / f"{env['SLURM_JOB_ID']}.log"
    with _output_to(log):
        rc = launch_keeping_handlers(trainer_argv(r, str(rd.site_yaml), str(rd.job_yaml)),
                                     mode="torchrun", nproc_per_node=nproc or r.world_size, env=env)
    if rc == X.OK:
        return summarize(events.read(r.run_dir), env["SLURM_JOB_ID"], r.run_dir, ["localhost"])
    what = "stopped on a signal after saving; run it again to resume" if rc == X.REQUEUE else "failed"
    raise TrainerFailed(f"the local run exited {rc} ({what}); log {log}:\n{output_tail(log)}")


def _job_env(r: Resolved) -> dict[str, str]:
    from dslurm.api.job import job_env

    return job_env(r)


def _one_node_env() -> dict[str, str]:
    """What dslurm.launch.slurm_env.derive reads, for a one-node "allocation" on this machine: the
    launcher and the rank math stay the ones a Slurm job uses."""
    from dslurm.launch.slurm_env import local_job_id

    return {"SLURM_JOB_ID": local_job_id(os.getpid()), "SLURM_JOB_NODELIST": "localhost",
            "SLURM_NNODES": "1", "SLURM_NODEID": "0", "SLURM_RESTART_COUNT": "0"}


@contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """Send this process's fds 1 and 2 (inherited by the trainers) to a file: a notebook
    kernel's own fds go to its terminal, where nobody reads them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for f in (fd, *saved):
            os.close(f)
