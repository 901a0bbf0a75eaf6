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

Who takes requests: the built-in trainer, and a script that uses `dslurm.runtime`
(`dr.stop_requested(step)` polls on rank 0 and agrees on the request with the stop itself;
`ckpt.due(step)` is then True for a `save`). A script entry that never calls
`stop_requested` (a plain script, or one that only checkpoints) cannot take one: `dslurm ctl`
refuses at once, naming the script, instead of leaving a request that waits forever.

A run started by hand (`torchrun -m train ...` inside an salloc, as many debug) has no frozen
job.yaml: rank 0 leaves `ctl_taker.json` when it starts polling (the actions it takes, its start,
host, pid), and `dslurm ctl` takes that as the run directory's proof, refusing an action the
taker does not take and a run whose ledger says it ended since.

A request is for the start that is running when it is written: it carries that start
(`<job>.<restart>`), and a taker in another start drops it as stale (renamed to
`ctl_stale.json`, with an `operator_request` event that says why), as it drops one older than
`MAX_AGE_S` when either side knows no start (a run outside Slurm). So a request left for a
start that ended before its next poll never fires on a later start.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dslurm.durable import atomic_write_text
from dslurm.errors import UserError
from dslurm.run import CTL_REQUEST, CTL_STALE, CTL_TAKEN, JOB, RunDir

REQUEST, TAKEN, STALE = CTL_REQUEST, CTL_TAKEN, CTL_STALE  # the run directory's names (dslurm/run.py)
ACTIONS = ("save", "stop", "profile")
POLL_S = 5.0
MAX_AGE_S = 600.0  # a request that names no start expires: it was for a start long gone


@dataclass(frozen=True, slots=True)
class Request:
    action: str
    id: str
    user: str = "?"
    t: float = 0.0
    steps: int = 0
    """profile: how many steps (0: the job's health.profile_steps)"""
    start: str = ""  # the start (`job.restart`) it was written for; "" when none was known


def write_request(run_dir: str | Path, action: str, *, user: str | None = None, steps: int = 0,
                  start: str = "") -> Request:
    """Leave a request for rank 0 (replacing any not yet taken), for the running `start`."""
    run = Path(run_dir)
    if action not in ACTIONS:
        raise UserError(f"dslurm ctl: {action!r} is not an action. Fix: use one of {', '.join(ACTIONS)}")
    if not RunDir(run).is_run() and read_taker(run) is None:
        raise UserError(f"{run}: not a run directory (no {JOB}, and no trainer has polled for requests here: no "
                        f"{RunDir(run).ctl_taker.name}). Fix: give the directory `dslurm submit` made, or the "
                        "checkpoint.run_dir of a trainer started by hand (once it has started)")
    if steps < 0:
        raise UserError(f"dslurm ctl profile: --steps {steps} must be at least 1. Fix: e.g. --steps 3")
    req = Request(action=action, id=f"{time.time_ns()}-{os.getpid()}@{socket.gethostname()}",
                  user=user or getpass.getuser(), t=round(time.time(), 3), steps=steps, start=start)
    atomic_write_text(run / REQUEST, json.dumps({"action": req.action, "id": req.id, "user": req.user, "t": req.t,
                                                 "start": req.start, **({"steps": steps} if steps else {})}))
    return req


def stale_reason(req: Request, start: str, now: float) -> str | None:
    """Why a request must not be acted on by the taker of `start` ("" outside Slurm); None: take
    it. Pure."""
    if req.start and start and req.start != start:
        return f"written for start {req.start}, this is start {start}"
    if (not req.start or not start) and now - req.t > MAX_AGE_S:
        return f"written {now - req.t:.0f} s ago (over {MAX_AGE_S:.0f} s) for no known start"
    return None


def this_start(env: Mapping[str, str] | None = None) -> str:
    """This process's start as requests name it (`job.restart`); "" outside Slurm."""
    env = os.environ if env is None else env
    job = env.get("SLURM_JOB_ID", "")
    return f"{job}.{env.get('SLURM_RESTART_COUNT') or 0}" if job else ""


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
                   steps=steps if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0 else 0,
                   start=str(data.get("start") or ""))


