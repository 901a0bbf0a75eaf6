"""The recovery half of the failure simulator: what each failure costs under each mechanism.

Given the failure draws (training time to each failure, and whether it took out a node or
only crashed a process), `timeline` walks the failures of every trial at once (numpy over
trials, a Python loop over the few hundred failures of a run) and returns, per segment, the
downtime after its failure, the speed the job trains at, and whether the restore may use the
node-local tier. The mechanisms are the ones `dslurm/recover` runs:

- `requeue`: every failure goes back through the queue: `restart_s + requeue_s`, full size.

A restore from node-local copies (two tiers, same allocation and layout; with partner copies a
lost node too, its shards pulled from the partner) is `durable_restore_s` quicker than one from
the durable tier.
- `spare`: `k` spare nodes in the allocation. A crash relaunches on the same nodes
  (`relaunch_s`); a lost node is swapped for a spare (`swap_s`). No spare left: the job's
  policy `requeue`, which brings a fresh allocation of nodes + k.
- `shrink`: as `spare`, but with no spare left the job continues on the nodes it has
  (`swap_s`) at proportionally lower speed (gradient accumulation keeps the global batch),
  and grows back at a later relaunch once repaired nodes are back.
- `replica`: replica groups train on through a loss; its walk is `dslurm/plan/replica_sim.py`
  (the survivors pause, the lost group is out, only the batch node's loss requeues).

Repair model: a lost node comes back `repair_h` later and rejoins the spare pool (a site that
hands repaired nodes back to the job; with a `repair_h` as long as the run, every node loss
uses up a spare for good, as one allocation does today). None of this depends on the
checkpoint interval, so every interval is scored on the same timeline (common random numbers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MECHANISMS = ("requeue", "spare", "shrink")  # the ones that stop the world; `plan simulate`'s default
REPLICA = "replica"  # replica groups train on through a loss (dslurm/plan/replica_sim.py): asked for by name
ALL_MECHANISMS = (*MECHANISMS, REPLICA)
SAVES = ("sync", "async", "two_tier", "partner")


@dataclass(frozen=True, slots=True)
class Draws:
    """One set of failure draws, shared by every mechanism, save mode and interval."""

    runs: Any
    """(trials, segments) training seconds from a (re)start to the next failure"""
    node_loss: Any
    """(trials, segments) bool: that failure took out a node (else: a process crash)"""
    which: Any = None
    """(trials, segments) uniform in [0, 1): which node a node loss took out (the batch node when
    below 1/nodes); drawn only for the replica mode, so the other modes' draws stay as they were"""


@dataclass(frozen=True, slots=True)
class Costs:
    """Seconds each kind of recovery takes, and the node pool (all validated by SimConfig)."""

    restart_s: float
    requeue_s: float
    relaunch_s: float
    swap_s: float
    nodes: int
    spares: int
    repair_s: float
    horizon_s: float
    local_tier: bool = False
    """saves are node-local first (two_tier, partner): a restore on the same nodes is local"""
    partner: bool = False
    """partner copies: a node lost and replaced in the allocation restores at local speed too"""
    durable_restore_s: float = 0.0
    """extra downtime of a restore from the durable tier over one from node-local copies"""
    groups: int = 1
    """replica mode: the data-parallel replica groups (a lost one is 1/groups of the throughput)"""
    quorum_s: float = 0.0
    """replica mode: the survivors' wait for a lost group's heartbeat to lapse"""
    step_s: float = 0.0
    """replica mode: one training step (the one in flight is discarded and trained again)"""
    group_restart_s: float = 0.0
    """replica mode: a lost group's failure -> its step started again and at its first quorum"""
    heal_s: float = 0.0
    """replica mode: the state's transfer from a live peer and its load"""


@dataclass(frozen=True, slots=True)
class Timeline:
    """Per segment (trials, segments): training time inside the horizon, whether it ended in a
    failure, the speed it trained at, and whether its failure could restore the local tier."""

    run_times: Any
    failed: Any
    speed: Any
    local_restore: Any
    partner_restore: Any
    """failures whose lost node's shards came back from its partner (a subset of local_restore)"""
    queued: Any
    """failures that went through the queue"""
    shrank: Any
    """failures after which the job trained on fewer nodes than before"""
    absent_s: Any = None
    """replica mode: (trials,) seconds of the whole job's training lost to groups out of the
    quorum (group-seconds out / groups); None for the other mechanisms"""


