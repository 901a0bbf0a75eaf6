"""The replica groups of a job with `recovery.replicas` (`dslurm supervise`, docs/recovery.md).

The job's `parallel.dp_replicate` groups are whole nodes each (`group_hosts`): every group is its
own job step (srun on its nodes) and its own torchrun world, and torchft's Lighthouse (started by
the batch script, dslurm/recover/lighthouse.py) holds their quorum. This loop runs one thread per
group; when a group's step ends:

- in a failure (crash, node failure, burn-in) while another group still trains, the group is
  *lost*, not the job: `replica_lost` goes to the ledger (the cause classified from that step's own
  facts, `endings.classify`; the step from the group's own record, train/replicas.py `PROGRESS`),
  and the group's step starts again at once, on its nodes when they answer a probe, else on a
  spare (its nodes blocklisted), else on its nodes once they answer again (probed every 5 s while
  another group trains); the new step heals from a live peer (train/replicas.py). The
  survivors never stop: torchft leaves the lost group out of their next quorum;
- fewer than `recovery.replicas_min` groups left by a loss: the others stop as for Slurm's USR2
  (an agreed stop, group 0 saves, the job is requeued from that pointer; `_stop_below_min`);
- otherwise (completed, a stop, the last group alive failing, no node left for it, the restart
  budget spent, group 0 over) the group is over. A group still running 30 s after group 0 ended
  is stopped (frozen, or started again too late to find a peer: it holds nothing durable). Once
  every group is over, the job's ending is concluded as `requeue-me` would (`requeue.conclude`)
  from the facts of group 0's last step: group 0 owns the checkpoints and the run-wide events, so a
  group 0 lost for good ends the start as that failure and the chain resumes from the pointer.

Slurm's USR2/TERM reach every group (recorded in each step's batch.signals, forwarded to each
srun); no step starts after one.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dslurm import endings as E
from dslurm.config.resolve import Resolved
from dslurm.errors import UserError
from dslurm.launch.slurm_env import LOST_STEP_ENV
from dslurm.observe import events as ev
from dslurm.recover.supervisor import Runner, Step

log = logging.getLogger(__name__)

PROGRESS = "replica.step"
"""in a group step's facts dir: the step its rank 0 began last (rewritten every step: a hint)"""


def group_hosts(training: Sequence[str], groups: int) -> list[tuple[str, ...]]:
    """The training nodes split into `groups` groups of whole nodes, in order. Pure."""
    if groups < 1 or len(training) % groups:
        raise UserError(f"{len(training)} training node(s) do not split into {groups} replica groups. "
                        "Fix: set nodes to a multiple of parallel.dp_replicate")
    per = len(training) // groups
    return [tuple(training[i * per:(i + 1) * per]) for i in range(groups)]


def job_allocation(job_id: str, env: Mapping[str, str]) -> list[str] | None:
    """The job's nodes as slurmctld holds them now (None: unknown, Slurm not answering)."""
    from dslurm import slurm
    from dslurm.errors import SlurmError

    try:
        nodelist = str(slurm.job_info(job_id, env=env).get("nodes") or "")
        if not nodelist:
            return None
        return slurm.run_cmd(["scontrol", "show", "hostnames", nodelist], env=env).stdout.split() or None
    except (SlurmError, OSError):
        return None


def steps_on(squeue_out: str, hosts: Sequence[str], expand: Callable[[str], list[str]]) -> list[str]:
    """The job steps (`squeue -s -o %i|%N` lines) that run on exactly `hosts`; never the batch step. Pure."""
    out = []
    for line in squeue_out.splitlines():
        step, _, nodes = line.strip().partition("|")
        if step and not step.endswith((".batch", ".extern")) and nodes and sorted(expand(nodes)) == sorted(hosts):
            out.append(step)
    return out


def kill_steps_on(job_id: str, hosts: Sequence[str], env: Mapping[str, str]) -> None:
    """SIGKILL, through Slurm, to the job's steps on a hung group's nodes. Killing srun alone leaves
    the step's tasks running (a SIGSTOPped trainer, its torchrun) beside the group's next step, and
    on this cluster past the job's end."""
    from dslurm import slurm
    from dslurm.errors import SlurmError

    def expand(nodes: str) -> list[str]:
        return slurm.run_cmd(["scontrol", "show", "hostnames", nodes], env=env).stdout.split()

    try:
        out = slurm.run_cmd(["squeue", "-h", "-s", "-j", job_id, "-o", "%i|%N"], env=env).stdout
        for step in steps_on(out, hosts, expand):
            slurm.run_cmd(["scancel", "--signal=KILL", step], env=env, check=False)
    except (SlurmError, OSError) as exc:
        log.error("dslurm supervise: could not kill the steps on %s: %s", ",".join(hosts), exc)