def announce(run_dir: str | Path, takes: tuple[str, ...], start: str) -> None:
    """Leave `ctl_taker.json`: who polls this run directory for requests (see the module doc).
    A run directory that cannot be written is the trainer's problem to report, not this note's."""
    note = {"takes": list(takes), "start": start, "host": socket.gethostname(), "pid": os.getpid(),
            "t": round(time.time(), 3)}
    try:
        atomic_write_text(RunDir(run_dir).ctl_taker, json.dumps(note) + "\n")
    except OSError:
        pass


def read_taker(run_dir: str | Path) -> dict[str, Any] | None:
    """The note `announce` left; None when there is none or it is not one."""
    try:
        data = json.loads(RunDir(run_dir).ctl_taker.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("takes"), list):
        return None
    return data


class Poller:
    """Rank 0's side: `take()` at a step boundary returns a new request once, else None. A stale
    one (see `stale_reason`) is moved aside and kept in `dropped` (request, why) for the caller
    to put in the ledger. Made, it announces itself (`announce`: the actions it `takes`)."""

    def __init__(self, run_dir: str | Path, every_s: float = POLL_S,
                 clock: Callable[[], float] = time.monotonic, start: str | None = None,
                 takes: tuple[str, ...] = ACTIONS) -> None:
        self.run, self.every_s, self.clock = Path(run_dir), every_s, clock
        self.start = this_start() if start is None else start
        self.dropped: list[tuple[Request, str]] = []
        self._next = clock()
        announce(self.run, takes, self.start)

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
        req = parse(text)
        why = stale_reason(req, self.start, time.time()) if req is not None else None
        if req is not None and why is not None:
            try:
                os.replace(self.run / TAKEN, self.run / STALE)
            except OSError:
                pass
            self.dropped.append((req, why))
            return None
        return req


def record_stop(req: Request, run_dir: str | Path) -> bool:
    """A `stop` on record for requeue-me, as `dslurm cancel --save` records one (the start's facts dir)."""
    from dslurm.endings.facts import start_dir, write_cancel_request

    d = start_dir(run_dir=run_dir)
    return d is not None and d.is_dir() and write_cancel_request(d, save=True, user=f"{req.user} (dslurm ctl stop)",
                                                                 via="ctl")


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


def hand_started(run: Path, action: str) -> str:
    """The start a request goes to in a run with no frozen config (started by hand): the one
    whose rank 0 announced itself, if it takes `action` and its ledger does not say it ended."""
    from dslurm.observe import events

    taker = read_taker(run)
    if taker is None:
        return ""  # write_request refuses, naming what it looked for
    if action not in taker["takes"]:
        raise UserError(f"dslurm ctl {action}: the process polling {run} (pid {taker.get('pid')} on "
                        f"{taker.get('host')}) takes {', '.join(map(str, taker['takes']))} only: `ctl profile` is "
                        "the built-in trainer's. Fix: wrap the steps in torch.profiler.profile() in the script")
    t = float(taker.get("t") or 0.0)
    ended = [e for e in events.of(events.read(run), events.Exit) if e.t >= t]
    if ended:
        raise UserError(f"dslurm ctl {action}: the run in {run} ended ({ended[-1].reason} at step {ended[-1].step}) "
                        "and nothing polls for requests now. Fix: start it again; a request waits for nobody")
    return str(taker.get("start") or "")


