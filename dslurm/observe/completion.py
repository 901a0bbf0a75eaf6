"""Whether a run finished: the first thing `dslurm report` and `dslurm doctor` say.

A run is over when its last start took a final decision (requeue-me's `stop` or `end`, with no
chain link or resubmission waiting); it is complete when that start ended `completed`. A run
that is over and not complete ended short: the headline says at which step of `train.steps`,
why (the last ending and the decision), and the command that continues it. A run whose last
start has no final decision yet is still going (or was killed with its batch shell) and is
never called incomplete. `completion` is pure; `target_steps` reads the frozen job.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dslurm.observe import events as ev
from dslurm.observe.events import Event

if TYPE_CHECKING:
    from dslurm.observe.starts import Start

COMPLETED, INCOMPLETE, RUNNING, REQUEUED, QUEUED, NOT_STARTED = (
    "completed", "incomplete", "running", "requeued", "queued", "not_started")


@dataclass(slots=True)
class Completion:
    """Did the run finish? (`--json` carries these fields at its top level.)"""

    status: str
    """completed | incomplete (over, short of its end) | running (no final decision yet) |
    requeued (the next start has not begun) | queued (submitted again or the next chain link
    waits) | not_started"""
    complete: bool | None
    """True: completed; False: over without completing; None: not over yet"""
    target_steps: int | None
    """train.steps of the frozen job.yaml (None: not readable)"""
    stopped_at: int | None
    """the last step reached (steps done) as the ledger knows it; for a last start that did no
    step, the step of the last checkpoint"""
    why: str | None = None
    """the last start's ending (class: reason) and the decision taken on it"""
    continue_with: str | None = None
    """the command that continues the run (incomplete runs only)"""
    resumes_from: int | None = None
    """the step of the last checkpoint the ledger knows of (saved or restored): where a
    continuation resumes"""
    job_id: str | None = None

    def lines(self) -> list[str]:
        """The headline (and, for a run that ended short, how to continue it)."""
        of = f" of {self.target_steps}" if self.target_steps is not None else ""
        at = f"step {self.stopped_at}{of}" if self.stopped_at is not None else f"no step done{of}"
        if self.status == COMPLETED:
            return [f"COMPLETED: {at}"]
        if self.status == INCOMPLETE:
            where = (f"stopped at {at}" if self.stopped_at is not None else f"stopped before its first step{of}")
            back = (f" (resumes from the checkpoint at step {self.resumes_from})" if self.resumes_from
                    else " (starts from step 0: no checkpoint)")
            return [f"INCOMPLETE: {where} — {self.why}", f"continue with: {self.continue_with}{back}"]
        job = self.job_id or "JOB"
        return [{RUNNING: f"RUNNING: {at} so far; no final decision in the ledger yet (still running, or killed "
                          f"with its batch shell: `dslurm status {job}`)",
                 REQUEUED: f"REQUEUED: {at} so far; the next start has not begun",
                 QUEUED: f"QUEUED: {at} so far; submitted again (or the next chain link waits), not started yet",
                 }.get(self.status, f"NOT STARTED: {at}; no start in the ledger yet")]


def ended_completed(s: Start) -> bool:
    """The start ended `completed`: its classified ending, else (an older ledger) the trainer's exit."""
    return s.ending == "completed" or (s.ending is None and s.exit_reason == "completed")


def _chain_waits(last: Start, events: list[Event]) -> bool:
    """The last start's job is a link of a chain whose later links were neither run nor cancelled."""
    if last.job_id is None or not last.job_id.isdigit():
        return False
    if any(e.t >= last.begin for e in ev.of(events, ev.ChainCancel)):
        return False
    return any(int(last.job_id) in s.job_ids and s.job_ids[-1] != int(last.job_id)
               for s in ev.of(events, ev.Submit))


def _why(last: Start) -> str:
    what = last.ending or last.exit_reason
    why = f"{what}: {last.ending_reason}" if last.ending_reason else what
    decided = last.all(ev.Requeue)
    reason = decided[-1].reason if decided else ""
    detail = f" [{last.ending_reason}]"
    if last.ending_reason and reason.endswith(detail):
        reason = reason[:-len(detail)]  # requeue-me appends the ending's reason, said already
    if reason and reason != what:
        why += f" ({decided[-1].decision}: {reason})"
    return why


def continue_command(run_dir: str | Path) -> str:
    """The command that continues a run from its own frozen config (`dslurm submit --run-dir`)."""
    return f"dslurm submit --run-dir {run_dir}"


def completion(starts: list[Start], events: list[Event], target_steps: int | None,
               run_dir: str | Path = "RUN_DIR") -> Completion:
    """Whether the run finished, from its starts (`report.split_starts` + `summarize`) and the
    frozen target. Pure."""
    if not starts:
        return Completion(QUEUED if any(ev.of(events, ev.Submit)) else NOT_STARTED, None, target_steps, None)
    last = starts[-1]
    saved = [e.step for s in starts for e in s.all(ev.CkptSave) if e.step is not None]
    saved += [s.resumed_from for s in starts if s.resumed_from is not None]
    saved += [e.step for e in last.all(ev.CkptRestore) if e.step is not None]  # restored, then no step
    checkpoint = max(saved, default=None)

    def now(status: str, complete: bool | None = None) -> Completion:
        at = last.reached if last.reached is not None else checkpoint
        return Completion(status, complete, target_steps, at, job_id=last.job_id, resumes_from=checkpoint)

    if any(e.t > last.end for e in ev.of(events, ev.Submit)):
        return now(QUEUED)  # resubmitted after the last start ended
    if ended_completed(last):
        return now(COMPLETED, True)
    if last.decision is None:
        return now(RUNNING)
    if last.decision == "requeue":
        return now(REQUEUED)
    if _chain_waits(last, events):
        return now(QUEUED)
    out = now(INCOMPLETE, False)
    out.why, out.continue_with = _why(last), continue_command(run_dir)
    return out


def target_steps(run_dir: str | Path) -> int | None:
    """train.steps of the run's frozen job.yaml; None when it is missing or no longer loads."""
    from dslurm.config import load_job
    from dslurm.errors import UserError
    from dslurm.run import RunDir

    path = RunDir(run_dir).job_yaml
    if not path.is_file():
        return None
    try:
        return load_job(path).train.steps
    except (UserError, OSError, ValueError):
        return None
