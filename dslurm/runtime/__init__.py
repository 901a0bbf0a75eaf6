"""`dslurm.runtime`: what a PyTorch script needs to survive preemption under dslurm.

For a script launched by dslurm (torchrun or srun mode; its job's `entry` names the script,
e.g. `entry: ["my_train.py", "--lr", "3e-4"]`). Five calls, the same machinery as the
built-in trainer (train/), which uses these modules too::

    import dslurm.runtime as dr

    rt = dr.init()                          # process group + device, stop handlers, burn-in gate
    ckpt = dr.Checkpoint(model=model, optim=opt, data=loader)   # any state; RNG included
    start = ckpt.restore()                  # completed steps to resume after (0: fresh)
    for step in range(start, steps):
        ...                                 # forward, backward, optimizer step
        dr.log_metrics(step, loss=loss.item())          # the run's ledger: `dslurm report` works
        if dr.stop_requested(step + 1):     # agreed across ranks at this step boundary
            ckpt.save(step + 1, final=True)
            dr.exit_for_requeue(step + 1)   # exit 75 (USR2: requeue me) or 143 (TERM)
        if ckpt.due(step + 1):
            ckpt.save(step + 1)             # sync, async or two tiers, as the job says
    ckpt.save(steps, final=True)            # a no-op wait when the loop's last save was this step
    dr.finish(steps)

Shared and per-rank state: models and optimizers (and `dr.shared(obj)`) are one state for the
job, through DCP; everything else (data loaders, samplers, generators, schedulers, dicts, your
own objects) is saved by each rank for itself and given back to the same rank; on a world-size
change it is resharded when it can be (`dr.per_rank(obj, reshard=fn)`), refused by name when
not. See dslurm/runtime/checkpoint.py `Checkpoint` and docs/checkpoint.md.

Configuration comes from the run directory, not from arguments: the launcher exports
DSLURM_RUN_DIR, where `dslurm submit` froze `site.yaml` and `job.yaml` (the job's
`checkpoint` section: interval, keep, async_save, tiers; the site's backend and GPUs). So a
script entry gets only its own arguments; without a run directory (a plain torchrun) the
process group still works and checkpoints need `init(run_dir=...)`.

Stop semantics are the trainer's (dslurm/runtime/stop.py): the USR2/TERM handler only sets a
flag; `stop_requested` agrees on it with one SUM all-reduce of two numbers, or rides on
values the script all-reduces anyway (`ride=`), so it costs no extra collective. Exit codes
are dslurm/exitcodes.py's; every rank leaves its own report for `dslurm requeue-me`
(dslurm/endings/worker_exit.py). An uncaught error is reported too: a dslurm error (a failed final
save: 74) exits with its code and one line, anything else as a crash (1).
Torch is imported only inside these functions (in-job).
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from dslurm import exitcodes
from dslurm.endings.worker_exit import Outcome, leave, report, world_from_env
from dslurm.run import RunDir
from dslurm.runtime import flight
from dslurm.runtime.checkpoint import Checkpoint as _Checkpoint
from dslurm.runtime.checkpoint import per_rank, shared
from dslurm.runtime.stop import StopFlags, StopRequest

__all__ = ["Checkpoint", "Runtime", "catch_stops", "current", "exit_for_requeue", "finish", "init", "log_metrics",
           "per_rank", "shared", "stop_requested"]
log = logging.getLogger(__name__)
# Steps fields a metric of that name fills; every other metric goes to Steps.values.
_STEP_FIELDS = ("loss", "grad_norm", "lr", "tokens_per_s")


def load_frozen(run_dir: Path | None) -> tuple[Any, Any]:
    """(site, job) as `dslurm submit` froze them into the run directory; (None, None) without."""
    frozen = None if run_dir is None else RunDir(run_dir).frozen()
    return (None, None) if frozen is None else frozen


class Runtime:
    """This process's place in the job: rank, world, device, run directory, the frozen config
    (None outside a dslurm run directory), the stop flags and the ledger (rank 0)."""

    def __init__(self, *, run_dir: Path | None, site: Any, job: Any, t_start: float) -> None:
        self.rank, self.local_rank, self.world_size, _ = world_from_env()
        self.run_dir, self.site, self.job, self.t_start = run_dir, site, job, t_start
        self.device: Any = None
        self.step = 0  # completed steps, as the script last told us (for the rank report)
        self.terminated = False  # the agreed stop came from TERM
        self.outcome = Outcome()
        self.outcome.run_dir, self.outcome.progress = run_dir, self
        self.flags = StopFlags()
        self.ledger: Any = None
        self.ctl: Any = None  # rank 0: `dslurm ctl` requests (dslurm/observe/ctl.py), polled in stop_requested
        self.save_asked: int | None = None  # the step an agreed `dslurm ctl save` is for (Checkpoint.due says so)
        self.checkpoints: list[_Checkpoint] = []
        self._window: tuple[int, float] | None = None  # first step and start time of the log window
        self._done = False

    # ------------------------------------------------------------------ ledger

    def event(self, ev: Any) -> None:
        """Append a typed event (dslurm/observe/events/) to the run's ledger (rank 0 only)."""
        if self.ledger is not None:
            self.ledger.append(ev)

    def started(self, step: int) -> None:
        self.step, self._window = step, (step, time.time())

    def log_metrics(self, step: int, **values: Any) -> None:
        """Metrics of the 0-based `step` just taken (e.g. loss=...) as one `steps` window since
        the last call; loss, grad_norm, lr and tokens_per_s fill their own fields, the rest go
        to `values`. Call it on every rank (only rank 0 writes); values are read with float()."""
        from dslurm.observe import events

        now = time.time()
        first, t0 = self._window if self._window is not None else (step, self.t_start)
        self._window, self.step = (step + 1, now), step + 1
        if self.ledger is None:
            return
        nums = {k: float(v) for k, v in values.items()}
        n = max(1, step - first + 1)
        known = {k: nums.pop(k) for k in _STEP_FIELDS if k in nums}
        self.event(events.Steps(first=first, last=step, duration_s=round(now - t0, 4),
                                step_time_s=round((now - t0) / n, 4), values=nums, loss=known.get("loss"),
                                grad_norm=known.get("grad_norm"), lr=known.get("lr"),
                                tokens_per_s=known.get("tokens_per_s")))

    # ------------------------------------------------------------------ stop

    def stop_requested(self, step: int, ride: Any = None) -> bool:
        """Has any rank been asked to stop (USR2, TERM, `dslurm ctl stop`)? The same answer on
        every rank: call it on every rank at the same step boundary, after `step` completed
        steps. `ride`: a 1-D float tensor the script wanted SUM-all-reduced anyway; it is, in
        place, in the same collective, so the agreement costs nothing extra. A `dslurm ctl save`
        rank 0 took rides along too: `Checkpoint.due(step)` is then True on every rank."""
        import torch
        import torch.distributed as dist

        save = self._operator_request(step)
        local = torch.tensor([*self.flags.local(step), float(save)], device=self.device)
        vec = local if ride is None else torch.cat([ride.detach().reshape(-1).float().to(self.device), local])
        if dist.is_initialized():
            dist.all_reduce(vec, op=dist.ReduceOp.SUM)
        if ride is not None:
            ride.copy_(vec[:-3].reshape(ride.shape).to(ride.dtype))
        stop, self.terminated = bool(vec[-3].item() > 0), bool(vec[-2].item() > 0)
        if vec[-1].item() > 0:
            self.save_asked = step
        self.step = step
        if stop:
            from dslurm.observe import events

            self.event(events.Signal(signal="stop_requested", step=step))
        return stop

    def _operator_request(self, step: int) -> bool:
        """Rank 0: a `dslurm ctl` request taken at this step boundary. A stop sets the flags a TERM
        sets, on record for requeue-me first (an operator's stop: saved, not requeued); -> True
        for a save. As the built-in trainer does (train/loop.py)."""
        if self.ctl is None:
            return False
        from dslurm.observe import ctl, events

        req = self.ctl.take()
        for old, why in self.ctl.dropped:
            log.warning("dslurm ctl %s request %s dropped as stale: %s", old.action, old.id, why)
            self.event(events.OperatorRequest(action=old.action, request_id=old.id, user=old.user, step=step,
                                              dropped=why))
        self.ctl.dropped.clear()
        if req is None:
            return False
        recorded = req.action == "stop" and self.run_dir is not None and ctl.record_stop(req, self.run_dir)
        self.event(events.OperatorRequest(action=req.action, request_id=req.id, user=req.user, step=step,
                                          recorded=recorded))
        if req.action == "stop":
            self.flags.stop_requested = self.flags.stop_terminated = True
        return bool(req.action == "save")

    # ------------------------------------------------------------------ exit

    def exit_for_requeue(self, step: int | None = None) -> None:
        """After the stop's final save: exit 75 (requeue me) or 143 (the stop came from TERM:
        Slurm decides), with the ledger's exit event and this rank's report. Does not return."""
        code = exitcodes.TERMINATED if self.terminated else exitcodes.REQUEUE
        self._end(code, step)
        sys.exit(code)

    def finish(self, step: int | None = None, *, keep_group: bool = False) -> None:
        """Training complete (after the final save): the exit event, this rank's report (code 0),
        the process group destroyed (`keep_group`: left for the script, e.g. a library's own
        save of the final model after its trainer returned). The script then ends normally."""
        self._end(exitcodes.OK, step, keep_group=keep_group)

    def _end(self, code: int, step: int | None, *, keep_group: bool = False) -> None:
        import torch.distributed as dist

        from dslurm.observe import events

        self.step = self.step if step is None else step
        for ck in self.checkpoints:
            ck.close()
        self.outcome.settled(time.time())
        self.event(events.Exit(reason=exitcodes.NAMES[code], step=self.step, code=code))
        if dist.is_initialized():
            # torchrun tears the others down as soon as one exits non-zero: nobody leaves before
            # rank 0 has written the exit event.
            dist.barrier()
        self.outcome.step = self.step
        report(self.outcome, code, self.rank)
        self._done = True
        if dist.is_initialized() and not keep_group:
            dist.destroy_process_group()

    def _on_error(self, exc: BaseException) -> int:
        """An exception left the script: note it, report it; -> the code to exit with."""
        from dslurm.errors import UserError

        self.outcome.failed(exc)
        code = exc.exit_code if isinstance(exc, UserError) else 1
        if not isinstance(exc, UserError):  # a collective that failed (peer gone, timeout): who was where
            self._dump_collectives()
        if not self._done:
            report(self.outcome, code, self.rank)
            self._done = True
        return code

    def _dump_collectives(self) -> None:
        """This rank's Flight Recorder into the start's facts dir (`dslurm doctor` names the ranks
        that did not enter the collective the others waited in; dslurm/observe/forensics.py)."""
        import torch.distributed as dist

        from dslurm.endings.facts import start_dir

        if dist.is_available() and dist.is_initialized():
            flight.dump(start_dir(run_dir=self.run_dir) if self.run_dir is not None else None, self.rank)