def script_refusal(run_dir: Path, entry: str | list[str], where: list[Path], action: str = "save") -> str | None:
    """Why this run's entry cannot take a request (None: it can, or that cannot be told). The
    built-in trainer (a module entry) polls; a script does when it calls
    `dslurm.runtime.stop_requested`, which is where rank 0 looks (dslurm/runtime/__init__.py), or
    runs a library's trainer through `dslurm.integrations` (its callback calls it each step). The
    script is looked for in `where` (the code snapshot, the directory ctl runs in); one not
    found is given the benefit of the doubt. Pure but for reading the script."""
    words = [entry] if isinstance(entry, str) else list(entry)
    if not words or not words[0].endswith(".py"):
        return None  # a module: the built-in trainer, or `-m pkg.mod` (not read)
    if action == "profile":  # dslurm.runtime takes save and stop; traces are the built-in trainer's
        return (f"the run's entry is a script ({words[0]}): `dslurm ctl profile` is taken by the built-in trainer "
                "only. Fix: wrap the steps you want in torch.profiler.profile() in the script itself")
    for base in where:
        path = base / words[0]
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        if "stop_requested" in text or "dslurm.integrations" in text:  # an adapter's callback polls at each step
            return None
        return (f"the run's script {path} never calls dslurm.runtime.stop_requested(step), where rank 0 takes "
                f"`dslurm ctl` requests: a request would wait forever. Fix: stop it with `dslurm cancel --save "
                f"{run_dir}` (saves if the script handles TERM), or make the script call dr.stop_requested at "
                f"each step boundary (examples/own_script/train_safe.py)")
    return None


def running_start(run_dir: Path) -> tuple[str, str | None]:
    """(the running start of the run as `job.restart`, or ""; a refusal when Slurm says no job of
    the run is running). A run that was never submitted (no submit event), or an squeue that
    fails, gives ("", None): the request then expires after MAX_AGE_S instead."""
    from dslurm import slurm
    from dslurm.errors import SlurmError
    from dslurm.observe import events

    ids = sorted({i for e in events.of(events.read(run_dir), events.Submit) for i in e.job_ids})
    if not ids:
        return "", None
    try:
        jobs = slurm.squeue(job_ids=ids)
    except (SlurmError, OSError):
        return "", None
    running = [j for j in jobs if j["state"] == "RUNNING"]
    if not running:
        said = ", ".join(f"{j['job_id']} {j['state']}" for j in jobs) or "none pending or running"
        return "", (f"no start of {run_dir} is running (its jobs: {said}): nobody would take the request, and a "
                    f"later start must not act on an old one. Fix: ask again once it runs (`dslurm status "
                    f"{run_dir}`), or `dslurm cancel {run_dir}` to stop what is queued")
    job = str(running[0]["job_id"])
    if not job.isdigit():  # an array task (123_4): its start is named by its own job id, not known here
        return "", None
    try:
        restarts = int(str(slurm.job_info(job).get("restarts") or 0))
    except (SlurmError, OSError, ValueError):
        return "", None
    return f"{job}.{restarts}", None


def _run(args: argparse.Namespace) -> int:
    from dslurm.remote import handle

    if (h := handle.read(args.run_dir)) is not None:  # a run on a cluster: the request is written there
        from dslurm.remote.proxy import passthrough

        return passthrough(h, ["ctl", h.run_dir, args.action, *(["--steps", str(args.steps)] if args.steps else [])])
    if args.steps and args.action != "profile":
        raise UserError(f"dslurm ctl {args.action}: --steps is for profile only. Fix: drop --steps")
    run, rd = Path(args.run_dir), RunDir(args.run_dir)
    if rd.is_run():
        from dslurm.config import load_job

        try:
            entry: str | list[str] = load_job(rd.job_yaml).entry
        except UserError:  # not a frozen job (hand-made): nothing to tell from it
            entry = "train"
        code = sorted(rd.code.glob("*/")) if rd.code.is_dir() else []
        if (why := script_refusal(run, entry, [*code, Path.cwd()], args.action)) is not None:
            raise UserError(f"dslurm ctl {args.action}: {why}")
        start, refusal = running_start(run)
        if refusal is not None:
            raise UserError(f"dslurm ctl {args.action}: {refusal}")
    else:
        start = hand_started(run, args.action)
    req = write_request(run, args.action, steps=args.steps, start=start)
    n = req.steps or "health.profile_steps"
    what = f"profile of the next {n} step(s)" if req.action == "profile" else args.action
    print(f"{what} requested ({req.id}{f', for start {start}' if start else ''}); rank 0 takes it at a step "
          f"boundary within ~{POLL_S:.0f}s of training; `dslurm watch {args.run_dir}` shows when"
          + ("; `dslurm report` lists the traces" if req.action == "profile" else ""))
    return 0
