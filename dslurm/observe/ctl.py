"""`dslurm ctl RUN_DIR save|stop|profile`: ask a running job to checkpoint now, to save and end,
or to profile its next steps.

The request is a file, `<run_dir>/ctl_request.json` (written through dslurm.durable), not a
signal: nothing has to reach the right processes on the right nodes. Rank 0 of the trainer
looks for it at step boundaries, at most every `POLL_S` seconds (a stat on a shared
filesystem is not free), takes it (renames it to `ctl_taken.json`, so it acts once) and hands
it to the ranks through the agreement they already make at every step (train/loop.py):

- `save`: one extra checkpoint at that step, as the job's checkpoints are made (async or not).
- `stop`: save and end cleanly, not requeued. Rank 0 sets the same flags a TERM sets
  (dslurm/runtime/stop.py), so every rank saves and exits 143, and first records the request
  as `dslurm cancel --save` does (cancel.json in the start's facts dir): `requeue-me` reads
  a deliberate stop and ends the run, where an unexplained TERM would be requeued.

- `profile [--steps N]`: every rank traces the next N steps with torch.profiler (train/profile.py;
  N defaults to the job's `health.profile_steps`); the count rides in the same agreement.

The ledger's `operator_request` event says who asked what, and at which step it was taken.
The newest request wins when two arrive between polls (a stop includes its save).
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dslurm.durable import atomic_write_text
from dslurm.errors import UserError

REQUEST, TAKEN = "ctl_request.json", "ctl_taken.json"
ACTIONS = ("save", "stop", "profile")
POLL_S = 5.0


@dataclass(frozen=True, slots=True)
class Request:
    action: str
    id: str
    user: str = "?"
    t: float = 0.0
    steps: int = 0
    """profile: how many steps (0: the job's health.profile_steps)"""


def write_request(run_dir: str | Path, action: str, *, user: str | None = None, steps: int = 0) -> Request:
    """Leave a request for rank 0 (replacing any not yet taken)."""
    run = Path(run_dir)
    if action not in ACTIONS:
        raise UserError(f"dslurm ctl: {action!r} is not an action. Fix: use one of {', '.join(ACTIONS)}")
    if not (run / "job.yaml").is_file():
        raise UserError(f"{run}: not a run directory (no job.yaml). Fix: give the directory `dslurm submit` made")
    if steps < 0:
        raise UserError(f"dslurm ctl profile: --steps {steps} must be at least 1. Fix: e.g. --steps 3")
    req = Request(action=action, id=f"{time.time_ns()}-{os.getpid()}@{socket.gethostname()}",
                  user=user or getpass.getuser(), t=round(time.time(), 3), steps=steps)
    atomic_write_text(run / REQUEST, json.dumps({"action": req.action, "id": req.id, "user": req.user, "t": req.t,
                                                 **({"steps": steps} if steps else {})}))
    return req


def parse(text: str) -> Request | None:
    """A request file's content; None when it is not one (garbled, an unknown action). Pure."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict) or data.get("action") not in ACTIONS:
        return None
    t, steps = data.get("t"), data.get("steps")
    return Request(action=str(data["action"]), id=str(data.get("id", "?")), user=str(data.get("user", "?")),
                   t=float(t) if isinstance(t, (int, float)) else 0.0,
                   steps=steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else 0)


class Poller:
    """Rank 0's side: `take()` at a step boundary returns a new request once, else None."""

    def __init__(self, run_dir: str | Path, every_s: float = POLL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.run, self.every_s, self.clock = Path(run_dir), every_s, clock
        self._next = clock()

    def take(self) -> Request | None:
        now = self.clock()
        if now < self._next:
            return None
        self._next = now + self.every_s
        path = self.run / REQUEST
        try:
            os.replace(path, self.run / TAKEN)  # taken once, even if this process dies right after
            text = (self.run / TAKEN).read_text()
        except OSError:  # none waiting (the common case), or the run dir is unreachable for a moment
            return None
        return parse(text)


def record_stop(req: Request, run_dir: str | Path) -> bool:
    """A `stop` on record for requeue-me, as `dslurm cancel --save` records one (the start's facts dir)."""
    from dslurm.facts import start_dir, write_cancel_request

    d = start_dir(run_dir=run_dir)
    return d is not None and d.is_dir() and write_cancel_request(d, save=True, user=f"{req.user} (dslurm ctl stop)")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("ctl", help="ask a running job to save now, to save and stop (no signal, not requeued), "
                                   "or to profile its next steps",
                       description="Operator controls: a request file rank 0 reads at a step boundary "
                                   "(docs/trackers.md).")
    p.add_argument("run_dir", type=Path, help="the run directory")
    p.add_argument("action", choices=ACTIONS, help="save: one checkpoint now; stop: save and end, not requeued; "
                   "profile: a torch.profiler trace of the next steps on every rank")
    p.add_argument("--steps", type=int, default=0, metavar="N",
                   help="profile: how many steps (default: the job's health.profile_steps)")
    p.set_defaults(func=_run, configure_logging=False)


def _run(args: argparse.Namespace) -> int:
    from dslurm.remote import handle

    if (h := handle.read(args.run_dir)) is not None:  # a run on a cluster: the request is written there
        from dslurm.remote.proxy import passthrough

        return passthrough(h, ["ctl", h.run_dir, args.action, *(["--steps", str(args.steps)] if args.steps else [])])
    if args.steps and args.action != "profile":
        raise UserError(f"dslurm ctl {args.action}: --steps is for profile only. Fix: drop --steps")
    req = write_request(args.run_dir, args.action, steps=args.steps)
    n = req.steps or "health.profile_steps"
    what = f"profile of the next {n} step(s)" if req.action == "profile" else args.action
    print(f"{what} requested ({req.id}); rank 0 takes it at a step boundary within ~{POLL_S:.0f}s "
          f"of training; `dslurm watch {args.run_dir}` shows when"
          + ("; `dslurm report` lists the traces" if req.action == "profile" else ""))
    return 0
