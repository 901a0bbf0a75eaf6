"""The in-allocation recovery loop of a job with spares (`dslurm supervise`, dslurm/recover/supervise.py).

The batch script of a job with `spares: k` runs this once, on the first node, instead of one
srun plus `dslurm requeue-me`. It starts each job step with `srun --nodelist` on the training
nodes, and when a step ends:

1. classifies the ending from that step's own facts dir (`starts/<job>.<restart>.<step>`,
   dslurm/endings/facts.py) and what Slurm says about the step's nodes (`endings.classify`),
   never from srun's code alone;
2. a failure (crash, node failure, burn-in rejection) that a requeue would retry (`requeue.decide`:
   restart budget, no-progress guard) is recovered here: the nodes at fault go on the run's
   blocklist (and are drained where the site allows), `recover.plan_recovery` picks the next
   training nodes (the same ones, a spare swapped in, or fewer with `shrink`), a `Recovery` event
   goes to the ledger, and the next step starts at once: it resumes from the checkpoint pointer;
3. anything else (completed, a stop Slurm asked for, a stop signal received meanwhile, a spent
   budget, spares exhausted under `requeue`) is concluded exactly as `requeue-me` does
   (`requeue.conclude`): the last decision and the script's exit code.

Slurm's USR2/TERM reach this process (forwarded by the batch shell's trap, or directly): each
is recorded in the current step's `batch.signals`, forwarded to srun, and no new step starts.
All I/O with Slurm and the processes goes through a `Runner`, so the loop runs against a fake.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from dslurm import endings as E
from dslurm.config.resolve import Resolved
from dslurm.endings.facts import StartFacts
from dslurm.errors import UserError
from dslurm.observe import events as ev
from dslurm.recover import Nodes, Plan, initial_nodes, nodes_at_fault, plan_recovery, shrink_grad_accum
from dslurm.requeue import Decision, _Accounting

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class Step:
    """One job step to run."""

    index: int
    hosts: tuple[str, ...]
    facts_dir: Path
    grad_accum: int | None = None
    """set after a shrink: the trainer gets `--set train.grad_accum=N`"""
    warm: bool = False
    """the launchers ask their nodes' warm pools for the workers (dslurm/launch/warm.py)"""
    stop: str | None = None
    """a stop Slurm sent before this step began (USR2, TERM): its launchers hand it to the trainer"""


class Pools(Protocol):
    """The warm pools of the allocation's nodes (recovery.warm)."""

    def ready(self, hosts: Sequence[str]) -> bool: ...
    def tick(self, step_over: bool) -> None:
        """Called about once a second while a step runs, and once when it ended (`step_over`)."""
        ...


class Runner(Protocol):
    """Everything the loop does outside itself: run a step, ask Slurm, act on a decision."""

    def run(self, step: Step, abandon: Callable[[], bool]) -> int:
        """Run the step to its end, or until `abandon()` (asked about once a second) says the
        step is over although srun is still waiting; return srun's code."""
        ...
    def signal(self, signum: int) -> None: ...
    def view(self, hosts: Sequence[str]) -> E.SlurmView: ...
    def act(self, dec: Decision, ending: E.Ending, env: Mapping[str, str], run_dir: Path,
            chain: list[int]) -> None: ...
    def drain(self, hosts: Sequence[str], reason: str) -> None: ...
    def probe(self, hosts: Sequence[str], timeout_s: float) -> tuple[str, ...]: ...


