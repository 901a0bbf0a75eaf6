"""Monte Carlo goodput of a long run under GPU failures, and the best checkpoint interval.

Model (each trial is one run of `horizon_h` wall-clock hours):
- The job fails when any GPU fails. Per-GPU failures are independent exponentials, so the
  job's time to the next failure is exponential with mean MTBF_gpu / N: the first of N
  exponentials. Drawing that one number instead of N keeps 16k GPUs as cheap as 8. A share
  `node_loss_fraction` of failures takes out a node; the rest only crash a process.
- Training runs in cycles: `interval_s` of useful compute, then a stall. `sync`: the stall is
  the whole `save_s` and the save is durable when it returns. `async`: the stall is
  `async_stall_s` (the snapshot to host memory), durable `save_s` later. `two_tier`: the stall
  is the local write `local_stall_s` (restorable on the same nodes from then on), durable
  `durable_lag_s` later. `partner`: two tiers with partner copies, the same stall; a lost node is
  restorable `partner_lag_s` after the local commit. One write in flight at a time: a longer
  write delays the next save.
- A failure loses the work since the last checkpoint it can restore: the local one after a
  process crash relaunched on the same nodes (two tiers), or a node loss in the allocation (partner
  copies: the spare pulls the lost node's shards), else the last durable one. What the
  recovery costs, and at what speed training goes on, is the mechanism's
  (`dslurm.plan.recovery_sim`: requeue, spare, shrink). The failure clock runs only while
  training runs (failures during recovery, and of idle spares, are not modelled).
- Goodput = restorable useful compute / wall clock (shrunk segments count at their speed).
  Work still in flight at the horizon is not counted (a bias of about interval/2 over the horizon).

Because the failure times do not depend on the interval or the mechanism, every interval and
every mechanism is scored on the same draws (common random numbers), so comparisons are not
swamped by noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dslurm.errors import UserError
from dslurm.plan._check import count, non_negative, positive
from dslurm.plan.recovery_sim import ALL_MECHANISMS, REPLICA, SAVES, Costs, Draws, max_in_repair, spares_for, timeline
from dslurm.plan.reliability import HOURS_PER_YEAR, job_mtbf_h, young_daly_interval_s
from dslurm.plan.replica_sim import replica_timeline


@dataclass(kw_only=True, slots=True)
class SimConfig:
    """One scenario for the failure simulator (times in seconds unless the name says hours)."""

    gpus: int
    """GPUs in the job; any one failing stops it."""
    gpu_mtbf_h: float = 5 * HOURS_PER_YEAR
    """Mean time between failures of one GPU (hours). Seed 004 uses 5 years."""
    gpus_per_node: int = 8
    """GPUs per node: the unit a node loss takes out and a spare puts back."""
    node_loss_fraction: float = 1.0
    """Share of failures that take out a node (the rest crash a process on healthy nodes).
    1.0: seed 004 lists only hardware faults (GPU, memory, NVLink/NIC, host crashes) and gives
    no split, so every failure is taken to cost a node: the worst case for spares and two tiers."""
    mechanism: str = "requeue"
    """requeue | spare | shrink (dslurm.plan.recovery_sim) | replica (dslurm.plan.replica_sim)"""
    save: str = "sync"
    """sync | async | two_tier | partner (two tiers with partner copies)"""
    save_s: float = 240.0
    """Seconds to write one checkpoint to durable storage (sync stall; async write)."""
    async_stall_s: float = 10.0
    """Training stall of an async save (the device-to-host snapshot)."""
    local_stall_s: float = 30.0
    """Training stall of a two-tier save (the node-local write). An assumption by default."""
    durable_lag_s: float | None = None
    """Two tiers: local commit -> durable commit (None: `save_s`, the same write)."""
    partner_lag_s: float = 10.0
    """Two tiers with partner copies: local commit -> partner commit (a lost node restored from
    its partner loses this much). An assumption by default; measured: `ckpt_partner_commit`."""
    durable_restore_s: float = 0.0
    """Extra seconds a restore from the durable tier takes over one from node-local copies, paid
    by every recovery that cannot restore locally (0: no difference assumed)."""
    restart_s: float = 600.0
    """Restore + restart after a failure: process start, NCCL init, checkpoint load."""
    requeue_s: float = 300.0
    """Time waiting for Slurm to start the requeued job (replacement node included)."""
    relaunch_s: float | None = None
    """In-allocation recovery on the same nodes, failure -> training (None: `restart_s`)."""
    swap_s: float | None = None
    """In-allocation recovery with a spare or a shrink, failure -> training (None: `restart_s`)."""
    spares: int = 0
    """Spare nodes in the allocation (spare, shrink and replica)."""
    group_nodes: int = 1
    """Replica mode: nodes per replica group (its FSDP/TP/PP inside); a lost group is
    group_nodes/nodes of the throughput. 1 by default (the issue's layout); Llama 3 405B's
    TP 8 x PP 16 is 16 nodes per group."""
    quorum_s: float = 5.0
    """Replica mode: the survivors' wait until a lost group is out of the quorum: torchft's
    heartbeat timeout, 5 s (`HEARTBEAT_TIMEOUT_MS`, dslurm/recover/lighthouse.py)."""
    step_s: float = 6.0
    """Replica mode: one training step, discarded and trained again when a group fails inside it.
    6 s: Llama 3 405B's 16M-token step at 400 TFLOP/s per GPU on 16,384 GPUs (the Llama 3 paper's
    own figures: 6 x 405e9 x 16e6 / (16,384 x 400e12)); an assumption, not a measurement."""
    group_restart_s: float | None = None
    """Replica mode: a lost group's failure -> its step started again and in its first quorum
    (None: `relaunch_s`, the same in-allocation restart)."""
    heal_s: float = 60.0
    """Replica mode: the heal from a live peer (transfer and load). 60 s: an assumption (measured
    locally: 0.36 s for a 2.8 MB tiny model, docs/recovery.md; a GPU-scale heal is not measured)."""
    repair_h: float = 24.0
    """Hours until a lost node is back in the spare pool. An assumption by default."""
    horizon_h: float = 30 * 24.0
    """Wall-clock length of one simulated run (hours)."""
    trials: int = 1000
    """Independent runs simulated per interval."""
    seed: int = 0
    """Seed of numpy's default generator: same seed, same numbers."""

    def __post_init__(self) -> None:
        count("gpus", self.gpus)
        count("trials", self.trials)
        count("gpus_per_node", self.gpus_per_node)
        count("spares", self.spares, minimum=0)
        count("group_nodes", self.group_nodes)
        if self.gpus % self.gpus_per_node:
            raise UserError(f"gpus={self.gpus} is not a whole number of nodes of gpus_per_node="
                            f"{self.gpus_per_node}. Fix: give a multiple of {self.gpus_per_node}")
        if self.nodes % self.group_nodes:
            raise UserError(f"group_nodes={self.group_nodes} does not divide the job's {self.nodes} nodes "
                            f"(gpus={self.gpus} / gpus_per_node={self.gpus_per_node}). Fix: give a divisor of "
                            f"{self.nodes}")
        for name, allowed in (("mechanism", ALL_MECHANISMS), ("save", SAVES)):
            if getattr(self, name) not in allowed:
                raise UserError(f"{name}={getattr(self, name)!r} is unknown; choose one of {', '.join(allowed)}")
        for name in ("gpu_mtbf_h", "save_s", "horizon_h", "repair_h"):
            positive(name, getattr(self, name))
        for name in ("async_stall_s", "local_stall_s", "restart_s", "requeue_s", "durable_lag_s",
                     "relaunch_s", "swap_s", "partner_lag_s", "durable_restore_s", "quorum_s", "step_s",
                     "group_restart_s", "heal_s"):
            if getattr(self, name) is not None:
                non_negative(name, getattr(self, name))
        if not 0.0 <= non_negative("node_loss_fraction", self.node_loss_fraction) <= 1.0:
            raise UserError(f"node_loss_fraction={self.node_loss_fraction} must be in [0, 1]")

    @property
    def nodes(self) -> int:
        return self.gpus // self.gpus_per_node

    @property
    def mtbf_s(self) -> float:
        """Job MTBF in seconds."""
        return job_mtbf_h(self.gpu_mtbf_h, self.gpus) * 3600.0

    @property
    def stall_s(self) -> float:
        """Training time lost per save."""
        return {"sync": self.save_s, "async": self.async_stall_s, "two_tier": self.local_stall_s,
                "partner": self.local_stall_s}[self.save]

    @property
    def lag_s(self) -> float:
        """Delay from the end of the stall until the checkpoint is durable."""
        durable = self.cost_inputs()["durable_lag_s"]
        return {"sync": 0.0, "async": self.save_s, "two_tier": durable, "partner": durable}[self.save]

    @property
    def rollback_mtbf_s(self) -> float:
        """Mean training time between failures that go back to a checkpoint: every failure, but
        in replica mode only the loss of the batch node (1 node of `nodes`; the horizon when none)."""
        if self.mechanism != REPLICA:
            return self.mtbf_s
        rate = self.node_loss_fraction / self.nodes
        return self.mtbf_s / rate if rate > 0 else self.horizon_h * 3600.0

    @property
    def young_daly_s(self) -> float:
        """sqrt(2·stall·MTBF): the first-order optimum, with the stall as the save cost and the
        failures that roll back to a checkpoint."""
        return young_daly_interval_s(max(self.stall_s, 1e-9), self.rollback_mtbf_s)

    def cost_inputs(self) -> dict[str, float]:
        """Every cost input in seconds, the ones left None resolved to what they default to."""
        return {"save_s": self.save_s, "async_stall_s": self.async_stall_s, "local_stall_s": self.local_stall_s,
                "durable_lag_s": self.save_s if self.durable_lag_s is None else self.durable_lag_s,
                "restart_s": self.restart_s, "requeue_s": self.requeue_s,
                "relaunch_s": self.restart_s if self.relaunch_s is None else self.relaunch_s,
                "swap_s": self.restart_s if self.swap_s is None else self.swap_s,
                "partner_lag_s": self.partner_lag_s, "durable_restore_s": self.durable_restore_s,
                "quorum_s": self.quorum_s, "step_s": self.step_s,
                "group_restart_s": ((self.restart_s if self.relaunch_s is None else self.relaunch_s)
                                    if self.group_restart_s is None else self.group_restart_s),
                "heal_s": self.heal_s}

    def costs(self) -> Costs:
        c = self.cost_inputs()
        return Costs(restart_s=self.restart_s, requeue_s=self.requeue_s, relaunch_s=c["relaunch_s"],
                     swap_s=c["swap_s"], nodes=self.nodes, spares=self.spares, repair_s=self.repair_h * 3600.0,
                     horizon_s=self.horizon_h * 3600.0, local_tier=self.save in ("two_tier", "partner"),
                     partner=self.save == "partner", durable_restore_s=self.durable_restore_s,
                     groups=self.nodes // self.group_nodes, quorum_s=self.quorum_s, step_s=self.step_s,
                     group_restart_s=c["group_restart_s"], heal_s=self.heal_s)