def last_step(facts_dir: Path) -> int | None:
    """The step a group began last, from its rank 0's record (None: it began none)."""
    try:
        return int((facts_dir / PROGRESS).read_text().strip())
    except (OSError, ValueError):
        return None


@dataclass(slots=True)
class GroupEnd:
    """How a group's last job step ended."""

    facts_dir: Path
    ending: E.Ending
    rc: int


class ReplicaSupervisor:
    """One thread per replica group; a lost group's step started again while the others train."""

    def __init__(self, r: Resolved, runners: Sequence[Runner], env: Mapping[str, str], alloc: Sequence[str]) -> None:
        from dslurm.recover import initial_nodes
        from dslurm.run import read_blocklist

        self.r, self.runners, self.env = r, list(runners), dict(env)
        self.run_dir = r.run_dir
        self.job_id = env.get("SLURM_JOB_ID", "")
        self.restart = int(env.get("SLURM_RESTART_COUNT") or 0)
        nodes = initial_nodes(alloc, r.nnodes, read_blocklist(self.run_dir))
        self.hosts = group_hosts(nodes.training, r.job.parallel.dp_replicate)
        self.spares = list(nodes.spares)
        self.lock = threading.Lock()
        self.index = 0
        self.stopping: str | None = None
        self.running: dict[int, Path] = {}  # group -> the facts dir of its running step
        self.ends: dict[int, GroupEnd] = {}
        self.over: set[int] = set()  # the groups whose thread returned
        self.restarts = [0] * len(self.hosts)
        self.probe_s = 8.0
        # Groups end within a step of each other (one quorum); one still running this long after
        # group 0 ended is stopped (`_end_stragglers`).
        self.after_lead_s = 30.0
        self.node_wait_s = 5.0
        # A group that begins no step for this long while another group begins later ones is hung
        # (`_stalled`): its step is ended and started again. The survivors do not wait for this (their
        # all-reduce and quorum give up on it after recovery.replica_timeout_s); only its return does.
        self.stall_s = 15.0
        # A group quiet this long has its nodes' state asked of Slurm (then every as long again).
        self.node_check_s = 2.0
        # Slurm's answers, as attributes so the unit tests give their own (no Slurm there).
        self.allocation: Callable[[], list[str] | None] = lambda: job_allocation(self.job_id, self.env)
        self.kill_steps: Callable[[Sequence[str]], None] = lambda hosts: kill_steps_on(self.job_id, hosts, self.env)

    def on_signal(self, name: str) -> None:
        """A stop from Slurm: recorded in every running group's batch.signals, no step starts after it."""
        with self.lock:
            self.stopping = self.stopping or name
            dirs = list(self.running.values())
        for d in dirs:
            try:
                with open(d / "batch.signals", "a") as fh:
                    fh.write(f"{name} {time.time():.6f}\n")
            except OSError as exc:
                log.error("could not record %s in %s: %s", name, d, exc)

    def signal(self, signum: int) -> None:
        for runner in self.runners:
            runner.signal(signum)

    def loop(self) -> int:
        from dslurm.requeue import _Accounting, conclude

        acct = _Accounting(self.env)
        # Group g's first job step is step g (DSLURM_STEP_INDEX: a fault knob's @RESTART.STEP names it);
        # the steps started again after a loss take the next numbers.
        firsts = [self._step_dir() for _ in self.hosts]
        threads = [threading.Thread(target=self._group, args=(g, firsts[g]), name=f"dslurm-group-{g}", daemon=True)
                   for g in range(len(self.hosts))]
        for t in threads:
            t.start()
        ended: float | None = None  # when group 0's last step ended
        sent: set[int] = set()
        while any(t.is_alive() for t in threads):
            time.sleep(0.5)  # the main thread stays free for the signal handlers
            if ended is None and not threads[0].is_alive():
                ended = time.monotonic()
            if ended is not None and time.monotonic() - ended > self.after_lead_s:
                sent |= self._end_stragglers(sent, escalate=time.monotonic() - ended > 2 * self.after_lead_s)
        # Group 0's end decides: it owns the checkpoints and the run-wide events, so another group's
        # completion vouches for nothing durable; a group 0 lost for good ends the start as that failure.
        lead = self.ends[0]
        return conclude(self.run_dir, lead.facts_dir, lead.ending, lead.rc, self.env, acct,
                        act=self.runners[0].act).exit_code

    def _end_stragglers(self, sent: set[int], *, escalate: bool) -> set[int]:
        """Group 0 is over and another group's step still runs `after_lead_s` later (frozen, or
        started again too late to find a peer): TERM to its srun, KILL once `escalate`. Such a group
        holds nothing durable."""
        import signal

        with self.lock:
            running = [g for g in self.running if g != 0]
        for g in running:
            if g not in sent or escalate:
                log.warning("dslurm supervise: replica group %d still runs after group 0 ended: %s", g,
                            "killing its step" if escalate else "stopping it")
                self.runners[g].signal(signal.SIGKILL if escalate else signal.SIGTERM)
        return set(running)

    def _step_dir(self) -> tuple[int, Path]:
        from dslurm.endings.facts import STARTS, start_name

        with self.lock:
            index, self.index = self.index, self.index + 1
        d = self.run_dir / STARTS / start_name(self.job_id, self.restart, index)
        d.mkdir(parents=True, exist_ok=True)
        return index, d

    def _group(self, g: int, first: tuple[int, Path]) -> None:
        from dslurm.endings.facts import read_start

        runner = self.runners[g]
        index, d = first
        while True:
            with self.lock:
                stop = f"SIG{self.stopping}" if self.stopping else None
                self.running[g] = d
            log.info("dslurm supervise: replica group %d: step %d on %s", g, index, ",".join(self.hosts[g]))
            stalled: list[float] = []
            rc = runner.run(Step(index=index, hosts=self.hosts[g], facts_dir=d, stop=stop),
                            self._stalled(g, d, stalled))
            t_end = time.time()
            with self.lock:
                self.running.pop(g, None)
            ending = E.classify(read_start(d), runner.view(self.hosts[g]), rc)
            # (srun may even exit 0 after "Node failure on nodeX": a "completed" short of the last step
            # with a node gone is that node's loss)
            short = ending.cls == E.COMPLETED and (last_step(d) or 0) < self.r.job.train.steps
            left = self._left(self.hosts[g]) if ending.cls in E.FAILURES or short else []
            if left:  # Slurm took the node out of this --no-kill job (marked down; it may be back up already)
                ending = E.Ending(cls=E.NODE_FAILURE, reason=f"node failure: {','.join(left)} no longer in the job's "
                                  "allocation (Slurm marked it down)", step=last_step(d))
            elif stalled and ending.cls != E.NODE_FAILURE:  # ended here: a hang, not what srun's end looks like
                ending = E.Ending(cls=E.CRASH, reason=f"hang: group {g} began no step for {stalled[0]:.0f} s while "
                                  "the other groups trained past it; its step was killed", step=last_step(d))
            self.ends[g] = GroupEnd(d, ending, rc)
            if not self._restart(g, d, ending, t_end):
                with self.lock:
                    self.over.add(g)
                return
            index, d = self._step_dir()

    def _stalled(self, g: int, d: Path, stalled: list[float]) -> Callable[[], bool]:
        """The step's `abandon`: true once group g began no step for `stall_s` while another group
        began a later one (its processes frozen, a hang its own watchdog cannot see: a SIGSTOPped
        one-process group), recorded in `stalled`. A group that has begun none yet (starting, or
        its heal) is never stalled."""
        seen: list[int | None] = [None]
        since = [time.monotonic()]
        asked = [0.0]  # when Slurm was last asked about the group's nodes

        def abandon() -> bool:
            mine, now = last_step(d), time.monotonic()
            if mine != seen[0]:
                seen[0], since[0] = mine, now
                return False
            with self.lock:
                if self.stopping:
                    return False
                others = [last_step(x) for h, x in self.running.items() if h != g]
            quiet = now - since[0]
            if quiet >= self.node_check_s and now - asked[0] >= self.node_check_s:
                # Quiet for a while: is a node of it down, or gone from the allocation? srun waits for
                # a lost node's tasks until Slurm is done with them; the group is lost now.
                asked[0] = now
                gone = sorted({*self.runners[g].view(self.hosts[g]).down_nodes, *self._left(self.hosts[g])})
                if gone:
                    log.warning("dslurm supervise: replica group %d: %s down or gone from the job: ending its step",
                                g, ",".join(gone))
                    stalled.append(quiet)
                    return True
            if mine is None or quiet < self.stall_s or not any(o is not None and o > mine for o in others):
                return False
            log.warning("dslurm supervise: replica group %d began no step for %.0f s while the others went on: "
                        "ending its step", g, quiet)
            stalled.append(quiet)
            self.kill_steps(self.hosts[g])
            return True
        return abandon

    def _restart(self, g: int, d: Path, ending: E.Ending, t_end: float) -> bool:
        """After a failure of group g with others training: the ledger's replica_lost, the nodes of
        its next step; False: the group is over."""
        from dslurm.observe.ledger import Ledger
        from dslurm.recover.supervisor import failed_at

        with self.lock:
            live = len(self.running)
            stopping = self.stopping
        if stopping or ending.cls not in E.FAILURES or not live or (g != 0 and 0 in self.over):
            return False  # nobody to heal from, or group 0 (the run's truth) is over
        from dslurm.endings.facts import read_start

        hosts = self.hosts[g]
        budget = self.r.policy.max_restarts
        below = live < self.r.job.recovery.replicas_min
        nxt = self._next_hosts(g, hosts) if self.restarts[g] < budget and not below else None
        cause = "hang" if ending.reason.startswith("hang:") else ending.cls
        why = (f"; {live} of {len(self.hosts)} groups left, below recovery.replicas_min "
               f"({self.r.job.recovery.replicas_min}): the job stops, saves and is requeued" if below else "")
        Ledger(self.run_dir).append(ev.ReplicaLost(
            group=g, step=last_step(d), cause=cause, reason=(ending.reason[:500] + why), hosts=list(hosts),
            next_hosts=list(nxt or ()), failed_t=round(failed_at(read_start(d), t_end), 3)))
        if below:
            self._stop_below_min(g, live)
            return False
        if nxt is None:
            log.error("dslurm supervise: replica group %d lost (%s) and not started again (%s)", g, ending.cls,
                      "restart budget spent" if self.restarts[g] >= budget else "no node left for it")
            return False
        self.restarts[g] += 1
        self.hosts[g] = nxt
        self.runners[g].env[LOST_STEP_ENV] = str(last_step(d) or 0)  # type: ignore[attr-defined]
        print(f"dslurm: replica group {g} lost ({ending.cls}: {ending.reason}); the others train on; "
              f"its step starts again on {','.join(nxt)}", flush=True)
        return True

    def _stop_below_min(self, g: int, live: int) -> None:
        """Fewer groups train than recovery.replicas_min: the groups left stop as for Slurm's USR2
        (recorded in their batch.signals, forwarded to their sruns: every group agrees the stop at a
        step boundary, group 0 saves, the chain requeues from that pointer). Their Manager already
        votes no on every step with fewer than replicas_min groups (train/replicas.py), so nothing
        trains below it while the stop lands."""
        import signal

        print(f"dslurm: replica group {g} lost; {live} group(s) left, below recovery.replicas_min "
              f"({self.r.job.recovery.replicas_min}): stopping with a save (as for USR2), to be requeued", flush=True)
        self.on_signal("USR2")
        self.signal(signal.SIGUSR2)

    def _left(self, hosts: Sequence[str]) -> list[str]:
        """The hosts no longer in the job's allocation: a --no-kill job loses a node Slurm marks down
        for good, even once the node is back up (its probe then answers, but no step of this job
        can run there)."""
        now = self.allocation()
        return [h for h in hosts if h not in now] if now else []

    def _next_hosts(self, g: int, hosts: tuple[str, ...]) -> tuple[str, ...] | None:
        """The group's nodes when they answer a probe; a node that does not, or that left the
        allocation, is swapped for a spare (and blocklisted); None when no spare is left."""
        from dslurm.run import add_to_blocklist

        dead = set(self._left(hosts)) or set(self.runners[g].probe(hosts, self.probe_s))
        while dead:
            with self.lock:
                take = [self.spares.pop(0) for _ in dead] if len(self.spares) >= len(dead) else None
                others = bool(self.running) and not self.stopping
            if take is not None or not others:
                break
            # No spare: the group waits for its nodes while the others train (a node rebooted, a
            # slurmd restarted), probed again every `node_wait_s`.
            log.warning("dslurm supervise: replica group %d: %s not answering and no spare; waiting", g,
                        ",".join(sorted(dead)))
            time.sleep(self.node_wait_s)
            dead = set(self.runners[g].probe(hosts, self.probe_s))
        if not dead:
            return hosts
        if take is None:
            return None
        add_to_blocklist(self.run_dir, sorted(dead))
        it = iter(take)
        return tuple(next(it) if h in dead else h for h in hosts)
