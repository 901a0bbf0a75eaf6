"""What happens after the job step ends: requeue, stop, or finish — and why.

The batch script runs `dslurm requeue-me --rc RC` on node 0 once the step is over and
exits with what it returns. First the ending is classified from the facts recorded during
the start (dslurm/endings/__init__.py: who received which signal, each rank's own report, what Slurm
says), never from the step's exit code alone; then the policy (`decide`, pure) follows the
class:

- completed: end; later links of a chain are cancelled.
- user error, refused (run dir locked), save failed (disk full, non-finite state), diverged
  (non-finite loss under train.nonfinite=stop): stop with
  the class's own exit code; a retry cannot help, and the message says what to fix.
- cancelled, preempted, time limit (Slurm ended the step): stop with 143; Slurm decides
  whether the job comes back (`scontrol requeue`, preemption with requeue).
- warned stop (USR2, saved): requeue. Preemptions and time-limit requeues are not failures
  of the job: they spend no restart budget.
- crash (any rank, whatever code srun gave the others), node failure, burn-in rejection:
  requeue within the restart budget, counted over this job's earlier *failure* endings.
- stray stop (a TERM reached the job step, not the batch shell, while Slurm still ran the job:
  nobody said the run should end): requeue within `max_stray_stops`, counted over this job's
  earlier stray stops; the crash budget is not touched. A run is stopped on purpose with
  `scancel JOB` (it reaches the batch shell) or `dslurm cancel` (dslurm/requeue/cancel.py).
- operator stop (`dslurm ctl stop`, saved): end, not requeued; a chain's later links are
  cancelled, and then the job itself (`scancel`, its last act), so Slurm records it CANCELLED --
  stopped on purpose -- rather than FAILED with the ranks' 143.
- either way, the no-progress guard: if the pointer has not advanced across
  `no_progress_limit` consecutive starts, stop with its own exit code (76).
- in a chain, the next link continues instead of a requeue.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from dslurm import endings as E
from dslurm import exitcodes as X
from dslurm.errors import UserError
from dslurm.observe import events as ev
from dslurm.requeue.exclude import placeable_exclusion, requeue_excluding
from dslurm.requeue.oom import oom_fix
from dslurm.run import RunDir


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


_STOPS = {E.USER_ERROR: (X.USER_ERROR, "user error: fix the input and resubmit"),
          E.REFUSED: (X.REFUSED, "refused: another job holds this run directory's lock; not retried "
                                 "(cancel the other job, or give this one its own checkpoint.run_dir)"),
          E.SAVE_FAILED: (X.SAVE_FAILED, "checkpoint save failed: the final state is not durable; not retried "
                                         "(fix the cause named here, then resubmit: it resumes from the pointer)"),
          E.OOM: (X.OOM, "out of memory: not retried (the same layout and batch reach the same peak again); "
                         "change the layout, the micro-batch or the activation checkpointing, then resubmit"),
          E.DIVERGED: (X.NONFINITE, "training diverged (non-finite loss, train.nonfinite=stop): not retried; "
                                    "the pointer names a finite generation (lower train.lr or add warm-up, or "
                                    "set train.nonfinite: rollback, then resubmit)")}


def decide(*, ending: str, failures: int, max_restarts: int, no_progress_limit: int,
           start_steps: list[int], pointer_step: int, in_chain: bool = False,
           requeue_enabled: bool = True, detail: str = "", stray_stops: int = 0,
           max_stray_stops: int = 0) -> Decision:
    """Pure policy; see the module docstring. `failures`: this job's earlier failure endings;
    `stray_stops`: its earlier stray stops (`max_stray_stops`: the policy's budget for them)."""
    tail = f" [{detail}]" if detail else ""
    if ending == E.COMPLETED:
        return Decision("end", X.OK, "completed")
    if ending == E.OPERATOR_STOP:
        return Decision("stop", X.OK, f"operator stop (`dslurm ctl stop`): saved, not requeued; the job is "
                                      f"cancelled (Slurm: CANCELLED); `dslurm submit` again continues from the "
                                      f"checkpoint{tail}")
    if ending in _STOPS:
        code, why = _STOPS[ending]
        return Decision("stop", code, why + tail)
    if ending in E.SLURM_STOPS:
        return Decision("stop", X.TERMINATED, f"{ending.replace('_', ' ')}: Slurm ended the step and decides "
                                              f"what comes next{tail}")
    stalled = starts_without_progress(start_steps, pointer_step)
    if no_progress_limit > 0 and stalled >= no_progress_limit:
        return Decision("stop", X.NO_PROGRESS,
                        f"no progress: the last {stalled} starts all began at step {pointer_step} and the "
                        f"pointer has not advanced (limit {no_progress_limit}); look at the logs of those "
                        f"starts before resubmitting{tail}")
    what = {E.WARNED_STOP: "save-and-requeue", E.BURNIN_REJECTED: "bad nodes found by burn-in",
            E.NODE_FAILURE: "node failure"}.get(ending, ending.replace("_", " "))
    if in_chain:
        return Decision("end", X.OK, f"{what}: the next link of the chain continues{tail}")
    if not requeue_enabled:
        code = {E.WARNED_STOP: X.REQUEUE, E.STRAY_STOP: X.TERMINATED}.get(ending, 1)
        return Decision("stop", code, f"{what}, but requeue is off for this job (requeue.enabled: false){tail}")
    if ending == E.STRAY_STOP:
        if stray_stops >= max_stray_stops:
            return Decision("stop", X.BUDGET, f"stray stop, but its budget is spent ({stray_stops} of "
                                              f"{max_stray_stops} stray-stop requeues, requeue.max_stray_stops): "
                                              f"TERMs keep reaching the job step without Slurm ending the job; "
                                              f"find their sender (the ending's evidence names the nodes). To stop "
                                              f"a run on purpose: scancel JOB or dslurm cancel{tail}")
        return Decision("requeue", X.OK, f"stray stop (a TERM reached the job step only; not a cancel): requeue "
                                         f"(stray stop {stray_stops + 1} of {max_stray_stops}; no restart budget "
                                         f"spent; to end a run on purpose: scancel JOB, dslurm cancel or dslurm ctl "
                                         f"stop){tail}")
    if ending not in E.FAILURES:
        return Decision("requeue", X.OK, f"{what}: requeue (not a failure: no restart budget spent){tail}")
    if failures >= max_restarts:
        return Decision("stop", X.BUDGET, f"{what}, but the restart budget is spent "
                                          f"({failures} of {max_restarts} failure restarts){tail}")
    return Decision("requeue", X.OK, f"{what}: requeue (failure restart {failures + 1} of {max_restarts}){tail}")


def job_ref(env: Mapping[str, str]) -> str:
    """The id `scontrol requeue` needs: array tasks as ARRAYID_TASKID."""
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env["SLURM_JOB_ID"]


def chain_of(history: Iterable[ev.Event], job_id: str) -> list[int]:
    """The chain (list of job ids) this job belongs to, from the ledger's submit events."""
    for sub in ev.of(history, ev.Submit):
        if len(sub.job_ids) > 1 and job_id.isdigit() and int(job_id) in sub.job_ids:
            return list(sub.job_ids)
    return []


def start_steps_of(history: Iterable[ev.Event]) -> list[int]:
    return [e.step for e in ev.of(history, ev.TrainStart)]


def pointer_step(run_dir: Path) -> int:
    from dslurm.checkpoint import CheckpointError, read_pointer

    try:
        ptr = read_pointer(run_dir)
    except CheckpointError:
        return -1  # garbage pointer: no trusted progress
    return ptr.step if ptr else 0


def failures_of(history: Iterable[ev.Event], job_id: str) -> int:
    """This job's earlier endings that were failures (crash, node failure, burn-in)."""
    return sum(1 for e in ev.of(history, ev.Ending) if e.job_id == job_id and e.cls in E.FAILURES)


def stray_stops_of(history: Iterable[ev.Event], job_id: str) -> int:
    """This job's earlier endings that were stray stops (requeue.max_stray_stops counts them)."""
    return sum(1 for e in ev.of(history, ev.Ending) if e.job_id == job_id and e.cls == E.STRAY_STOP)


def decide_for(history: list[ev.Event], run_dir: Path, job_id: str, ending: E.Ending, policy: Any, *,
               in_chain: bool, requeue_enabled: bool) -> Decision:
    """`decide` with the run's frozen policy and this job's earlier endings from the ledger; an
    OOM's detail carries the planner's fix (dslurm/requeue/oom.py)."""
    detail = ending.reason
    if ending.cls == E.OOM:
        detail = f"{detail}. Fix: {oom_fix(run_dir)}"
    return decide(ending=ending.cls, failures=failures_of(history, job_id), max_restarts=policy.max_restarts,
                  no_progress_limit=policy.no_progress_limit, start_steps=start_steps_of(history),
                  pointer_step=pointer_step(run_dir), in_chain=in_chain, requeue_enabled=requeue_enabled,
                  detail=detail, stray_stops=stray_stops_of(history, job_id),
                  max_stray_stops=policy.max_stray_stops)


def _record_ending(run_dir: Path, d: Path, ending: E.Ending, *, step_rc: int | None = None,
                   late_for: tuple[str, int] | None = None, slurm_state: str | None = None) -> None:
    """The ending into its start's directory and the ledger; `late_for`: (job, restart) of an
    earlier start whose batch shell left no ending."""
    from dslurm.endings.facts import write_ending
    from dslurm.observe.ledger import Ledger

    job_id, restart = late_for or (None, None)
    event = ev.Ending(**ending.as_dict(), step_rc=step_rc, late=late_for is not None, slurm_state=slurm_state,
                      job_id=job_id, restart=restart)
    write_ending(d, {**event.fields(), "job_id": job_id, "restart": restart})
    Ledger(run_dir).append(event)


class _Accounting:
    """sacct's incarnations of each job, asked once per job while requeue-me runs."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env
        self._seen: dict[str, list[dict[str, object]]] = {}

    def incarnations(self, job: str) -> list[dict[str, object]]:
        from dslurm import slurm

        if job not in self._seen:
            self._seen[job] = slurm.incarnations(job, env=self.env) if job.isdigit() else []
        return self._seen[job]


Accounting = _Accounting  # for the submitit path (dslurm/api/job.py), which concludes a start like requeue-me


def _hosts(nodelist: str) -> list[str]:
    """sacct's node list of an incarnation as host names ([] when none or unreadable)."""
    from dslurm.slurm.hosts import expand_hosts

    if not nodelist or nodelist in ("None assigned", "None"):
        return []
    try:
        return expand_hosts(nodelist)
    except UserError:  # an odd node list must not stop the decision
        return []


def close_earlier_starts(run_dir: Path, current: Path | None, env: Mapping[str, str],
                         acct: _Accounting | None = None) -> None:
    """Write the ending of every earlier start that has none: its batch shell died with it
    (node failure, SIGKILL of the whole job). Whoever runs next records it, from that start's
    facts and what accounting says about that incarnation."""
    from dslurm.endings.facts import list_starts, parse_start_name, read_start

    acct = acct or _Accounting(env)
    for d in list_starts(run_dir):
        if d == current or (d / "ending.json").exists():
            continue
        job, n, _step = parse_start_name(d.name)
        incs = acct.incarnations(job)
        inc = incs[n] if 0 <= n < len(incs) else {}
        state = str(inc["state"]) if inc else None
        if state in ("RUNNING", "PENDING", "COMPLETING", "CONFIGURING", "SUSPENDED"):
            continue  # another job of this run is still in that start (e.g. a second submission)
        # A NODE_FAIL incarnation's nodes are the suspects; classify names those without a report.
        suspects = tuple(_hosts(str(inc.get("nodes", "")))) if (state or "").startswith("NODE_FAIL") else ()
        ending = E.classify(read_start(d), E.SlurmView(state=state, down_nodes=suspects,
                                                       node_states=("incarnation NODE_FAIL",) if suspects else ()))
        ending.evidence.append("recorded late, by the next start: this start's batch shell left no ending")
        _record_ending(run_dir, d, ending, late_for=(job, n), slurm_state=state)


def classify_this_start(run_dir: Path, rc: int, env: Mapping[str, str], acct: _Accounting, *,
                        d: Path | None = None, hosts: list[str] | None = None) -> tuple[E.Ending, Path | None]:
    """The ending of this start's job step from its facts dir (`d`, default from the environment)
    and Slurm's view of `hosts` (default: the whole allocation; a supervised step passes its own
    nodes, so a spare that is down is never taken for the node that ended the step)."""
    from dslurm import slurm
    from dslurm.endings.facts import StartFacts, read_start, start_dir

    d = d if d is not None else start_dir(env, run_dir)
    facts = read_start(d) if d is not None else StartFacts("?", [], [], [], None)
    incs = acct.incarnations(env.get("SLURM_JOB_ID", ""))
    hosts = _hosts(env.get("SLURM_JOB_NODELIST", "")) if hosts is None else hosts
    down = slurm.down_nodes(hosts, env=env) if hosts else {}
    view = E.SlurmView(state=str(incs[-1]["state"]) if incs else None, down_nodes=tuple(down),
                       node_states=tuple(f"{k}: {v}" for k, v in down.items()))
    return E.classify(facts, view, rc), d


def frozen_policy(run_dir: Path) -> Any:
    """The requeue policy of the run, from the config frozen into the run directory at submit
    (site.yaml, job.yaml): the same `RequeuePolicy` render, submit and the API used."""
    from dslurm.config.resolve import requeue_policy

    return requeue_policy(*RunDir(run_dir).config())


def retry_decision(run_dir: Path, job_id: str, ending: E.Ending, policy: Any) -> Decision:
    """Would a failure ending be retried? `decide` with the run's restart budget and no-progress
    guard, asked before the ending is recorded (as requeue-me does): the in-allocation recovery
    (dslurm/recover/supervise.py) retries only what a requeue would."""
    # Recovering inside the allocation is no requeue: requeue.enabled does not forbid it (as before).
    return decide_for(ev.read(run_dir), run_dir, job_id, ending, policy, in_chain=False, requeue_enabled=True)


Act = Callable[[Decision, E.Ending, Mapping[str, str], Path, list[int]], None]


def conclude(run_dir: Path, d: Path | None, ending: E.Ending, rc: int, env: Mapping[str, str],
             acct: _Accounting, act: Act | None = None) -> Decision:
    """Record the ending, decide with the frozen policy, record the decision, act on it."""
    from dslurm.observe.ledger import Ledger

    close_earlier_starts(run_dir, d, env, acct)
    history = ev.read(run_dir)  # read before this ending is recorded: the budgets count earlier ones
    job_id = env.get("SLURM_JOB_ID", "")
    if d is not None:
        _record_ending(run_dir, d, ending, step_rc=rc)
    chain = chain_of(history, job_id)
    policy = frozen_policy(run_dir)
    dec = decide_for(history, run_dir, job_id, ending, policy, in_chain=bool(chain), requeue_enabled=policy.enabled)
    Ledger(run_dir).append(ev.Requeue(decision=dec.action, step_rc=rc, exit_code=dec.exit_code,
                                      reason=dec.reason, ending=ending.cls))
    print(f"dslurm: step ended: {ending.cls} ({ending.reason}); exit {rc}; decision: {dec.action}: "
          f"{dec.reason}", flush=True)
    remember_nodes(run_dir)
    (act or act_on)(dec, ending, env, run_dir, chain)
    return dec


def remember_nodes(run_dir: Path) -> None:
    """Feed the site's memory of its nodes from this run's ledger (dslurm/observe/nodes.py):
    burn-in failures, Xid, hang suspects, SDC, repeated stragglers. Never fails requeue-me."""
    from dslurm.observe import nodes
    from dslurm.run import RunDir

    try:
        site, _ = RunDir(run_dir).config()
        new = nodes.record_run(site.storage.durable, run_dir)
    except Exception as exc:  # noqa: BLE001 - a memory that cannot be written costs this run nothing
        print(f"dslurm: site node memory not updated: {exc}", flush=True)
        return
    if new:
        print(f"dslurm: site node memory: {new} new piece(s) of evidence against nodes "
              f"(`dslurm site nodes --site SITE` shows them)", flush=True)


def act_on(dec: Decision, ending: E.Ending, env: Mapping[str, str], run_dir: Path, chain: list[int]) -> None:
    """Carry a decision out: requeue (keeping the job off the run's blocklist), or cancel a
    finished chain's later links."""
    from dslurm import slurm
    from dslurm.observe.ledger import Ledger

    job_id = env.get("SLURM_JOB_ID", "")
    if dec.action == "requeue":
        from dslurm.run import read_blocklist

        blocked = read_blocklist(run_dir)
        if blocked:  # an exclusion the partition can spare: never a job pending for ever
            ex = placeable_exclusion(blocked, _nodes_or_none(), env.get("SLURM_JOB_PARTITION"),
                                     int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 0))
            if ex.readmitted:
                print(f"dslurm: requeue: {ex.reason}", flush=True)
                Ledger(run_dir).append(ev.BlocklistWaived(hosts=ex.readmitted, excluded=ex.exclude,
                                                          reason=ex.reason))
            requeue_excluding(job_ref(env), ex.exclude)  # an empty list clears an earlier ExcNodeList
        else:
            slurm.run_cmd(["scontrol", "requeue", job_ref(env)])
    elif ending.cls in (E.COMPLETED, E.OPERATOR_STOP) and chain:
        later = [i for i in chain if job_id.isdigit() and i > int(job_id)]
        if later:
            slurm.run_cmd(["scancel", *map(str, later)], check=False)
            Ledger(run_dir).append(ev.ChainCancel(job_ids=later, reason="training complete"
                                                  if ending.cls == E.COMPLETED else "operator stop"))
    if ending.cls == E.OPERATOR_STOP and dec.action == "stop" and job_id:
        cancel_self(job_ref(env))


