"""What happens after the job step ends: requeue, stop, or finish — and why.

The batch script runs `dslurm requeue-me --rc RC` on node 0 once the step is over and
exits with what it returns. The decision is a pure function of the step's exit code,
the restart count, the run's ledger and the checkpoint pointer:

- 0: training complete; later links of a chain are cancelled.
- 2 (user error): stop; a retry cannot help.
- a crash or a save-and-requeue (75): requeue within the restart budget, unless the
  pointer has not advanced across `no_progress_limit` consecutive starts (the same crash
  at the same step every time), which stops with its own exit code (76).
- in a chain, the next link continues instead of a requeue.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Literal, Mapping

from dslurm import exitcodes as X


@dataclass(frozen=True)
class Decision:
    action: Literal["requeue", "stop", "end"]
    exit_code: int
    reason: str


def starts_without_progress(start_steps: list[int], pointer_step: int) -> int:
    """How many of the latest starts began at the step the pointer still names."""
    n = 0
    for s in reversed(start_steps):
        if s != pointer_step:
            break
        n += 1
    return n


def decide(*, rc: int, restart_count: int, max_restarts: int, no_progress_limit: int,
           start_steps: list[int], pointer_step: int, in_chain: bool = False,
           requeue_enabled: bool = True) -> Decision:
    """Pure policy; see the module docstring."""
    if rc == X.OK:
        return Decision("end", X.OK, "completed")
    if rc == X.USER_ERROR:
        return Decision("stop", rc, "user error: fix the input and resubmit")
    if rc == X.TERMINATED:
        return Decision("stop", rc, "terminated (scancel or preemption): Slurm decides what comes next")
    stalled = starts_without_progress(start_steps, pointer_step)
    if no_progress_limit > 0 and stalled >= no_progress_limit:
        return Decision("stop", X.NO_PROGRESS,
                        f"no progress: the last {stalled} starts all began at step {pointer_step} and the "
                        f"pointer has not advanced (limit {no_progress_limit}); look at the logs of those "
                        "starts before resubmitting")
    what = "save-and-requeue" if rc == X.REQUEUE else (
        "bad nodes found by burn-in" if rc == X.PREFLIGHT_FAILED else f"crash (exit {rc})")
    if in_chain:
        return Decision("end", X.OK, f"{what}: the next link of the chain continues")
    if not requeue_enabled:
        return Decision("stop", rc, f"{what}, but requeue is off for this job (requeue.enabled: false)")
    if restart_count >= max_restarts:
        return Decision("stop", X.BUDGET, f"{what}, but the restart budget is spent "
                                          f"({restart_count} of {max_restarts} restarts)")
    return Decision("requeue", X.OK, f"{what}: requeue (restart {restart_count + 1} of {max_restarts})")


# Slurm checks time limits about every 30 s and may send the B: signal up to a minute
# early or late relative to the nominal lead, so no lead below a minute is trustworthy.
LEAD_FLOOR_S = 60


def auto_signal_lead(events: Iterable[dict], *, default_s: int, floor_s: int = LEAD_FLOOR_S,
                     safety: float = 2.0) -> tuple[int, str]:
    """`requeue.signal_lead: auto`: the warning a stop needs = finish the current step, then
    a synchronous save, times a safety factor, never below the floor. Measured from this
    run's ledger (slowest step window, slowest save); the site's default when the run has
    no history yet. Returns (seconds, how it was derived)."""
    events = list(events)
    step_s = max((float(e.get("step_time_s") or 0) for e in events if e.get("event") == "steps"), default=0.0)
    save_s = max((float(e.get("total_s") or e.get("stall_s") or 0) for e in events
                  if e.get("event") == "ckpt_save"), default=0.0)
    if step_s == 0.0 and save_s == 0.0:
        return max(default_s, floor_s), f"site default {default_s}s (no measurements in this run yet)"
    need = safety * (step_s + save_s)
    lead = max(floor_s, int(need + 0.999))
    return lead, (f"{safety:g} x (step {step_s:.2f}s + save {save_s:.2f}s) = {need:.1f}s, "
                  f"floor {floor_s}s")


def job_ref(env: Mapping[str, str]) -> str:
    """The id `scontrol requeue` needs: array tasks as ARRAYID_TASKID."""
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env["SLURM_JOB_ID"]


def chain_of(events: Iterable[dict], job_id: str) -> list[int]:
    """The chain (list of job ids) this job belongs to, from the ledger's submit events."""
    for ev in events:
        ids = [int(i) for i in ev.get("job_ids", [])] if ev.get("event") == "submit" else []
        if len(ids) > 1 and job_id.isdigit() and int(job_id) in ids:
            return ids
    return []


