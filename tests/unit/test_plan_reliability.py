"""Failure rates and checkpoint intervals against seeds 000 (2.7) and 004."""

import math

import pytest

from dslurm.errors import UserError
from dslurm.plan.reliability import (
    HOURS_PER_YEAR,
    expected_failures,
    first_order_goodput,
    implied_gpu_mtbf_h,
    interval_from_loss_budget,
    job_mtbf_h,
    lost_work_cost,
    save_fraction,
    young_daly_interval_s,
)

FIVE_YEARS_H = 5 * HOURS_PER_YEAR


def test_five_years_is_about_44000_hours():
    assert FIVE_YEARS_H == pytest.approx(44_000, rel=0.01)


@pytest.mark.parametrize("gpus, hours, tol", [(1_000, 44, 0.01), (16_000, 3, 0.1)])
def test_job_mtbf(gpus, hours, tol):
    assert job_mtbf_h(FIVE_YEARS_H, gpus) == pytest.approx(hours, rel=tol)


def test_llama3_interruptions_are_the_same_order():
    # 419 unexpected interruptions in 54 days on ~16k GPUs.
    implied = implied_gpu_mtbf_h(419, 54 * 24, 16_384) / HOURS_PER_YEAR
    assert 2.5 < implied < 10  # ~5.8 years per GPU: within a factor of two of the 5-year model
    predicted = expected_failures(FIVE_YEARS_H, 16_384, 54 * 24)
    assert predicted == pytest.approx(484, rel=0.01)
    assert 0.5 < 419 / predicted < 2


def test_interval_from_a_15_minute_budget_and_its_sync_save_cost():
    interval = interval_from_loss_budget(15 * 60)
    assert interval == 30 * 60
    assert save_fraction(interval, 4 * 60) == pytest.approx(4 / 34)
    assert round(100 * save_fraction(interval, 4 * 60), 1) == 11.8


def test_cost_of_the_loss_budget():
    assert lost_work_cost(3600, 512, 4.0) == 2048  # $ per wall-clock hour of the job
    assert lost_work_cost(15 * 60, 512, 4.0) == 512  # $ per failure at 15 minutes lost


def test_young_daly():
    assert young_daly_interval_s(240, 10_000) == pytest.approx(math.sqrt(2 * 240 * 10_000))
    # 16,384 GPUs at 5 years, 4-minute save: about 36 minutes.
    mtbf_s = job_mtbf_h(FIVE_YEARS_H, 16_384) * 3600
    assert young_daly_interval_s(240, mtbf_s) / 60 == pytest.approx(35.8, abs=0.1)


def test_first_order_goodput_is_best_near_young_daly():
    mtbf = 10 * 3600.0
    yd = young_daly_interval_s(60, mtbf)
    g = {t: first_order_goodput(interval_s=t, stall_s=60, mtbf_s=mtbf) for t in (yd / 3, yd, 3 * yd)}
    assert g[yd] > g[yd / 3] and g[yd] > g[3 * yd]
    # No failures cost (infinite MTBF in the limit): only the save fraction is lost.
    assert first_order_goodput(interval_s=1800, stall_s=240, mtbf_s=1e15) == pytest.approx(30 / 34)


@pytest.mark.parametrize("call, field", [
    (lambda: job_mtbf_h(-5, 8), "gpu_mtbf_h=-5"),
    (lambda: job_mtbf_h(100, 0), "gpus=0"),
    (lambda: interval_from_loss_budget(0), "mean_lost_s=0"),
    (lambda: save_fraction(0, 60), "interval_s=0"),
    (lambda: young_daly_interval_s(-1, 10), "save_s=-1"),
])
def test_invalid_inputs(call, field):
    with pytest.raises(UserError, match=field):
        call()