def cancel_self(job: str) -> None:
    """The last act of an operator's stop: `scancel` this job, so Slurm records it CANCELLED (the
    state a person reads as "stopped on purpose"), not FAILED with the ranks' 143. The TERM that
    follows reaches this process too (the batch step's processes): ignored, its work is done."""
    import signal

    from dslurm import slurm

    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    slurm.run_cmd(["scancel", job], check=False)


def requeue_me(rc: int, env: Mapping[str, str] | None = None) -> int:
    """Classify this start's ending, decide, record both in the ledger, act."""
    env = dict(os.environ if env is None else env)
    run_dir = Path(env["DSLURM_RUN_DIR"])
    acct = _Accounting(env)
    ending, d = classify_this_start(run_dir, rc, env, acct)
    return conclude(run_dir, d, ending, rc, env, acct).exit_code


def _nodes_or_none() -> list[dict[str, object]]:
    """The cluster's nodes for `placeable_exclusion`; [] when sinfo cannot answer (slurmctld
    restarting): the exclusion then stays whole, as before."""
    from dslurm import slurm

    try:
        return slurm.nodes()
    except Exception as exc:  # noqa: BLE001 - any failure to ask leaves the old rule
        print(f"dslurm: requeue: sinfo did not answer ({exc}); the blocklist is excluded whole", flush=True)
        return []


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("requeue-me", help="(in the batch script) requeue, stop or finish after the job step")
    p.add_argument("--rc", type=int, required=True, help="exit code of the job step")
    p.set_defaults(func=lambda args: requeue_me(args.rc))