def start_steps_of(events: Iterable[dict]) -> list[int]:
    return [int(ev.get("step", 0)) for ev in events if ev.get("event") == "train_start"]


def pointer_step(run_dir: Path) -> int:
    from dslurm.checkpoint import CheckpointError, read_pointer

    try:
        ptr = read_pointer(run_dir)
    except CheckpointError:
        return -1  # garbage pointer: no trusted progress
    return ptr.step if ptr else 0


def requeue_me(rc: int, env: Mapping[str, str] | None = None) -> int:
    """Decide, record in the ledger, act (scontrol requeue / cancel later links)."""
    from dslurm import slurm
    from dslurm.ledger import Ledger, read_events

    env = dict(os.environ if env is None else env)
    run_dir = Path(env["DSLURM_RUN_DIR"])
    events = list(read_events(run_dir))
    job_id = env.get("SLURM_JOB_ID", "")
    chain = chain_of(events, job_id)
    d = decide(rc=rc, restart_count=int(env.get("SLURM_RESTART_COUNT") or 0),
               max_restarts=int(env.get("DSLURM_MAX_RESTARTS", "3")),
               no_progress_limit=int(env.get("DSLURM_NO_PROGRESS_LIMIT", "3")),
               start_steps=start_steps_of(events), pointer_step=pointer_step(run_dir),
               in_chain=bool(chain), requeue_enabled=env.get("DSLURM_REQUEUE", "1") == "1")
    Ledger(run_dir).append("requeue", decision=d.action, step_rc=rc, exit_code=d.exit_code, reason=d.reason)
    print(f"dslurm: step exited {rc}: {d.reason}", flush=True)
    if d.action == "requeue":
        from dslurm.submit import read_blocklist

        blocked = read_blocklist(run_dir)
        if blocked:
            requeue_excluding(job_ref(env), blocked)
        else:
            slurm.run_cmd(["scontrol", "requeue", job_ref(env)])
    elif d.action == "end" and rc == X.OK and chain:
        later = [i for i in chain if job_id.isdigit() and i > int(job_id)]
        if later:
            slurm.run_cmd(["scancel", *map(str, later)], check=False)
            Ledger(run_dir).append("chain_cancel", job_ids=later, reason="training complete")
    return d.exit_code


def requeue_excluding(job: str, hosts: list[str]) -> None:
    """Requeue and keep the job off `hosts`. Slurm refuses ExcNodeList on a running job,
    so: requeue held, update while pending, release. SIGTERM (Slurm ends the old run as
    it requeues) is ignored meanwhile: dying between hold and release would strand the
    job held."""
    import signal
    import time

    from dslurm import slurm
    from dslurm.errors import SlurmError

    old = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        slurm.run_cmd(["scontrol", "requeuehold", job])
        try:
            for attempt in range(40):  # the job may still be completing for a moment
                res = slurm.run_cmd(["scontrol", "update", f"JobId={job}", f"ExcNodeList={','.join(hosts)}"],
                                    check=False)
                if res.returncode == 0:
                    break
                time.sleep(0.25)
            else:
                raise SlurmError(f"could not exclude {','.join(hosts)} from job {job}: {res.stderr.strip()}")
        finally:
            slurm.run_cmd(["scontrol", "release", job])
    finally:
        signal.signal(signal.SIGTERM, old)


def register(sub) -> None:
    p = sub.add_parser("requeue-me", help="(in the batch script) requeue, stop or finish after the job step")
    p.add_argument("--rc", type=int, required=True, help="exit code of the job step")
    p.set_defaults(func=lambda args: requeue_me(args.rc))