class Supervisor:
    def __init__(self, r: Resolved, runner: Runner, env: Mapping[str, str], alloc: Sequence[str],
                 pools: Pools | None = None) -> None:
        self.r, self.runner, self.env, self.pools = r, runner, dict(env), pools
        self.run_dir = r.run_dir
        self.job_id = env.get("SLURM_JOB_ID", "")
        self.restart = int(env.get("SLURM_RESTART_COUNT") or 0)
        self.alloc = list(alloc)
        self.stopping: str | None = None
        self.facts_dir: Path | None = None
        self._unwritten: list[str] = []  # signals recorded before the first step's facts dir existed
        # A node that left no report is probed at once rather than waiting for Slurm to mark it
        # down: SlurmdTimeout is 10 s on the local cluster but 300 s by default on real ones, and
        # waiting for it (up to 45 s here) made a spare swap slower than a requeue.
        # 8 s on an idle machine, stretched by the load (slurm.load_factor): on 2 busy cores an
        # `srun true` took longer, and a node holding a SIGSTOPped rank was swapped out as lost
        # (`dslurm selftest chaos`, seed 1).
        self.probe_base_s = 8.0
        # srun waits for a lost node's tasks until Slurm marks the node down (~25 s here): once a
        # launcher reported a failure and a node stayed silent for `grace_s`, the silent nodes are
        # probed, and a step whose silent nodes are all gone is abandoned instead of waited for.
        # A probe of a node that was only slow to report costs one `srun true` beside the step
        # (its slurmd listens, so it is asked) and abandons nothing; 2 s here was ~1/3 of a warm
        # spare swap (bench/bench_warm_spare.py), 0.5 s covers a launcher's report after its peer's.
        self.grace_s = 0.5
        self.unanswered: set[str] = set()  # nodes that failed a probe: down for the plan too
        # A step slurmctld would not create (it restarted: its nodes register again when it next
        # pings them, every SlurmdTimeout/3; 5-60 s of refusals here, longer where SlurmdTimeout is
        # the default 300 s) is started again for this long, stretched by the load (`_run`).
        self.refused_base_s, self.refused_pause_s = 180.0, 1.0

    def on_signal(self, name: str) -> None:
        """A stop from Slurm: recorded as the batch shell's (it is the batch shell's delegate), and
        no further step starts."""
        self.stopping = self.stopping or name
        self._unwritten.append(f"{name} {time.time():.6f}\n")
        self._write_signals()

    def _write_signals(self) -> None:
        """Into the current step's batch.signals; those that came before the first step go to it."""
        if self.facts_dir is None:
            return
        try:
            with open(self.facts_dir / "batch.signals", "a") as fh:
                fh.writelines(self._unwritten)
            self._unwritten.clear()
        except OSError as exc:
            log.error("could not record %s: %s", "".join(self._unwritten).strip(), exc)

    def probe_s(self) -> float:
        from dslurm import slurm

        return self.probe_base_s * slurm.load_factor()

    def step_dir(self, index: int) -> Path:
        from dslurm.endings.facts import STARTS, start_name

        d = self.run_dir / STARTS / start_name(self.job_id, self.restart, index)
        d.mkdir(parents=True, exist_ok=True)
        return d

    def loop(self) -> int:
        """Run steps until one ends in something not recovered here; return the script's exit code."""
        from dslurm.endings.facts import read_start
        from dslurm.requeue import _Accounting, frozen_policy, retry_decision
        from dslurm.run import read_blocklist

        acct = _Accounting(self.env)
        nodes = initial_nodes(self.alloc, self.r.nnodes, read_blocklist(self.run_dir))
        index, accum, warm = 0, None, False
        while True:
            d = self.facts_dir = self.step_dir(index)
            self._write_signals()
            # Warm only after a failure (the first step is the cold start), never twice in a row after
            # a failed warm step (a failure during a warm restart falls back to the cold path), and
            # only when every training node's pool serves.
            warm = self.pools is not None and index > 0 and not warm and self.pools.ready(nodes.training)
            log.info("dslurm supervise: step %d on %s%s", index, ",".join(nodes.training), " (warm)" if warm else "")
            # A stop that came while no step ran (before the first, during a recovery) goes with it.
            stop = f"SIG{self.stopping}" if self.stopping else None
            rc = self._run(Step(index=index, hosts=nodes.training, facts_dir=d, grad_accum=accum, warm=warm,
                                stop=stop))
            t_end = time.time()
            if self.pools is not None:
                self.pools.tick(step_over=True)
            view = self._view_after(d, nodes.training)
            ending = E.classify(read_start(d), view, rc)
            if self.stopping or ending.cls not in E.FAILURES:
                return self._conclude(d, ending, rc, acct)
            if retry_decision(self.run_dir, self.job_id, ending, frozen_policy(self.run_dir)).action != "requeue":
                return self._conclude(d, ending, rc, acct)  # budget spent or no progress: decided there
            planned = self._plan(ending, nodes, view)
            if planned is None or self.stopping:
                return self._conclude(d, ending, rc, acct)  # spares exhausted: requeue without the bad nodes
            plan, shrunk = planned
            accum = shrunk if shrunk is not None else accum
            self._record(d, ending, rc, plan, nodes, index + 1, accum, failed_at(read_start(d), t_end))
            nodes, index = plan.nodes, index + 1

    def _run(self, step: Step) -> int:
        """Run the step; one slurmctld would not create for a reason that says nothing about the
        nodes (srun's words in the facts dir: it restarted and they have not registered again) ran
        nothing, so nothing failed: it is started again after a pause, doubling to 8 s, for up to
        `refused_s`. Chaos seed 4444: a slurmctld restart as a start began refused its step and
        the probes; both nodes were read as lost, the restart budget spent, the job requeued."""
        from dslurm.endings.facts import REFUSED, read_start

        deadline = time.monotonic() + self.refused_s()
        pause = self.refused_pause_s
        while True:
            rc = self.runner.run(step, self._ticking(self._abandon_when_lost(step.facts_dir, step.hosts)))
            facts = read_start(step.facts_dir)
            if facts.refused is None or facts.launchers or facts.ranks or self.stopping \
                    or time.monotonic() + pause > deadline:
                return rc
            log.warning("dslurm supervise: slurmctld would not create step %d (%s); trying again in %.1f s",
                        step.index, facts.refused, pause)
            (step.facts_dir / REFUSED).unlink(missing_ok=True)
            until = time.monotonic() + pause
            while time.monotonic() < until and not self.stopping:  # a stop ends the wait
                time.sleep(0.1)
            if self.stopping:
                return rc
            pause = min(2 * pause, 8.0)

    def refused_s(self) -> float:
        from dslurm import slurm

        return self.refused_base_s * slurm.load_factor()

    def _ticking(self, abandon: Callable[[], bool]) -> Callable[[], bool]:
        """`abandon`, which also lets the warm pools act once a second while a step runs."""
        def tick() -> bool:
            if self.pools is not None:
                self.pools.tick(step_over=False)
            return abandon()
        return tick

    def _abandon_when_lost(self, d: Path, hosts: Sequence[str]) -> Callable[[], bool]:
        """The `abandon` of one step: true once a launcher reported a failure `grace_s` ago, some
        training nodes left no report, and those nodes do not answer a probe (they are probed once:
        a silent node that answers is alive and srun will end the step itself)."""
        from dslurm.endings.facts import read_start

        probed = False

        def abandon() -> bool:
            nonlocal probed
            if probed or self.stopping:
                return False
            launchers = read_start(d).launchers
            failed = [float(x.get("t") or 0) for x in launchers if int(x.get("code") or 0) != 0]
            silent = silent_hosts(launchers, hosts)
            if not failed or not silent or time.time() - min(failed) < self.grace_s:
                return False
            probed = True
            dead = self.runner.probe(silent, self.probe_s())
            self.unanswered.update(dead)
            if dead:
                log.warning("dslurm supervise: %s lost (no report, no answer to a probe): not waiting for srun",
                            ",".join(dead))
            return len(dead) == len(silent)
        return abandon

    def _view_after(self, d: Path, hosts: Sequence[str]) -> E.SlurmView:
        """Slurm's view of the step's nodes, with the nodes that left no report settled: a node whose
        launcher wrote nothing is either lost (its slurmd and processes gone) or its launcher died
        alone. Slurm says so only after SlurmdTimeout, so each silent node gets a probe step at once
        (`srun --overlap -w NODE true`): one that does not answer within `probe_s` counts as down,
        with that evidence; one that answers is alive, so the step is read as a crash. A lost node is
        thus never read as a crash of the nodes that did report, and no time goes into waiting."""
        from dslurm.endings.facts import read_start

        view = self.runner.view(hosts)
        facts = read_start(d)
        silent = [h for h in silent_hosts(facts.launchers, hosts) if h not in view.down_nodes]
        if not silent or self.stopping or (facts.refused and not facts.launchers):
            return view  # a step slurmctld never created asked no node: their silence says nothing
        unknown = [h for h in silent if h not in self.unanswered]  # the rest were probed while the step ran
        probe_s = self.probe_s()
        dead = (*(h for h in silent if h in self.unanswered),
                *(self.runner.probe(unknown, probe_s) if unknown else ()))
        self.unanswered.update(dead)
        if dead:
            # Not Slurm's view again (a sacct, ~0.4 s on the recovery's path): it marks the node
            # down only after SlurmdTimeout, and the probe has settled it.
            log.warning("dslurm supervise: %s: no report and no answer to a probe: lost", ",".join(dead))
            extra = [h for h in dead if h not in view.down_nodes]
            return E.SlurmView(state=view.state, down_nodes=(*view.down_nodes, *extra), node_states=(
                *view.node_states, *(f"{h}: no answer to a probe step within {probe_s:.0f} s (Slurm had not "
                                     f"marked it down yet)" for h in extra)))
        return view

    def _conclude(self, d: Path, ending: E.Ending, rc: int, acct: _Accounting) -> int:
        from dslurm.requeue import conclude

        return conclude(self.run_dir, d, ending, rc, self.env, acct, act=self.runner.act).exit_code

    def _plan(self, ending: E.Ending, nodes: Nodes, view: E.SlurmView) -> tuple[Plan, int | None] | None:
        """The recovery after a failed step with the gradient accumulation a shrink needs, or None:
        requeue without the bad nodes. The nodes at fault join the run's blocklist either way (and
        are drained where the site allows)."""
        from dslurm.run import add_to_blocklist, read_blocklist

        down = (*view.down_nodes, *sorted(self.unanswered))  # the view the ending was read from
        bad = nodes_at_fault(ending, nodes.training, down=down, blocklist=read_blocklist(self.run_dir))
        # Only a swap needs the spares' state (sinfo; the job's sacct state is the one just read), on
        # every recovery's path; a down spare stays listed until then, and is skipped then.
        spares_down = self.runner.view(nodes.spares).down_nodes if nodes.spares and bad else ()
        plan = plan_recovery(nodes, bad, wanted=self.r.nnodes, on_exhausted=self.r.job.on_spares_exhausted,
                             spares_down=spares_down)
        if bad:
            add_to_blocklist(self.run_dir, bad)
            if self.r.site.burnin.allow_drain and ending.cls != E.BURNIN_REJECTED:  # the burn-in drains its own
                self.runner.drain(bad, f"dslurm recovery: {ending.cls} in job {self.job_id}")
        accum = None
        if plan.action == "shrink":
            try:
                accum = shrink_grad_accum(self.r, len(plan.nodes.training))
            except UserError as exc:
                log.error("dslurm supervise: cannot shrink (%s); requeueing instead", exc)
                return None
        if plan.action == "requeue":
            log.warning("dslurm supervise: %s", plan.reason)
            return None
        log.warning("dslurm supervise: %s after %s (%s)", plan.action, ending.cls, plan.reason)
        return plan, accum

    def _record(self, d: Path, ending: E.Ending, rc: int, plan: Plan, before: Nodes, index: int,
                accum: int | None, failed_t: float) -> None:
        from dslurm.observe.ledger import Ledger
        from dslurm.requeue import _record_ending, pointer_step

        _record_ending(self.run_dir, d, ending, step_rc=rc)
        Ledger(self.run_dir).append(ev.Recovery(
            cause=ending.cls, reason=f"{ending.reason} -> {plan.reason}"[:600], mode=plan.action,
            removed=list(plan.removed), added=list(plan.added), nodes=list(plan.nodes.training),
            from_nodes=len(before.training), to_nodes=len(plan.nodes.training),
            grad_accum=accum if len(plan.nodes.training) < self.r.nnodes else None, step_index=index,
            resume_step=pointer_step(self.run_dir), failed_t=round(failed_t, 3)))
        print(f"dslurm: step ended: {ending.cls} ({ending.reason}); recovering inside the allocation: "
              f"{plan.reason}", flush=True)


def silent_hosts(launchers: Sequence[Mapping[str, object]], hosts: Sequence[str]) -> list[str]:
    """The hosts whose launcher left no report. Pure."""
    reported = {str(x.get("host")) for x in launchers}
    return [h for h in hosts if h not in reported]


def failed_at(facts: StartFacts, t_end: float) -> float:
    """When the failure happened: the earliest own failure a rank reported, else the earliest
    launcher report, else when the step ended (a lost node reports nothing)."""
    from dslurm.endings.facts import OWN_FAILURES

    own = [float(r["t"]) for r in facts.ranks if r.get("kind") in OWN_FAILURES and r.get("t")]
    launchers = [float(x["t"]) for x in facts.launchers if x.get("t")]
    return min(own or launchers or [t_end])
