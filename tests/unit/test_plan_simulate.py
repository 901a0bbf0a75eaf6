"""The failure simulator: seeded, vectorised, and consistent with the closed forms."""

import time

import numpy as np
import pytest

from dslurm.errors import UserError
from dslurm.plan.reliability import HOURS_PER_YEAR, first_order_goodput
from dslurm.plan.simulate import SimConfig, simulate


def test_draws_reproduce_the_seed_failure_rates():
    for gpus, hours in ((1_000, 44), (16_000, 2.74)):
        res = simulate(SimConfig(gpus=gpus, trials=200, horizon_h=2000), [1800])
        assert res.time_between_failures_h == pytest.approx(hours, rel=0.05)


def test_first_of_n_gpu_exponentials_is_the_job_exponential():
    # The simulator draws one exponential per job; check that equals min over per-GPU draws.
    rng = np.random.default_rng(1)
    per_gpu = rng.exponential(5 * HOURS_PER_YEAR, size=(20_000, 64)).min(axis=1)
    assert per_gpu.mean() == pytest.approx(5 * HOURS_PER_YEAR / 64, rel=0.03)


def test_same_seed_same_numbers_and_different_seed_differs():
    cfg = dict(gpus=4096, trials=50, horizon_h=500)
    a, b = simulate(SimConfig(**cfg), [1200]), simulate(SimConfig(**cfg), [1200])
    c = simulate(SimConfig(**cfg, seed=7), [1200])
    assert a.mean[0] == b.mean[0] and a.mean[0] != c.mean[0]


def test_goodput_matches_first_order_formula_when_failures_are_rare():
    cfg = SimConfig(gpus=1_000, save_s=240, restart_s=600, requeue_s=300, trials=300, horizon_h=3000)
    res = simulate(cfg, [1800])
    expect = first_order_goodput(interval_s=1800, stall_s=240, mtbf_s=cfg.mtbf_s, downtime_s=900)
    assert res.mean[0] == pytest.approx(expect, abs=0.01)
    assert res.p05[0] <= res.p50[0] <= res.p95[0]


def test_best_interval_is_near_young_daly_and_async_beats_sync():
    common = dict(gpus=16_384, save_s=240, trials=200, horizon_h=24 * 30)
    sync = simulate(SimConfig(**common))
    asyn = simulate(SimConfig(**common, async_save=True))
    yd = sync.config.young_daly_s
    assert 0.6 * yd < sync.best_interval_s < 1.6 * yd
    assert sync.mean.max() == sync.best_goodput
    assert 0.65 < sync.best_goodput < 0.80  # ~72% at a 36-minute interval
    assert asyn.best_goodput > sync.best_goodput + 0.08


def test_async_write_longer_than_the_interval_gates_the_next_snapshot():
    cfg = SimConfig(gpus=8, gpu_mtbf_h=1e9, save_s=600, async_save=True, async_stall_s=10,
                    trials=5, horizon_h=100)
    res = simulate(cfg, [60, 3000])
    # With the write taking 600 s, a 60 s interval keeps only 60 of every 610 s.
    assert res.mean[0] == pytest.approx(60 / 610, rel=0.01)
    assert res.mean[1] == pytest.approx(3000 / 3010, rel=0.01)


def test_16k_gpus_many_trials_runs_in_seconds():
    t = time.perf_counter()
    simulate(SimConfig(gpus=16_384, trials=2000))
    assert time.perf_counter() - t < 5


@pytest.mark.parametrize("kwargs, field", [
    (dict(gpus=0), "gpus=0"), (dict(gpus=8, save_s=-1), "save_s=-1"),
    (dict(gpus=8, trials=0), "trials=0"), (dict(gpus=8, restart_s=-3), "restart_s=-3"),
])
def test_invalid_config(kwargs, field):
    with pytest.raises(UserError, match=field):
        SimConfig(**kwargs)


def test_invalid_interval():
    with pytest.raises(UserError, match="interval"):
        simulate(SimConfig(gpus=8, trials=2, horizon_h=10), [0])
