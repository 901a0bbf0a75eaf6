"""How a job step ended, decided from the facts its participants recorded (dslurm/endings/facts.py)
and from what Slurm says about the job. Pure: no I/O; `dslurm requeue-me` gathers the inputs.

Rules, first match wins:
  1. Slurm says the job hit NODE_FAIL, or reports one of the job's nodes down whose launcher
     left no report (a node that wrote its report was alive at the end of the step: a down
     state seen afterwards is not what ended it): node failure.
  2. A TERM reached the *batch shell* before any rank failed of its own accord: Slurm ended
     the step (scancel, preemption, `scontrol requeue`, the time limit). A TERM that reached
     only a launcher may be srun tearing the step down after another node failed: it
     decides nothing on its own. A TERM that came after every rank had saved on a stop
     warning (the time limit arriving while requeue-me runs) does not undo that stop. The class
     follows Slurm's state; a `dslurm cancel` request on record while the job still runs makes
     it a cancel.
  3. The earliest failure a rank reported of its own: crash (a hang the watchdog caught is one),
     save failure, user error, refused (run dir locked), burn-in rejection, diverged (non-finite
     loss under train.nonfinite=stop), oom (out of memory: torch.OutOfMemoryError). A peer's "connection closed" marks a
     victim, never the origin.
  4. A stop the ranks agreed on and saved: `dslurm ctl stop` on record (the rank that took it
     wrote it, via "ctl"): an operator's stop, its own ending. USR2 (the time-limit warning): a warned stop. TERM
     that reached the step only (the batch shell got none): a stray stop while Slurm still runs
     the job (RUNNING, COMPLETING, or its state unknown); a cancel once Slurm says the job is
     cancelled, or when `dslurm cancel` recorded the request.
  5. Every rank completed.
  6. A launcher whose torchrun failed while it had received no TERM (USR2 is only a warning):
     a crash, on the node whose ranks left no report (killed -9, died in C code) -- even if
     that node's launcher got srun's TERM after its peers, who saw it vanish, exited first.
  7. Some or every launcher received a TERM (none ended the step with a failure of its own, the
     exit srun's teardown would follow), the batch shell none, and no rank failed or saved: the
     TERM stopped workers that write no report (a plain script, the probe, the burn-in, a trainer
     before its handlers), whatever torchrun (1 on TERM) and srun returned. While Slurm still runs
     the job nobody said the run should end (a TERM aimed at the step alone is not how a run is
     stopped: `scancel JOB` reaches the batch shell, `dslurm cancel` records the request): a
     stray stop, naming who got the TERM and when. Once Slurm says the job is cancelled (or a
     `dslurm cancel` request is on record) and every launcher got the TERM: a cancel.
  8. No facts at all (nothing could be written): a step srun said slurmctld would not create
     (srun-refused.json) is a crash naming srun's words; otherwise the step's exit code, said plainly; a
     143 that nobody asked for (no TERM at the batch shell, Slurm still runs the job) is a crash.

A stray stop is requeued within a budget of its own (dslurm/requeue/__init__.py::decide); seen in
the field ~40 s after the requeue of a hung start, on the node that had been holding it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dslurm import exitcodes as X
from dslurm.endings.facts import OWN_FAILURES, StartFacts, is_term, victim_kind

COMPLETED, WARNED_STOP, CANCELLED, PREEMPTED, TIME_LIMIT = (
    "completed", "warned_stop", "cancelled", "preempted", "time_limit")
CRASH, NODE_FAILURE, SAVE_FAILED, REFUSED, USER_ERROR, BURNIN_REJECTED, DIVERGED = (
    "crash", "node_failure", "save_failed", "refused", "user_error", "burnin_rejected", "diverged")
OOM = "oom"  # a rank ran out of memory (train/oom.py): the same layout and batch would again
# A TERM reached the job step but not the batch shell while Slurm still ran the job: nobody
# said the run should end. Requeued within requeue.max_stray_stops, not the crash budget.
STRAY_STOP = "stray_stop"
# `dslurm ctl stop` (dslurm/observe/ctl.py): an operator asked the running job to save and end.
# Not a cancel (no signal reached anyone) and not requeued; the job is then ended CANCELLED.
OPERATOR_STOP = "operator_stop"
FAILURES = (CRASH, NODE_FAILURE, BURNIN_REJECTED)  # retried within the crash budget
SLURM_STOPS = (CANCELLED, PREEMPTED, TIME_LIMIT)  # Slurm ended the step: Slurm decides what next
# Accounting's states of an incarnation that Slurm has not ended (None: accounting said nothing).
_STILL_RUNNING = ("RUNNING", "COMPLETING", "CONFIGURING", "UNKNOWN", "")

@dataclass(frozen=True)
class SlurmView:
    """What Slurm says about the job at the end of the step (see dslurm.slurm.job_ending_view)."""

    state: str | None = None  # accounting's state of this incarnation: RUNNING, CANCELLED, REQUEUED, ...
    down_nodes: tuple[str, ...] = ()  # nodes of this job that Slurm reports down / failing
    node_states: tuple[str, ...] = ()  # the state words that said so, for the evidence


@dataclass
class Ending:
    cls: str
    reason: str
    origin_rank: int | None = None
    origin_host: str | None = None
    step: int | None = None
    saved: bool = False  # the stop's synchronous save committed
    evidence: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _own_failures(ranks: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    """Reports of ranks that failed of their own accord, earliest first."""
    out = []
    for r in ranks:
        if r.get("kind") not in OWN_FAILURES:
            continue
        if victim_kind(str(r["kind"]), str(r.get("error", "")), r.get("signal")) != r["kind"]:
            continue  # a crash report that is really a victim's (older writers): not the origin
        out.append(r)
    return sorted(out, key=lambda r: float(r.get("t") or 0))


def _slurm_stop(state: str | None) -> str:
    s = (state or "").upper()
    if s.startswith("CANCEL"):
        return CANCELLED
    if s.startswith("TIMEOUT"):
        return TIME_LIMIT
    return PREEMPTED  # REQUEUED (scontrol requeue, preemption with requeue), PREEMPTED, or unknown


def _max_step(ranks: Sequence[Mapping[str, Any]]) -> int | None:
    steps = [int(r["step"]) for r in ranks if isinstance(r.get("step"), int)]
    return max(steps) if steps else None


def _got_term(launcher: Mapping[str, Any]) -> bool:
    return any(is_term(str(s[0])) for s in launcher.get("signals") or [])


def _term_t(launcher: Mapping[str, Any]) -> float:
    return min(float(s[1]) for s in launcher.get("signals") or [] if is_term(str(s[0])))


def _still_running(state: str | None) -> bool:
    """Slurm has not ended this incarnation: RUNNING, COMPLETING, ... or accounting said nothing."""
    return (state or "").upper().split(" ")[0] in _STILL_RUNNING


def _cancel_line(facts: StartFacts) -> str | None:
    """The `dslurm cancel` request recorded for this start, said for the evidence; None without one."""
    req = facts.cancel
    if not req:
        return None
    return (f"`dslurm cancel{' --save' if req.get('save') else ''}` requested by {req.get('user', '?')} at "
            f"{float(req.get('t') or 0):.3f}")


def _stray(facts: StartFacts, slurm: SlurmView, ranks: Sequence[Mapping[str, Any]], saved: bool) -> Ending:
    """Rule 4's or 7's TERM that reached the job step alone while Slurm still ran the job."""
    got = sorted(((str(ln.get("host")), _term_t(ln)) for ln in facts.launchers if _got_term(ln)), key=lambda x: x[1])
    spared = sorted(str(ln.get("host")) for ln in facts.launchers if not _got_term(ln))
    where = ", ".join(f"{h} at {t:.3f}" for h, t in got) or "the ranks (no launcher recorded it)"
    step = _max_step(ranks)
    ev = [f"TERM reached the job step only: launcher(s) {where}" + (f"; none at {', '.join(spared)}" if spared else ""),
          f"the batch shell got no TERM (its signals: {facts.batch_signals or 'none'})",
          f"slurm: job state {slurm.state} (Slurm had not ended the job)", "no `dslurm cancel` request on record",
          f"rank reports: {sorted({str(r.get('kind')) for r in ranks}) or 'none'}",
          *map(_launcher_line, facts.launchers)]
    return Ending(STRAY_STOP, f"stray stop: a TERM reached the job step only ({where}), not the batch shell, while "
                  f"Slurm still ran the job (state {slurm.state}); not a cancel of the run; "
                  + (f"saved at step {step}" if saved else "its workers wrote no report; no save"),
                  step=step, saved=saved, evidence=ev)


def _launcher_line(ln: Mapping[str, Any]) -> str:
    return (f"launcher on {ln.get('host')}: torchrun rc {ln.get('torchrun_rc')}, signals {ln.get('signals')}, "
            f"worker codes {ln.get('worker_codes')}, silent {ln.get('silent_local_ranks')}")


def _silent_origin(launchers: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """Rule 6's node, when no rank reported a failure of its own: only if some launcher's torchrun
    failed with no TERM received (a failure of its own, not srun's teardown). Of the failed ones,
    the node whose process left no report wins over the exit order: its peers' ranks see it vanish
    and may exit first, and srun then TERMs the silent node's launcher. So: silent without a TERM,
    else silent with a TERM, else the first to fail. Pure."""
    failed = [ln for ln in launchers if ln.get("torchrun_rc")]
    if not any(not _got_term(ln) for ln in failed):
        return None
    return min(failed, key=lambda ln: (not ln.get("silent_local_ranks"), _got_term(ln), float(ln.get("t") or 0)))


def _by_rc(rc: int | None) -> tuple[str, str]:
    if rc == X.OK:
        return COMPLETED, "exit 0"
    if rc == X.REQUEUE:
        return WARNED_STOP, "exit 75"
    if rc == X.USER_ERROR:
        return USER_ERROR, "exit 2"
    if rc == X.TERMINATED:
        return CANCELLED, "exit 143"
    return CRASH, f"exit {rc}"


def classify(facts: StartFacts, slurm: SlurmView, step_rc: int | None = None) -> Ending:
    """The ending of one start; see the module docstring for the rules."""
    ranks, ev = facts.ranks, []
    own = _own_failures(ranks)
    first_fail_t = float(own[0].get("t") or 0) if own else None
    reported = {str(ln.get("host")) for ln in facts.launchers}
    lost = [n for n in slurm.down_nodes if n not in reported]
    if lost or (slurm.state or "").upper().startswith("NODE_FAIL"):
        nodes = ",".join(lost) or "?"
        said = "; ".join(x for x in slurm.node_states if x.split(":")[0] in lost) or f"{nodes} down"
        return Ending(NODE_FAILURE, f"node failure: {said}, and its launcher left no report "
                      f"(job state {slurm.state})", origin_host=lost[0] if lost else None, step=_max_step(ranks),
                      evidence=[f"slurm: nodes down {nodes} ({', '.join(slurm.node_states)})",
                                f"slurm: job state {slurm.state}", f"launcher reports from {sorted(reported)}"])
    terms = [t for s, t in facts.batch_signals if s in ("TERM", "SIGTERM")]
    saved_t = [float(r.get("t") or 0) for r in ranks if r.get("kind") == "stop_saved"]
    warned_first = bool(terms) and bool(saved_t) and len(saved_t) == len(ranks) and max(saved_t) <= min(terms)
    asked = _cancel_line(facts)
    stray_ok = not terms and not asked and _still_running(slurm.state)  # nobody said the run should end
    if terms and (first_fail_t is None or min(terms) <= first_fail_t) and not warned_first:
        # a TERM while the job still runs is a preemption's grace time, or the user's with the request on record
        cls = CANCELLED if asked and _still_running(slurm.state) else _slurm_stop(slurm.state)
        saved = any(r.get("kind") == "terminated_saved" for r in ranks)
        ev = [f"batch shell got TERM at {min(terms):.3f}", f"slurm: job state {slurm.state}", *filter(None, [asked])]
        if own:
            ev.append(f"first own failure later, at {first_fail_t:.3f} (rank {own[0].get('rank')})")
        what = {CANCELLED: "cancelled by the user (scancel)", TIME_LIMIT: "killed at the time limit",
                PREEMPTED: "preempted or requeued by Slurm"}[cls]
        return Ending(cls, f"{what}; " + (f"saved at step {_max_step(ranks)}" if saved else "no save"),
                      step=_max_step(ranks), saved=saved, evidence=ev)
    if own:
        f = own[0]
        kind, rank, host = str(f["kind"]), f.get("rank"), f.get("host")
        victims = [r.get("rank") for r in ranks if r is not f and r.get("kind") not in ("completed",)]
        ev = [f"rank {rank} on {host} reported {kind} at {float(f.get('t') or 0):.3f}: {f.get('error', '')}"[:400]]
        if terms:
            ev.append(f"batch shell TERM only later, at {min(terms):.3f}")
        if victims:
            ev.append(f"other ranks ended after it: {victims}")
        if kind == BURNIN_REJECTED:  # every rank reports the same verdict: its text names the nodes
            return Ending(kind, str(f.get("error") or "the burn-in rejected a node")[:300], step=f.get("step"),
                          evidence=ev)
        return Ending(kind, f"{kind.replace('_', ' ')} on rank {rank} ({host}) at step {f.get('step')}: "
                      f"{str(f.get('error', ''))[:300]}", origin_rank=rank, origin_host=host,
                      step=f.get("step"), evidence=ev)
    kinds = {str(r.get("kind")) for r in ranks}
    usr2 = [t for s, t in facts.batch_signals if s in ("USR2", "SIGUSR2")]
    if "stop_saved" in kinds or "terminated_saved" in kinds:
        term = "terminated_saved" in kinds
        if term and facts.cancel and facts.cancel.get("via") == "ctl":
            user = str(facts.cancel.get("user", "?")).replace(" (dslurm ctl stop)", "")
            return Ending(OPERATOR_STOP, f"operator stop: `dslurm ctl stop` by {user}; saved at step "
                          f"{_max_step(ranks)}", step=_max_step(ranks), saved=True,
                          evidence=[f"`dslurm ctl stop` requested by {user}, taken by rank 0 at "
                                    f"{float(facts.cancel.get('t') or 0):.3f}",
                                    f"ranks agreed to stop and saved: {sorted(kinds)}",
                                    f"the batch shell's signals: {facts.batch_signals or 'none'}"])
        if term and stray_ok:
            return _stray(facts, slurm, ranks, saved=True)
        cls = CANCELLED if term else WARNED_STOP
        ev = [f"ranks agreed to stop and saved: {sorted(kinds)}", *filter(None, [asked])]
        if term:
            ev.append(f"slurm: job state {slurm.state}")
        if usr2:
            ev.append(f"batch shell got USR2 at {min(usr2):.3f}")
        why = ("the user's `dslurm cancel` (TERM to the job step)" if asked else "TERM aimed at the job step") \
            if term else "a stop warning (USR2)"
        return Ending(cls, f"stopped on {why}; saved at step {_max_step(ranks)}", step=_max_step(ranks),
                      saved=True, evidence=ev)
    if ranks and kinds == {"completed"}:
        return Ending(COMPLETED, f"training complete at step {_max_step(ranks)}", step=_max_step(ranks),
                      saved=True, evidence=[f"{len(ranks)} rank(s) reported completed"])
    origin = _silent_origin(facts.launchers)
    if origin is not None:
        silent = origin.get("silent_local_ranks") or []
        got = "a TERM only after its peers had failed" if _got_term(origin) else "no TERM"
        return Ending(CRASH, f"crash on {origin.get('host')}: torchrun exited {origin.get('torchrun_rc')} with "
                      f"{got}; local rank(s) {silent} left no report (killed -9 or died in native code)",
                      origin_host=origin.get("host"), step=_max_step(ranks),
                      evidence=[_launcher_line(ln) for ln in facts.launchers])
    # A launcher that ended non-zero with no TERM ended the step itself: srun's teardown sent the
    # others theirs (a known sender), so that is not a stray stop.
    own_exit = any(int(ln.get("code") or 0) and not _got_term(ln) for ln in facts.launchers)
    if stray_ok and not own_exit and any(_got_term(ln) for ln in facts.launchers):
        return _stray(facts, slurm, ranks, saved=False)
    if facts.launchers and all(_got_term(ln) for ln in facts.launchers):
        return Ending(CANCELLED, "stopped by a TERM aimed at the job step; its workers wrote no report; no save",
                      step=_max_step(ranks),
                      evidence=[*map(_launcher_line, facts.launchers), f"step rc {step_rc} (not read)",
                                f"slurm: job state {slurm.state}", *filter(None, [asked])])
    if not ranks and not facts.launchers and terms:
        return Ending(_slurm_stop(slurm.state), f"ended by Slurm (TERM) before training reported; state "
                      f"{slurm.state}", evidence=[f"batch shell got TERM at {min(terms):.3f}"])
    if facts.refused and not ranks and not facts.launchers:
        # recover/supervisor.py starts a refused step again for a while first: this one stayed refused
        return Ending(CRASH, f"Slurm would not create the job step: {facts.refused}",
                      evidence=[f"srun: {facts.refused}", f"step rc {step_rc}", f"slurm: job state {slurm.state}"])
    cls, why = _by_rc(step_rc)
    if cls == CANCELLED and stray_ok:
        # Nobody asked: no TERM at the batch shell and Slurm still runs the job. A step whose processes
        # all died before recording anything returns 143 as well (a launcher killed -9 at start-up,
        # srun's teardown TERMing the others): found by `dslurm selftest chaos`, where it ended the run.
        cls, why = CRASH, f"{why}, with no TERM at the batch shell while Slurm still runs the job"
    return Ending(cls, f"no per-rank facts were recorded; decided from the step's {why}",
                  step=_max_step(ranks), evidence=[f"step rc {step_rc}", f"kinds {sorted(kinds)}"])
