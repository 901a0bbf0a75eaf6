"""Monte Carlo goodput of a long run under GPU failures, and the best checkpoint interval.

Model (each trial is one run of `horizon_h` wall-clock hours):
- The job fails when any GPU fails. Per-GPU failures are independent exponentials, so the
  job's time to the next failure is exponential with mean MTBF_gpu / N: the first of N
  exponentials. Drawing that one number instead of N keeps 16k GPUs as cheap as 8.
- Training runs in cycles: `interval_s` of useful compute, then a stall. A synchronous save
  stalls for the whole `save_s` and is durable when it returns. An asynchronous save stalls
  for `async_stall_s` (the snapshot to host memory) and becomes durable `save_s` later; a
  write longer than the interval delays the next snapshot (one write in flight at a time).
- A failure loses everything since the last *durable* checkpoint, then costs `restart_s`
  (restore + restart) and `requeue_s` (waiting in the queue). The failure clock runs only
  while training runs (failures during restart are not modelled).
- Goodput = durable useful compute / wall clock. Work still in flight at the horizon is
  not counted (a bias of about interval/2 over the horizon).

Because the failure times do not depend on the interval, every interval is scored on the
same draws (common random numbers), so comparing intervals is not swamped by noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dslurm.plan._check import count, non_negative, positive
from dslurm.plan.reliability import HOURS_PER_YEAR, job_mtbf_h, young_daly_interval_s


@dataclass(kw_only=True, slots=True)
class SimConfig:
    """One scenario for the failure simulator."""

    gpus: int
    """GPUs in the job; any one failing stops it."""
    gpu_mtbf_h: float = 5 * HOURS_PER_YEAR
    """Mean time between failures of one GPU (hours). Seed 004 uses 5 years."""
    save_s: float = 240.0
    """Seconds to write one checkpoint to durable storage."""
    async_save: bool = False
    """Stage to host memory, write in the background; else training stalls for `save_s`."""
    async_stall_s: float = 10.0
    """Training stall of an async save (the device-to-host snapshot)."""
    restart_s: float = 600.0
    """Restore + restart after a failure: process start, NCCL init, checkpoint load."""
    requeue_s: float = 300.0
    """Time waiting for Slurm to start the requeued job (replacement node included)."""
    horizon_h: float = 30 * 24.0
    """Wall-clock length of one simulated run (hours)."""
    trials: int = 1000
    """Independent runs simulated per interval."""
    seed: int = 0
    """Seed of numpy's default generator: same seed, same numbers."""

    def __post_init__(self) -> None:
        count("gpus", self.gpus)
        count("trials", self.trials)
        for name in ("gpu_mtbf_h", "save_s", "horizon_h"):
            positive(name, getattr(self, name))
        for name in ("async_stall_s", "restart_s", "requeue_s"):
            non_negative(name, getattr(self, name))

    @property
    def mtbf_s(self) -> float:
        """Job MTBF in seconds."""
        return job_mtbf_h(self.gpu_mtbf_h, self.gpus) * 3600.0

    @property
    def stall_s(self) -> float:
        """Training time lost per save."""
        return self.async_stall_s if self.async_save else self.save_s

    @property
    def lag_s(self) -> float:
        """Delay from the end of the stall until the checkpoint is durable."""
        return self.save_s if self.async_save else 0.0

    @property
    def young_daly_s(self) -> float:
        """sqrt(2·stall·MTBF): the first-order optimum, with the stall as the save cost."""
        return young_daly_interval_s(max(self.stall_s, 1e-9), self.mtbf_s)


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
    best: int = field(default=0)
    """Index of the interval with the highest mean goodput."""

    @property
    def best_interval_s(self) -> float:
        return float(self.intervals_s[self.best])

    @property
    def best_goodput(self) -> float:
        return float(self.mean[self.best])

    def summary(self) -> dict[str, float]:
        """Plain numbers for JSON output and docs."""
        i = self.best
        return {"gpus": self.config.gpus, "job_mtbf_h": self.config.mtbf_s / 3600.0,
                "failures_per_run": self.failures_mean, "horizon_h": self.config.horizon_h,
                "young_daly_s": self.config.young_daly_s, "best_interval_s": self.best_interval_s,
                "goodput_mean": float(self.mean[i]), "goodput_p05": float(self.p05[i]),
                "goodput_p50": float(self.p50[i]), "goodput_p95": float(self.p95[i])}


def _failure_times(cfg: SimConfig, rng: Any) -> Any:
    """(trials, segments) running times to each failure, enough segments to pass the horizon."""
    import numpy as np

    horizon = cfg.horizon_h * 3600.0
    down = cfg.restart_s + cfg.requeue_s
    expected = horizon / (cfg.mtbf_s + down)
    segments = int(expected + 8 * math.sqrt(expected) + 16)
    while True:
        runs = rng.exponential(cfg.mtbf_s, size=(cfg.trials, segments))
        if np.all((runs + down).sum(axis=1) >= horizon):
            return runs
        segments *= 2  # rare: redraw longer rather than bias the tail


def _run_times(cfg: SimConfig, runs: Any) -> tuple[Any, Any]:
    """Training time of each segment, cut at the horizon; and which segments ended in a failure."""
    import numpy as np

    horizon = cfg.horizon_h * 3600.0
    walls = runs + cfg.restart_s + cfg.requeue_s
    starts = np.cumsum(walls, axis=1) - walls
    available = np.clip(horizon - starts, 0.0, None)
    return np.minimum(runs, available), runs < available


def goodput_per_trial(cfg: SimConfig, interval_s: float, run_times: Any) -> Any:
    """Goodput of each trial for one interval, given each segment's training time."""
    import numpy as np

    positive("interval_s", interval_s)
    # One write in flight at a time: a write longer than the interval delays the next snapshot.
    cycle = max(interval_s, cfg.lag_s if cfg.async_save else 0.0) + cfg.stall_s
    durable = np.floor(np.clip(run_times - cfg.lag_s, 0.0, None) / cycle)
    return durable.sum(axis=1) * interval_s / (cfg.horizon_h * 3600.0)


def default_intervals(cfg: SimConfig, points: int = 41) -> list[float]:
    """Log-spaced candidates from Young/Daly ÷ 8 to × 8, plus Young/Daly itself."""
    yd = cfg.young_daly_s
    grid = [yd * 8.0 ** (2.0 * k / (points - 1) - 1.0) for k in range(points)]
    return sorted({max(1.0, x) for x in grid} | {yd})


def simulate(cfg: SimConfig, intervals_s: list[float] | None = None) -> SimResult:
    """Goodput distribution for each interval, and the interval with the best mean."""
    import numpy as np

    intervals = np.asarray(intervals_s if intervals_s else default_intervals(cfg), dtype=float)
    for i, x in enumerate(intervals):
        positive(f"intervals_s[{i}]", float(x))
    rng = np.random.default_rng(cfg.seed)
    runs = _failure_times(cfg, rng)
    run_times, failed = _run_times(cfg, runs)
    table = np.stack([goodput_per_trial(cfg, float(t), run_times) for t in intervals])
    mean = table.mean(axis=1)
    p05, p50, p95 = np.percentile(table, [5, 50, 95], axis=1)
    return SimResult(config=cfg, intervals_s=intervals, mean=mean, p05=p05, p50=p50, p95=p95,
                     failures_mean=float(failed.sum(axis=1).mean()),
                     time_between_failures_h=float(runs[failed].mean() / 3600.0) if failed.any() else math.inf,
                     best=int(np.argmax(mean)))