@dataclass(kw_only=True, slots=True)
class SimResult:
    """Goodput distribution per checkpoint interval (arrays are numpy, one entry per interval)."""

    config: SimConfig
    intervals_s: Any
    mean: Any
    p05: Any
    p50: Any
    p95: Any
    failures_mean: float
    """Mean failures per run (same for every interval)."""
    time_between_failures_h: float
    """Mean drawn time from restart to failure: checks the exponential model against MTBF."""
    requeues_mean: float = 0.0
    """Mean failures per run that went through the queue."""
    shrinks_mean: float = 0.0
    """Mean failures per run after which the job went on with fewer nodes."""
    absent_mean: float = 0.0
    """Replica mode: mean seconds per run of the whole job's training lost to groups out of the quorum."""
    best: int = field(default=0)
    """Index of the interval with the highest mean goodput."""

    @property
    def best_interval_s(self) -> float:
        return float(self.intervals_s[self.best])

    @property
    def best_goodput(self) -> float:
        return float(self.mean[self.best])

    def summary(self) -> dict[str, Any]:
        """Plain values for JSON output and docs."""
        i, c = self.best, self.config
        return {"mechanism": c.mechanism, "save": c.save, "spares": c.spares if c.mechanism != "requeue" else 0,
                **({"groups": c.nodes // c.group_nodes, "lost_to_groups_out_h": self.absent_mean / 3600.0}
                   if c.mechanism == REPLICA else {}),
                "gpus": c.gpus, "job_mtbf_h": c.mtbf_s / 3600.0,
                "failures_per_run": self.failures_mean, "requeues_per_run": self.requeues_mean,
                "shrinks_per_run": self.shrinks_mean, "horizon_h": c.horizon_h,
                "young_daly_s": c.young_daly_s, "best_interval_s": self.best_interval_s,
                "goodput_mean": float(self.mean[i]), "goodput_p05": float(self.p05[i]),
                "goodput_p50": float(self.p50[i]), "goodput_p95": float(self.p95[i])}


def segments_per_trial(cfg: SimConfig) -> tuple[float, int]:
    """(the shortest recovery of any mechanism, failures drawn per trial): enough to pass the
    horizon with that recovery, with a margin of 8 standard deviations. The replica mode's pause
    counts only when it is asked for (cfg.mechanism), so the other modes' draws stay as they were."""
    c = cfg.costs()
    down = min(c.restart_s + c.requeue_s, c.relaunch_s, c.swap_s,
               *([c.quorum_s + c.step_s] if cfg.mechanism == REPLICA else []))
    expected = cfg.horizon_h * 3600.0 / (cfg.mtbf_s + down)
    return down, int(expected + 8 * math.sqrt(expected) + 16)


def draw_failures(cfg: SimConfig, rng: Any = None) -> Draws:
    """`cfg.trials` trials of failures, enough per trial to pass the horizon with the shortest
    recovery of any mechanism. `rng`: the generator to go on drawing from (default: a new one
    seeded with `cfg.seed`)."""
    import numpy as np

    rng = np.random.default_rng(cfg.seed) if rng is None else rng
    horizon = cfg.horizon_h * 3600.0
    down, segments = segments_per_trial(cfg)
    while True:
        runs = rng.exponential(cfg.mtbf_s, size=(cfg.trials, segments))
        if np.all((runs + down).sum(axis=1) >= horizon):
            node_loss = rng.random(runs.shape) < cfg.node_loss_fraction
            return Draws(runs=runs, node_loss=node_loss,
                         which=rng.random(runs.shape) if cfg.mechanism == REPLICA else None)
        segments *= 2  # rare: redraw longer rather than bias the tail


def goodput_per_trial(cfg: SimConfig, interval_s: float, line: Any) -> Any:
    """Goodput of each trial for one interval, given the mechanism's timeline."""
    import numpy as np

    positive("interval_s", interval_s)
    lag = cfg.lag_s
    # One write in flight at a time: a write longer than the interval delays the next save.
    cycle = max(interval_s, lag) + cfg.stall_s
    # A crash relaunched on the same nodes restores the local tier: nothing in flight is lost.
    # With partner copies a lost node's shards come from its partner: what is not there yet is.
    lags = np.where(line.local_restore, 0.0, lag) if cfg.save in ("two_tier", "partner") else lag
    if cfg.save == "partner":
        lags = np.where(line.partner_restore, cfg.partner_lag_s, lags)
    kept = np.floor(np.clip(line.run_times - lags, 0.0, None) / cycle)
    useful = (kept * line.speed).sum(axis=1) * interval_s
    if line.absent_s is not None:  # replica mode: a group out trains none of its share (of the useful part)
        useful = useful - line.absent_s * interval_s / cycle
    return useful / (cfg.horizon_h * 3600.0)


GRID_POINTS = 41  # log-spaced intervals scored from Young/Daly / 8 to x 8 (plan simulate's search)


def default_intervals(cfg: SimConfig, points: int = GRID_POINTS) -> list[float]:
    """Log-spaced candidates from Young/Daly ÷ 8 to × 8, plus Young/Daly itself and the durable
    write time (below it a shorter interval gains nothing: one write in flight at a time)."""
    yd = cfg.young_daly_s
    grid = [yd * 8.0 ** (2.0 * k / (points - 1) - 1.0) for k in range(points)]
    return sorted({max(1.0, x) for x in grid} | {yd} | ({cfg.lag_s} if cfg.lag_s >= 1.0 else set()))


def score(cfg: SimConfig, draws: Draws, intervals_s: list[float] | None = None) -> SimResult:
    """Goodput distribution of `cfg` on given draws, for each interval."""
    acc = Accumulator(cfg, intervals_s)
    acc.add(draws)
    return acc.result()


class Accumulator:
    """A scenario's statistics over trials that come in chunks (sim_stream): sums for the means;
    the per-trial goodputs themselves while one chunk has come, a histogram of `BINS` bins over
    [0, 1] once more have (its percentiles are good to 1/BINS), so memory does not grow with trials."""

    BINS = 20_000

    def __init__(self, cfg: SimConfig, intervals_s: list[float] | None = None) -> None:
        import numpy as np

        self.cfg = cfg
        self.intervals = np.asarray(intervals_s if intervals_s else default_intervals(cfg), dtype=float)
        for i, x in enumerate(self.intervals):
            positive(f"intervals_s[{i}]", float(x))
        self.n, self.sum = 0, np.zeros(len(self.intervals))
        self.exact: Any = None
        self.hist: Any = None
        self.failures = self.queued = self.shrank = self.absent = 0.0
        self.failed_time, self.failed_n = 0.0, 0

    def add(self, draws: Draws) -> None:
        import numpy as np

        line = (replica_timeline(draws, self.cfg.costs()) if self.cfg.mechanism == REPLICA
                else timeline(self.cfg.mechanism, draws, self.cfg.costs()))
        table = np.stack([goodput_per_trial(self.cfg, float(t), line) for t in self.intervals])
        self.n += table.shape[1]
        self.sum += table.sum(axis=1)
        if self.exact is None and self.hist is None:
            self.exact = table
        else:
            if self.hist is None:
                self.hist, self.exact = self._binned(self.exact), None
            self.hist += self._binned(table)
        failed = line.failed
        self.failures += float(failed.sum())
        self.failed_time += float(draws.runs[failed].sum())
        self.failed_n += int(failed.sum())
        self.queued += float(line.queued.sum())
        self.shrank += float(line.shrank.sum())
        if line.absent_s is not None:
            self.absent += float(line.absent_s.sum())

    def _binned(self, table: Any) -> Any:
        import numpy as np

        idx = np.clip((table * self.BINS).astype(int), 0, self.BINS - 1)
        return np.stack([np.bincount(row, minlength=self.BINS) for row in idx])

    def _percentiles(self) -> Any:
        import numpy as np

        if self.exact is not None:
            return np.percentile(self.exact, [5, 50, 95], axis=1)
        cum = np.cumsum(self.hist, axis=1)
        out = [(np.argmax(cum >= q / 100.0 * self.n, axis=1) + 0.5) / self.BINS for q in (5, 50, 95)]
        return np.stack(out)

    def result(self) -> SimResult:
        import numpy as np

        mean = self.sum / self.n
        p05, p50, p95 = self._percentiles()
        return SimResult(config=self.cfg, intervals_s=self.intervals, mean=mean, p05=p05, p50=p50, p95=p95,
                         failures_mean=self.failures / self.n,
                         time_between_failures_h=(self.failed_time / self.failed_n / 3600.0 if self.failed_n
                                                  else math.inf),
                         requeues_mean=self.queued / self.n, shrinks_mean=self.shrank / self.n,
                         absent_mean=self.absent / self.n,
                         best=int(np.argmax(mean)))


def simulate(cfg: SimConfig, intervals_s: list[float] | None = None) -> SimResult:
    """Goodput distribution for each interval, and the interval with the best mean."""
    return score(cfg, draw_failures(cfg), intervals_s)


@dataclass(frozen=True, slots=True)
class SparesSizing:
    probability: float
    spares: int
    """the fewest spares that keep the run at full size all along with `probability`"""
    mean_most_in_repair: float


def size_spares(cfg: SimConfig, draws: Draws, probability: float) -> SparesSizing:
    """The spares for `probability`, from the most nodes under repair at once per trial."""
    if not 0.0 < probability < 1.0:
        raise UserError(f"probability={probability} must be between 0 and 1 (exclusive), e.g. 0.99")
    most = max_in_repair(draws, cfg.costs())
    return SparesSizing(probability=probability, spares=spares_for(most, probability),
                        mean_most_in_repair=float(most.mean()))
