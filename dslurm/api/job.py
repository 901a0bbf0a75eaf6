"""The remote half of the notebook API: what runs inside each submitit task, and the
summary it returns.

One submitit task runs per node (torchrun mode) or per training process (srun mode),
exactly like the `srun ... dslurm launch` line of a rendered script. Each task calls
`dslurm.launch.launch`, which derives ranks from SLURM_* (`dslurm.launch.slurm_env.derive`),
starts the trainer in its own process group and forwards USR2/TERM to it.

Requeue (see docs/notebook.md): Slurm's USR2 reaches every task while `launch` is running,
so the launcher's forwarding handler -- not submitit's -- gets it and the trainers save at
a step boundary and exit 75. Only then does global rank 0 hand the signal to submitit's
own handler, which calls `TrainTask.checkpoint()`, rewrites the job pickle and runs
`scontrol requeue`. Requeuing any earlier would kill the trainers mid-save.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import submitit

from dslurm import exitcodes as X
from dslurm.config.resolve import Resolved
from dslurm.errors import UserError
from dslurm.launch import FORWARDED, launch, reset_stop
from dslurm.observe.events import Event
from dslurm.run import RunDir


class TrainerFailed(RuntimeError):
    """The trainer exited with an error; the message carries its own error output."""


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """What `job.result()` (and `run_local`) returns, read back from the run's ledger."""

    job_id: str
    run_dir: str
    final_step: int
    final_loss: float | None
    losses: list[tuple[int, float]] = field(default_factory=list)
    """(step reached, mean loss of the window) for every logged window of this job"""
    hosts: list[str] = field(default_factory=list)
    """host of each global rank (the trainer's last `stragglers` event)"""
    nodes: list[str] = field(default_factory=list)
    """the allocation's nodes, in node-rank order (from dslurm.launch.slurm_env.derive)"""
    restarts: int = 0
    lost_steps: int = 0
    """steps trained but not saved before a stop, trained again after the restart"""
    train_s: float = 0.0
    """productive training time (steps that were kept)"""
    wall_s: float = 0.0
    goodput: float | None = None
    """train_s / wall_s, as `dslurm report` defines them"""


# ------------------------------------------------------------------ shared helpers


def job_env(r: Resolved) -> dict[str, str]:
    """The environment the rendered script exports (site env, job env, DSLURM_*), taken from
    the renderer itself so the two paths cannot drift apart."""
    from dslurm.render import job_env as rendered_env

    return rendered_env(r)


def trainer_argv(r: Resolved, site_file: str, job_file: str) -> list[str]:
    """`python -m ENTRY --site S --job J`, as the rendered script runs it. The interpreter is
    this one: it already imports dslurm, and the site's `python` may only be on PATH after
    the batch script's setup lines."""
    from dslurm.render import RenderRefs, trainer_args

    argv = trainer_args(r, RenderRefs(site=site_file, job=job_file))
    return [sys.executable, *argv[len(r.site.python_argv):]]


def launch_keeping_handlers(cmd: list[str], **kwargs: Any) -> int:
    """`launch` installs forwarding handlers for USR2/TERM and leaves them behind; put the
    previous ones (submitit's, or a notebook kernel's) back when it returns."""
    saved = {sig: signal.getsignal(sig) for sig in FORWARDED}
    reset_stop()  # a stop that ended an earlier run in this process is not this run's
    try:
        return launch(cmd, **kwargs)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def summarize(history: Iterable[Event], job_id: str, run_dir: str | Path,
              nodes: list[str] | None = None) -> RunSummary:
    """RunSummary from ledger events; only the events of `job_id` count (a run directory
    keeps the events of every earlier job that trained in it). Goodput, wall time, lost steps
    and restarts are `dslurm report`'s (dslurm.observe.report.summarize). Pure."""
    from dslurm.observe.events import Steps, Stragglers, Submit, of
    from dslurm.observe.report import summarize as report

    evs = [e for e in history if e.job_id == str(job_id)
           or (isinstance(e, Submit) and str(job_id) in map(str, e.job_ids))]
    rep = report(evs)
    steps = [e for e in of(evs, Steps) if e.last is not None and e.loss is not None]
    hosts = [e.hosts for e in of(evs, Stragglers) if e.hosts]
    return RunSummary(
        job_id=str(job_id), run_dir=str(run_dir), final_step=int(rep.final_step or 0),
        final_loss=float(steps[-1].loss) if steps and steps[-1].loss is not None else None,
        losses=[(int(e.last) + 1, float(e.loss)) for e in steps if e.last is not None and e.loss is not None],
        hosts=list(hosts[-1]) if hosts else [], nodes=list(nodes or []), restarts=rep.restarts,
        lost_steps=rep.lost_steps, train_s=round(rep.productive_s, 3), wall_s=round(rep.wall_s, 3),
        goodput=None if rep.goodput is None else round(rep.goodput, 4))