_CURRENT: Runtime | None = None
_EARLY: StopRequest | None = None  # catch_stops(): handlers installed before init()


def catch_stops() -> None:
    """Install the stop handlers now, before `init()`: they only remember the signal, and `init()`
    hands it to the runtime's flags. For code that builds a library's trainer before it can call
    `init()` (dslurm.integrations, on import): a USR2 forwarded meanwhile would otherwise end the
    process (its default action)."""
    global _EARLY
    if _EARLY is None and _CURRENT is None:
        _EARLY = StopRequest().install(None)


def current() -> Runtime:
    """The runtime `init()` set up in this process."""
    if _CURRENT is None:
        from dslurm.errors import UserError

        raise UserError("dslurm.runtime: call dslurm.runtime.init() first (once per process)")
    return _CURRENT


def _excepthook(tp: type[BaseException], exc: BaseException, tb: Any) -> None:
    from dslurm.errors import UserError

    rt = _CURRENT
    code = rt._on_error(exc) if rt is not None else 1
    if isinstance(exc, UserError):  # a dslurm error: one line, its own exit code, no traceback
        # The process's real stderr: init_process_group wraps this hook in one that swaps
        # sys.stderr for a buffer and prints it after we return -- which os._exit never does.
        print(f"error: [rank {rt.rank if rt else '?'}] {exc}", file=sys.__stderr__ or sys.stderr, flush=True)
        leave(code)
    sys.__excepthook__(tp, exc, tb)


