"""Weights & Biases: one W&B run per dslurm run, offline unless the job or WANDB_MODE says online.

The run id is ours: chosen once and written to trackers.json before `wandb.init`, so a start
after a node failure (no callback ran) resumes the same run (`resume="allow"`). Points are
logged with the tracker step as W&B's `step`. A start that resumed after k steps, online,
rewinds the run to there first (`resume_from="<id>?_step=k"`, W&B's rewind), so replayed steps
replace the old ones; where the server refuses a rewind it resumes plainly. Offline, each start
leaves its own `offline-run-*-<id>` directory under `<run_dir>/wandb/`; `wandb sync` uploads
them into the one run. Annotations are the text series `dslurm/event`. W&B's history cannot be
read back offline, so what the run holds (`held`) is kept in trackers.json at each start's end
and after a sync; W&B itself drops a step it has already passed. `dslurm trackers sync` opens
a W&B run only when it has something to send.

The API key stays in the user's environment (WANDB_API_KEY, read by wandb itself); metadata
capture (argv, git, console, system stats) is off, so nothing from the environment is copied
into the run directory.
"""

from __future__ import annotations

import os
import secrets
import string
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dslurm.trackers import Start
from dslurm.trackers.backlog import Held

if TYPE_CHECKING:
    from dslurm.config import MetricsSpec

PACKAGE = "wandb"


def _new_id() -> str:
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(12))


class WandbTracker:
    def __init__(self, ctx: Start) -> None:
        import wandb

        if not isinstance(ctx.state.get("id"), str):
            ctx.state["id"] = _new_id()
            ctx.save()  # the id is durable before W&B hears of it
        run_id: str = ctx.state["id"]
        mode = _mode(ctx)
        project = ctx.spec.wandb_project or os.environ.get("WANDB_PROJECT") or ctx.job
        settings = wandb.Settings(console="off", x_disable_stats=True, disable_git=True, save_code=False,
                                  x_disable_meta=True, disable_job_creation=True, silent=True,
                                  # W&B gives up itself at the lane's bound (dslurm/trackers/lane.py)
                                  init_timeout=ctx.spec.tracker_timeout_s)
        kw: dict[str, Any] = dict(project=project, name=ctx.job, dir=str(ctx.run_dir), mode=mode,
                                  settings=settings, reinit="create_new")
        self._held = Held.from_json(ctx.state.get("held"))
        self._run: Any = None
        self._init: Callable[[], Any] = lambda: wandb.init(id=run_id, resume="allow", **kw)
        if ctx.sync:
            return  # opened by the first point a sync sends
        if mode == "online" and ctx.start > 0:
            ctx.note("wandb.init (rewind)")
            try:
                self._run = wandb.init(resume_from=f"{run_id}?_step={ctx.resumed}", **kw)
                self._held.below(ctx.purge_from)
            except Exception:  # a server without rewind: resume plainly (replayed steps are not sent)
                self._run = None
        if self._run is None:
            ctx.note(f"wandb.init ({mode})")
            self._run = self._init()

    @property
    def run(self) -> Any:
        if self._run is None:
            self._run = self._init()
        return self._run

    def held(self) -> Held:
        return self._held

    def log(self, step: int, values: dict[str, float], t: float = 0.0) -> None:
        self.run.log(dict(values), step=step)

    def event(self, text: str, step: int) -> None:
        self.run.log({"dslurm/event": text}, step=step)

    def close(self, ending: str | None) -> None:
        import wandb

        if self._run is None:
            return  # a sync with nothing to send opened no run
        code = 0 if ending in (None, "completed", "requeue", "terminated") else 1
        self.run.finish(exit_code=code)
        # finish() can return before W&B's service process has written the run's records (seen: a
        # .wandb file holding its header alone); teardown waits for the service to end, and no
        # atexit hook is left to do it: the trainer exits without finalization (dslurm.endings.worker_exit.leave).
        # Both wait on W&B's service (online: on its uploads): the lane bounds them
        # (metrics.tracker_close_s); a slower service is a tracker_failed at close, the run left
        # unfinished (offline, its last records may be missing; online, `wandb sync` the run dir).
        wandb.teardown()


def _mode(ctx: Start) -> str:
    return _spec_mode(ctx.spec)


def _spec_mode(spec: MetricsSpec) -> str:
    return spec.wandb_mode or os.environ.get("WANDB_MODE") or "offline"


def remote(spec: MetricsSpec, run_dir: Path) -> bool:
    """Online (offline, W&B writes local files)."""
    return _spec_mode(spec) != "offline"


def describe(ctx: Start) -> str:
    if _mode(ctx) == "offline":
        return f"W&B offline ({ctx.run_dir / 'wandb'})"
    return f"W&B online at {os.environ.get('WANDB_BASE_URL') or 'https://api.wandb.ai'}"


def open_run(ctx: Start) -> WandbTracker:
    return WandbTracker(ctx)