def timeline(mechanism: str, draws: Draws, c: Costs) -> Timeline:
    """Walk the failures of every trial: downtime, speed and restore tier per segment."""
    import numpy as np

    runs, node = draws.runs, draws.node_loss
    trials, segs = runs.shape
    down = np.empty_like(runs)
    speed = np.ones_like(runs)
    local = np.zeros(runs.shape, dtype=bool)
    back = np.full(runs.shape, -np.inf)  # when each lost node returns from repair
    queued = np.zeros(runs.shape, dtype=bool)
    shrank = np.zeros(runs.shape, dtype=bool)
    start = np.zeros(trials)
    queue = c.restart_s + c.requeue_s
    for j in range(segs):
        t_fail = start + runs[:, j]
        if mechanism == "requeue":
            down[:, j] = queue
            queued[:, j] = True
        else:
            in_repair = (back[:, :j] > t_fail[:, None]).sum(axis=1)
            back[:, j] = np.where(node[:, j], t_fail + c.repair_s, -np.inf)
            alive = c.nodes + c.spares - in_repair - node[:, j]
            short = alive < c.nodes
            to_queue = short if mechanism == "spare" else alive < 1
            down[:, j] = np.where(to_queue, queue, np.where(node[:, j], c.swap_s, c.relaunch_s))
            queued[:, j] = to_queue
            back[to_queue, : j + 1] = -np.inf  # a fresh allocation: its nodes are all healthy
            nxt = np.where(to_queue, 1.0, np.minimum(alive, c.nodes) / c.nodes)
            shrank[:, j] = nxt < speed[:, j]
            # The local tier restores only in the same allocation with the same layout: on the same
            # nodes, or (partner copies) with a lost node's shards pulled from its partner.
            local[:, j] = (~node[:, j] | c.partner) & ~to_queue & (nxt == speed[:, j])
            if j + 1 < segs:
                speed[:, j + 1] = nxt
        if c.durable_restore_s:
            down[:, j] += np.where(local[:, j] & c.local_tier, 0.0, c.durable_restore_s)
        start = t_fail + down[:, j]
    walls = runs + down
    starts = np.cumsum(walls, axis=1) - walls
    available = np.clip(c.horizon_s - starts, 0.0, None)
    failed = runs < available
    return Timeline(run_times=np.minimum(runs, available), failed=failed, speed=speed,
                    local_restore=local & failed, partner_restore=local & node & failed, queued=queued & failed,
                    shrank=shrank & failed)


def max_in_repair(draws: Draws, c: Costs) -> Any:
    """(trials,) the most lost nodes under repair at once over the run, with every loss swapped
    for a spare (never short): the spares a run needs to stay at full size all along."""
    import numpy as np

    runs, node = draws.runs, draws.node_loss
    down = np.where(node, c.swap_s, c.relaunch_s)
    t_fail = np.cumsum(runs + down, axis=1) - down
    inside = t_fail < c.horizon_s
    lost = np.where(node & inside, t_fail, np.nan)
    most = np.zeros(runs.shape[0], dtype=int)
    for j in range(runs.shape[1]):
        if not inside[:, j].any():
            break
        # The count only rises at a loss: nodes lost in (t_j - repair, t_j], this one included.
        window = (lost[:, : j + 1] > t_fail[:, j : j + 1] - c.repair_s).sum(axis=1)
        most = np.maximum(most, np.where(node[:, j] & inside[:, j], window, 0))
    return most


def spares_for(most: Any, probability: float) -> int:
    """The smallest k with P(most nodes under repair at once <= k) >= probability."""
    import numpy as np

    ordered = np.sort(np.asarray(most))
    index = min(len(ordered) - 1, max(0, int(np.ceil(probability * len(ordered))) - 1))
    return int(ordered[index])