def _at_exit() -> None:
    """A script that returned without finish() or exit_for_requeue(): its code is unknown to
    us, but an unreported ending must not read as a success or a saved stop."""
    if _CURRENT is not None and not _CURRENT._done:
        report(_CURRENT.outcome, 1, _CURRENT.rank)


def init(*, run_dir: str | os.PathLike[str] | None = None, backend: str | None = None) -> Runtime:
    """Join the job: stop handlers first (a TERM during start-up is kept), the process group
    and device from the environment the launcher set (dslurm/health/process_group.py), then
    the burn-in gate when the launcher asked for one (exits 78 on bad nodes). Idempotent."""
    global _CURRENT
    if _CURRENT is not None:
        return _CURRENT
    t_start = time.time()
    path = run_dir or os.environ.get("DSLURM_RUN_DIR")
    rd = Path(path) if path else None
    site, job = load_frozen(rd)
    rt = _CURRENT = Runtime(run_dir=rd, site=site, job=job, t_start=t_start)
    rt.outcome.stop = (_EARLY or StopRequest()).install(rt.flags)
    sys.excepthook = _excepthook
    atexit.register(_at_exit)
    from dslurm.health.process_group import init_process_group
    from dslurm.preflight.in_job import gate_in_process

    gpus = bool(site and site.node.gpus)
    rt.device = init_process_group(backend or (site.network.backend if site else None), require_cuda=gpus,
                                   cpu_only=site is not None and not gpus,
                                   where=f"{RunDir(rd).site_yaml}: site {site.name!r}" if site and rd else "")
    code = gate_in_process(rt.device, outcome=rt.outcome)  # the burn-in, when the launcher asked for one
    if code:
        rt._end(code, 0)
        sys.exit(code)
    if rt.rank == 0 and rd is not None:
        from dslurm.observe.ledger import Ledger

        rt.ledger = Ledger(rd)
        from dslurm.observe.ctl import Poller

        rt.ctl = Poller(rd, takes=("save", "stop"))  # profile is the built-in trainer's
        from dslurm.trackers import attach  # the job's metrics.trackers, fed from the ledger (rank 0)

        attach(rt.ledger, rd, job.metrics if job is not None else None, job.name if job is not None else "")
    return rt


def Checkpoint(**state: Any) -> _Checkpoint:  # noqa: N802  (reads as the class it builds)
    """A checkpoint of `state` for the current runtime (see dslurm/runtime/checkpoint.py)."""
    rt = current()
    ck = _Checkpoint(rt, **state)
    rt.checkpoints.append(ck)
    return ck


def stop_requested(step: int, ride: Any = None) -> bool:
    return current().stop_requested(step, ride)


def log_metrics(step: int, **values: Any) -> None:
    current().log_metrics(step, **values)


def exit_for_requeue(step: int | None = None) -> None:
    current().exit_for_requeue(step)


def finish(step: int | None = None) -> None:
    current().finish(step)


stop_requested.__doc__ = Runtime.stop_requested.__doc__
log_metrics.__doc__ = Runtime.log_metrics.__doc__
exit_for_requeue.__doc__ = Runtime.exit_for_requeue.__doc__
finish.__doc__ = Runtime.finish.__doc__
