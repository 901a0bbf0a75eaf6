"""The failure simulator's replica mode (`recovery.replicas`, docs/recovery.md): the job's
data-parallel replica groups train on through the loss of one of them (torchft's quorum).

What one failure costs, per the runtime (dslurm/recover/replicas.py, train/replicas.py):

- the survivors pause `quorum_s` (the lost group's heartbeat missed: torchft's timeout, after
  which the next quorum leaves it out) plus `step_s` (the step in flight is discarded by the
  commit vote and trained again). Nothing else is lost: the survivors keep their state, so the
  work since the last checkpoint is not redone;
- the lost group's share of the throughput (1 / groups) while it is out: its step starts again
  (`group_restart_s`) and it heals from a live peer (`heal_s`). After a node loss it restarts on a
  spare when one is free, else on its own node once that node is repaired (`repair_s` later: the
  group waits for it, which is conservative when another node comes back earlier);
- a loss of the batch node (the one of `nodes` that runs the batch shell and the Lighthouse,
  dslurm/recover/lighthouse.py) ends the job as before: a requeue (`restart_s + requeue_s`) and a
  restore from the durable checkpoint, losing the work since it. Durable saves go on as configured
  for this case; their stall is paid all along.

Not modelled: `replicas_min` (with hundreds of groups the groups out at once are a few), a
group's heal pausing its peers, failures while a group is out beyond the spare count.
"""

from __future__ import annotations

from typing import Any

from dslurm.plan.recovery_sim import Costs, Draws, Timeline


def batch_node_lost(draws: Draws, nodes: int) -> Any:
    """(trials, segments) bool: the failure took out the batch node (a node loss, on 1 node of `nodes`)."""
    if draws.which is None:
        raise ValueError("replica mode needs Draws.which (draw_failures draws it for mechanism 'replica')")
    return draws.node_loss & (draws.which < 1.0 / nodes)


def epochs(run_times: Any, closes: Any) -> Any:
    """Training time between whole-job failures: at each segment that closes an epoch (a whole-job
    failure, or the horizon), the training since the previous close; 0 elsewhere. Pure.

    [[1, 2, 3, 4]] closing at [[F, T, F, T]] -> [[0, 3, 0, 7]]."""
    import numpy as np

    cum = np.cumsum(run_times, axis=1)
    last = np.maximum.accumulate(np.where(closes, cum, 0.0), axis=1)  # cum never falls: the latest close
    before = np.concatenate([np.zeros((cum.shape[0], 1)), last[:, :-1]], axis=1)
    return np.where(closes, cum - before, 0.0)


def replica_timeline(draws: Draws, c: Costs) -> Timeline:
    """Walk the failures of every trial under replica groups (see the module's docstring)."""
    import numpy as np

    runs, node = draws.runs, draws.node_loss
    trials, segs = runs.shape
    whole = batch_node_lost(draws, c.nodes)
    down = np.where(whole, c.restart_s + c.requeue_s + c.durable_restore_s, c.quorum_s + c.step_s)
    back = np.full(runs.shape, -np.inf)  # when each lost node returns from repair
    absent = np.zeros(runs.shape)  # seconds the failure's group is out
    t_fails = np.zeros(runs.shape)
    start = np.zeros(trials)
    for j in range(segs):
        t_fail = t_fails[:, j] = start + runs[:, j]
        in_repair = (back[:, :j] > t_fail[:, None]).sum(axis=1)
        back[:, j] = np.where(node[:, j], t_fail + c.repair_s, -np.inf)
        no_spare = node[:, j] & (in_repair + 1 > c.spares)
        absent[:, j] = np.where(whole[:, j], 0.0, np.where(no_spare, c.repair_s, 0.0) + c.group_restart_s + c.heal_s)
        back[whole[:, j], : j + 1] = -np.inf  # a fresh allocation: its nodes are all healthy
        start = t_fail + down[:, j]
    walls = runs + down
    starts = np.cumsum(walls, axis=1) - walls
    available = np.clip(c.horizon_s - starts, 0.0, None)
    failed = runs < available
    run_times = np.minimum(runs, available)
    # The group-seconds out inside the horizon, as seconds of the whole job (one group is 1/groups).
    out = (np.minimum(t_fails + absent, c.horizon_s) - np.minimum(t_fails, c.horizon_s)) * failed
    none = np.zeros(runs.shape, dtype=bool)
    return Timeline(run_times=epochs(run_times, (whole & failed) | ~failed), failed=failed,
                    speed=np.ones_like(runs), local_restore=none, partner_restore=none, queued=whole & failed,
                    shrank=none, absent_s=out.sum(axis=1) / c.groups)