def output_tail(path: Path, offset: int = 0, lines: int = 40) -> str:
    """The error lines and the tail of a log written since `offset`: enough to see why a
    trainer failed without torchrun's long failure report burying the trainer's message."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            text = fh.read().decode(errors="replace").splitlines()
    except OSError:
        return f"(no log at {path})"
    errors = [ln for ln in text if ln.lstrip().startswith(("error:", "[rank")) and "error" in ln.lower()]
    tail = text[-lines:]
    head = [ln for ln in errors[:10] if ln not in tail]
    return "\n".join([*head, *(["..."] if head else []), *tail])


# --------------------------------------------------------------------- the task


class TrainTask(submitit.helpers.Checkpointable):
    """The submitted callable: one per submitit task. It holds only the paths of the site
    and job frozen into the run directory, so a requeued task re-reads exactly those."""

    def __init__(self, site_file: str, job_file: str) -> None:
        self.site_file = site_file
        self.job_file = job_file

    def __call__(self) -> RunSummary:
        from dslurm.config.resolve import load
        from dslurm.launch.slurm_env import derive

        r = load(self.site_file, self.job_file)
        env = {**os.environ, **job_env(r)}
        info = derive(env, nproc_per_node=r.procs_per_node, mode=r.job.launch)
        # Read submitit's USR2 handler before launch replaces it: it is how rank 0 requeues.
        submitit_usr2 = signal.getsignal(signal.SIGUSR2)
        if r.job.preflight.enabled:  # run by the trainer processes first (dslurm/preflight/in_job.py)
            from dslurm.preflight.in_job import preflight_env

            env.update(preflight_env(env, self.site_file, info.job_id, info.restart_count))
        log = Path(submitit.JobEnvironment().paths.stderr)
        offset = log.stat().st_size if log.exists() else 0
        rc = self._stopped_before_training()
        if rc is None:
            rc = launch_keeping_handlers(trainer_argv(r, self.site_file, self.job_file),
                                         mode=r.job.launch, nproc_per_node=r.procs_per_node, env=env)
        if rc == X.OK:
            from dslurm.observe import events

            return summarize(events.read(r.run_dir), info.job_id, r.run_dir, info.hosts)
        if rc == X.PREFLIGHT_FAILED:
            raise TrainerFailed(f"the burn-in failed; bad nodes are in {RunDir(r.run_dir).blocklist} and the next "
                                "dslurm.api.submit of this run excludes them. Fix: resubmit")
        if rc == X.REQUEUE:
            self._requeue(r, env, submitit_usr2)
        if rc == X.TERMINATED:
            # TERM: scancel, preemption or `scontrol requeue`. Slurm decides what comes next;
            # a result file now would end job.result() although the job may come back.
            raise SystemExit(rc)
        self._retry_failure(r, env, rc, submitit_usr2, log, offset)
        raise TrainerFailed(f"the trainer exited {rc} ({X.NAMES.get(rc, 'failed')}) on {info.hostname} "
                            f"(node {info.node_rank}); its output:\n{output_tail(log, offset)}")

    def checkpoint(self, *args: Any, **kwargs: Any) -> submitit.helpers.DelayedSubmission:
        """Called by submitit on rank 0 before it requeues. The model state is already in the
        run directory (the trainers saved before exiting 75), and the trainer resumes from its
        pointer: resubmitting this same small callable is all a restart needs."""
        return submitit.helpers.DelayedSubmission(self, *args, **kwargs)

    @staticmethod
    def _stopped_before_training() -> int | None:
        """A stop that came during the burn-in: do not start training (as `dslurm launch`)."""
        from dslurm import launch as launcher

        if launcher.STOP_SIGNAL is None:
            return None
        return X.TERMINATED if launcher.STOP_SIGNAL == "SIGTERM" else X.REQUEUE

    def _requeue(self, r: Resolved, env: Mapping[str, str], submitit_usr2: Any) -> None:
        """Trainers saved and asked for a requeue. Rank 0 applies dslurm's policy (restart
        budget, no-progress guard) and lets submitit requeue; the others wait to be ended."""
        rank = int(env.get("SLURM_PROCID", "0"))
        if rank != 0:
            _wait_for_requeue()
        if not r.policy.enabled:
            raise TrainerFailed("saved on a stop signal; requeue is off for this job (requeue.enabled), "
                                "so it ends here. Fix: submit it again to resume from the checkpoint")
        decision = _decide(r, env)
        if decision.action != "requeue":
            raise TrainerFailed(f"saved on a stop signal, but not requeued: {decision.reason}")
        if not callable(submitit_usr2):
            raise TrainerFailed("saved on a stop signal, but submitit's requeue handler is missing")
        submitit_usr2(signal.SIGUSR2, None)  # checkpoint() + scontrol requeue + sys.exit
        raise TrainerFailed("submitit did not requeue the job (see the log above)")


    def _retry_failure(self, r: Resolved, env: Mapping[str, str], rc: int, submitit_usr2: Any, log: Path,
                       offset: int) -> None:
        """A start that failed: retried as `dslurm requeue-me` would (issue 38: submitit alone
        retries timeouts and preemptions, never a crash). Rank 0 classifies the ending from the
        recorded facts, records it (the restart budget counts it) and decides with the run's
        policy; a requeue goes through submitit's own handler (checkpoint() + scontrol requeue).
        The other tasks wait for that, or for rank 0's failure to end the step
        (--kill-on-bad-exit). Returns when the failure is not retried (the caller raises)."""
        if int(env.get("SLURM_PROCID", "0")) != 0:
            _wait_for_requeue()
        from dslurm.endings import FAILURES
        from dslurm.requeue import Accounting, classify_this_start, conclude

        acct = Accounting(env)
        ending, d = classify_this_start(r.run_dir, rc, env, acct)
        if ending.cls not in FAILURES:
            return  # a save failure, user error, refusal, divergence: a retry cannot help
        # recorded and decided as requeue-me does (the budget counts it); acted on here, through submitit
        dec = conclude(r.run_dir, d, ending, rc, env, acct, act=lambda *_: None)
        if dec.action != "requeue" or not callable(submitit_usr2):
            raise TrainerFailed(f"{ending.reason}; not retried: {dec.reason}; its output:\n{output_tail(log, offset)}")
        submitit_usr2(signal.SIGUSR2, None)  # checkpoint() + scontrol requeue + sys.exit
        raise TrainerFailed("submitit did not requeue the job (see the log above)")


def _decide(r: Resolved, env: Mapping[str, str]) -> Any:
    """dslurm's requeue policy, recorded in the ledger like `dslurm requeue-me` does."""
    from dslurm.endings import WARNED_STOP
    from dslurm.observe import events
    from dslurm.observe.ledger import Ledger
    from dslurm.requeue import decide, failures_of, pointer_step, start_steps_of

    history = events.read(r.run_dir)
    d = decide(ending=WARNED_STOP, failures=failures_of(history, env.get("SLURM_JOB_ID", "")),
               max_restarts=r.policy.max_restarts, no_progress_limit=r.policy.no_progress_limit,
               start_steps=start_steps_of(history), pointer_step=pointer_step(r.run_dir))
    Ledger(r.run_dir).append(events.Requeue(decision=d.action, step_rc=X.REQUEUE, exit_code=d.exit_code,
                                            reason=d.reason, ending=WARNED_STOP, via="submitit"))
    return d


def _wait_for_requeue(limit_s: float = 600, sleep: Callable[[float], None] = time.sleep) -> None:
    """Non-zero ranks must neither write a result nor exit non-zero (srun's
    --kill-on-bad-exit would kill rank 0 mid-requeue): wait for the requeue to end us.
    TERM goes back to its default so that end is quick."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        sleep(1.0)
    raise UserError(f"rank 0 did not requeue the job within {limit_s:.0f} s; see task 0's log")
