"""Failure rates, checkpoint intervals and the cost of saving (seed 000 2.7, seed 004).

Failures are modelled as independent and exponential per GPU; N such GPUs fail, as a job,
at N times the rate (the first of N exponentials is exponential with rate N/MTBF).
"""

from __future__ import annotations

import math

from dslurm.plan._check import count, non_negative, positive

HOURS_PER_YEAR = 365.25 * 24  # 8766 h; "5 years (about 44,000 hours)" in seed 004


def job_mtbf_h(gpu_mtbf_h: float, gpus: int) -> float:
    """Mean time between failures of a job that stops when any of its `gpus` fails.

    Seed 004: 5 years per GPU (≈ 43,830 h) → ≈ 44 h at 1,000 GPUs, ≈ 2.7 h at 16,000.
    """
    positive("gpu_mtbf_h", gpu_mtbf_h)
    count("gpus", gpus)
    return gpu_mtbf_h / gpus


def expected_failures(gpu_mtbf_h: float, gpus: int, hours: float) -> float:
    """Mean number of interruptions in `hours` of wall clock."""
    non_negative("hours", hours)
    return hours / job_mtbf_h(gpu_mtbf_h, gpus)


def implied_gpu_mtbf_h(failures: int, hours: float, gpus: int) -> float:
    """Per-GPU MTBF implied by an observed failure count (Llama 3: 419 in 54 days, ~16k GPUs)."""
    count("failures", failures)
    positive("hours", hours)
    count("gpus", gpus)
    return hours * gpus / failures


def interval_from_loss_budget(mean_lost_s: float) -> float:
    """Useful-compute interval whose average lost work is `mean_lost_s`: twice the budget.

    Assumes a failure is equally likely anywhere in the interval, so on average half is lost;
    ignores persistence lag and failures while saving (seed 000, 2.7: 15 min → 30 min).
    """
    return 2.0 * positive("mean_lost_s", mean_lost_s)


def young_daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """First-order optimal interval sqrt(2·δ·M) (Young 1974, Daly 2006) for save cost δ."""
    positive("save_s", save_s)
    positive("mtbf_s", mtbf_s)
    return math.sqrt(2.0 * save_s * mtbf_s)


def save_fraction(interval_s: float, stall_s: float) -> float:
    """Share of a save cycle spent stalled: δ / (τ + δ). 4 min after 30 min → 11.8%."""
    positive("interval_s", interval_s)
    non_negative("stall_s", stall_s)
    return stall_s / (interval_s + stall_s)


def lost_work_cost(mean_lost_s: float, gpus: int, price_per_gpu_h: float) -> float:
    """Compute money one failure burns on average: 15 min × 512 GPUs × $4 → $512."""
    non_negative("mean_lost_s", mean_lost_s)
    count("gpus", gpus)
    non_negative("price_per_gpu_h", price_per_gpu_h)
    return mean_lost_s / 3600.0 * gpus * price_per_gpu_h


def first_order_goodput(*, interval_s: float, stall_s: float, mtbf_s: float,
                        downtime_s: float = 0.0, lag_s: float = 0.0) -> float:
    """Expected goodput to first order in (τ+δ)/M: the analytic check on the simulator.

    A cycle keeps τ/(τ+δ) of its time useful; each failure (rate 1/M) loses on average half
    a cycle plus the persistence lag, and `downtime_s` of restore, restart and requeue.
    """
    positive("interval_s", interval_s)
    non_negative("stall_s", stall_s)
    positive("mtbf_s", mtbf_s)
    non_negative("downtime_s", downtime_s)
    non_negative("lag_s", lag_s)
    cycle = interval_s + stall_s
    lost_per_failure = cycle / 2.0 + lag_s + downtime_s
    return max(0.0, interval_s / cycle * (1.0 - lost_per_failure / mtbf_s))
