"""The failure simulator: seeded, vectorised, and consistent with the closed forms."""

import math
import time

import numpy as np
import pytest

from dslurm.errors import UserError
from dslurm.plan.recovery_sim import MECHANISMS, SAVES, timeline
from dslurm.plan.reliability import HOURS_PER_YEAR, first_order_goodput
from dslurm.plan.simulate import SimConfig, draw_failures, goodput_per_trial, score, simulate, size_spares


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
    asyn = simulate(SimConfig(**common, save="async"))
    yd = sync.config.young_daly_s
    assert 0.6 * yd < sync.best_interval_s < 1.6 * yd
    assert sync.mean.max() == sync.best_goodput
    assert 0.65 < sync.best_goodput < 0.80  # ~72% at a 36-minute interval
    assert asyn.best_goodput > sync.best_goodput + 0.08


def test_async_write_longer_than_the_interval_gates_the_next_snapshot():
    cfg = SimConfig(gpus=8, gpu_mtbf_h=1e9, save_s=600, save="async", async_stall_s=10,
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


# ---------------------------------------------------------------- recovery mechanisms and save modes

QUIET = dict(gpus=8, gpu_mtbf_h=1e12, trials=5, horizon_h=100)  # no failure inside the horizon


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("save, stall", [("sync", 240), ("async", 10), ("two_tier", 30)])
def test_without_failures_goodput_is_interval_over_cycle(mechanism, save, stall):
    cfg = SimConfig(**QUIET, mechanism=mechanism, save=save, spares=1, save_s=240, durable_lag_s=100)
    res = simulate(cfg, [1800])
    assert res.failures_mean == 0
    # Work in flight at the horizon is not counted: up to one cycle of 100 h.
    assert res.mean[0] == pytest.approx(1800 / (1800 + stall), abs=(1800 + stall + 240) / 360_000)


def _costs(**kw):
    return {**dict(gpus=16_384, trials=200, save_s=240, restart_s=600, requeue_s=300), **kw}


def test_a_free_spare_swap_beats_requeue_on_the_same_draws():
    base = SimConfig(**_costs(), relaunch_s=0, swap_s=0, spares=10_000)
    draws = draw_failures(base)
    req = score(SimConfig(**_costs(), mechanism="requeue"), draws, [1800])
    spare = score(SimConfig(**_costs(), mechanism="spare", relaunch_s=0, swap_s=0, spares=10_000), draws, [1800])
    assert spare.requeues_mean == 0 and req.requeues_mean == pytest.approx(req.failures_mean)
    assert np.all(spare.mean >= req.mean)
    # Each failure saves the 900 s of restart and queue: about failures x 900 s of a 30-day month.
    gain = spare.failures_mean * 900 / (30 * 24 * 3600) * 1800 / 2040
    assert spare.mean[0] - req.mean[0] == pytest.approx(gain, rel=0.25)


def test_spares_run_out_then_the_policy_decides():
    # One spare, a repair longer than the run: the second node loss finds none.
    common = _costs(relaunch_s=60, swap_s=60, spares=1, repair_h=10_000)
    draws = draw_failures(SimConfig(**common))
    spare = score(SimConfig(**common, mechanism="spare"), draws, [1800])
    shrink = score(SimConfig(**common, mechanism="shrink"), draws, [1800])
    # spare falls back to requeue, which brings a fresh allocation with its spare: every other loss.
    assert spare.requeues_mean == pytest.approx(spare.failures_mean / 2, abs=1)
    # shrink never requeues at 2,048 nodes; it goes on one node smaller after every loss past the spare.
    assert shrink.requeues_mean == 0 and shrink.shrinks_mean == pytest.approx(shrink.failures_mean - 1, abs=0.01)
    # Nodes never come back: ~280 lost nodes cost more speed than half of them cost in queue trips.
    assert shrink.mean[0] < spare.mean[0]
    # Back after 6 h: the shrunk job grows back at its next relaunch, and shrinking wins.
    fast = {**common, "repair_h": 6}
    spare6 = score(SimConfig(**fast, mechanism="spare"), draws, [1800])
    shrink6 = score(SimConfig(**fast, mechanism="shrink"), draws, [1800])
    assert shrink6.mean[0] > spare6.mean[0] + 0.02 and shrink6.requeues_mean == 0


def _reference(cfg, runs, node, interval):
    """One trial, scalar and written from the model's words: the check on the vectorised walk."""
    c, horizon = cfg.costs(), cfg.horizon_h * 3600
    t, speed, useful, repairs = 0.0, 1.0, 0.0, []  # repairs: when each of our lost nodes is back
    cycle = max(interval, cfg.lag_s) + cfg.stall_s
    for run, lost in zip(runs, node):
        trained = min(run, horizon - t)
        if trained < run:  # the horizon cuts this segment: count what is durable by then
            useful += math.floor(max(trained - cfg.lag_s, 0) / cycle) * interval * speed
            break
        t += run
        repairs = [r for r in repairs if r > t]
        alive = c.nodes + c.spares - len(repairs) - lost
        if cfg.mechanism == "requeue" or alive < (c.nodes if cfg.mechanism == "spare" else 1):
            down, nxt, repairs = c.restart_s + c.requeue_s, 1.0, []
        else:
            down, nxt = (c.swap_s if lost else c.relaunch_s), min(alive, c.nodes) / c.nodes
            repairs += [t + c.repair_s] if lost else []
        partner = cfg.save == "partner"
        local = (cfg.save in ("two_tier", "partner") and (not lost or partner)
                 and down != c.restart_s + c.requeue_s and nxt == speed)
        down += 0 if local else cfg.durable_restore_s
        lag = (cfg.partner_lag_s if lost else 0) if local else cfg.lag_s
        useful += math.floor(max(run - lag, 0) / cycle) * interval * speed
        t, speed = t + down, nxt
    return useful / horizon


@pytest.mark.parametrize("mechanism", MECHANISMS)
@pytest.mark.parametrize("save", SAVES)
def test_vectorised_walk_matches_a_scalar_reference(mechanism, save):
    # 3 nodes + 1 spare, failures every ~5 h, half of them node losses, repairs of 12 h: every branch.
    cfg = SimConfig(gpus=24, gpu_mtbf_h=24 * 5.0, mechanism=mechanism, save=save, spares=1, save_s=300,
                    local_stall_s=20, async_stall_s=5, durable_lag_s=200, restart_s=900, requeue_s=1800,
                    relaunch_s=100, swap_s=400, repair_h=12, node_loss_fraction=0.5, trials=40, horizon_h=200,
                    partner_lag_s=30, durable_restore_s=50)
    draws = draw_failures(cfg)
    got = goodput_per_trial(cfg, 1200.0, timeline(mechanism, draws, cfg.costs()))
    want = [_reference(cfg, draws.runs[i], draws.node_loss[i], 1200.0) for i in range(cfg.trials)]
    assert got == pytest.approx(want, abs=1e-12)


def test_two_tier_restores_local_after_a_crash_and_durable_after_a_node_loss():
    common = _costs(save="two_tier", local_stall_s=30, durable_lag_s=600, relaunch_s=60, swap_s=60, spares=50)
    crash = SimConfig(**common, mechanism="spare", node_loss_fraction=0.0)
    node = SimConfig(**common, mechanism="spare", node_loss_fraction=1.0)
    # Same exponential draws (the kind is drawn after them): only the restore tier differs.
    a, b = score(crash, draw_failures(crash), [1800]), score(node, draw_failures(node), [1800])
    lost_lag = a.failures_mean * 600 / (30 * 24 * 3600) * 1800 / 1830
    assert a.mean[0] - b.mean[0] == pytest.approx(lost_lag, rel=0.3)
    # Under requeue a crash lands on a new allocation: the local tier does not count.
    q = SimConfig(**{**common, "spares": 0}, mechanism="requeue", node_loss_fraction=0.0)
    q_node = SimConfig(**{**common, "spares": 0}, mechanism="requeue", node_loss_fraction=1.0)
    assert score(q, draw_failures(q), [1800]).mean[0] == score(q_node, draw_failures(q_node), [1800]).mean[0]


def test_partner_copies_restore_a_lost_node_at_local_speed():
    # Every failure a node loss, spares enough: two tiers restore from durable (the lag lost, the
    # slower restore paid); partner copies pull the lost node's shards (partner_lag_s lost).
    common = _costs(local_stall_s=30, durable_lag_s=600, relaunch_s=60, swap_s=60, spares=50, partner_lag_s=20,
                    durable_restore_s=120, node_loss_fraction=1.0, mechanism="spare")
    two, partner = SimConfig(**common, save="two_tier"), SimConfig(**common, save="partner")
    draws = draw_failures(two)
    a, b = score(two, draws, [1800]), score(partner, draws, [1800])
    gained = a.failures_mean * (600 - 20 + 120) / (30 * 24 * 3600) * 1800 / 1830
    assert b.mean[0] - a.mean[0] == pytest.approx(gained, rel=0.3)
    # Through the queue (a new allocation) the partner copy does not count: the same as two tiers.
    q = {**common, "mechanism": "requeue", "spares": 0}
    assert score(SimConfig(**q, save="partner"), draws, [1800]).mean[0] == \
        score(SimConfig(**q, save="two_tier"), draws, [1800]).mean[0]


def test_best_interval_near_young_daly_for_every_mechanism():
    for mechanism in MECHANISMS:
        res = simulate(SimConfig(**_costs(mechanism=mechanism, spares=30, swap_s=60, relaunch_s=60)))
        yd = res.config.young_daly_s
        assert 0.6 * yd < res.best_interval_s < 1.6 * yd, mechanism


def test_spares_for_a_probability_match_the_repair_queue():
    # Node losses at rate 1/M (M = 2.68 h), back after 24 h: about 9 under repair on average,
    # and the 99% quantile of the month's peak is well above that.
    cfg = SimConfig(**_costs(swap_s=60, relaunch_s=60), repair_h=24)
    draws = draw_failures(cfg)
    s99 = size_spares(cfg, draws, 0.99)
    s50 = size_spares(cfg, draws, 0.50)
    assert 24 / 2.68 < s99.mean_most_in_repair < s99.spares and s50.spares <= s99.spares
    # With that many spares the spare mechanism requeues in under 1% of runs.
    res = score(SimConfig(**_costs(swap_s=60, relaunch_s=60), repair_h=24, mechanism="spare", spares=s99.spares),
                draws, [1800])
    assert res.requeues_mean <= 0.01 * 2
    with pytest.raises(UserError, match="probability=1.0"):
        size_spares(cfg, draws, 1.0)


def test_mechanisms_and_saves_are_deterministic_by_seed():
    for save in SAVES:
        a = simulate(SimConfig(**_costs(mechanism="shrink", save=save, spares=2, trials=30)), [900])
        b = simulate(SimConfig(**_costs(mechanism="shrink", save=save, spares=2, trials=30)), [900])
        c = simulate(SimConfig(**_costs(mechanism="shrink", save=save, spares=2, trials=30, seed=1)), [900])
        assert a.mean[0] == b.mean[0] != c.mean[0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(gpus=12), "gpus=12 is not a whole number of nodes"),
    (dict(gpus=8, mechanism="elastic"), "mechanism='elastic' is unknown; choose one of requeue, spare, shrink"),
    (dict(gpus=8, save="tiered"), "save='tiered' is unknown"),
    (dict(gpus=8, node_loss_fraction=1.5), "node_loss_fraction=1.5 must be in"),
    (dict(gpus=8, spares=-1), "spares=-1 must be at least 0"),
    (dict(gpus=8, repair_h=0), "repair_h=0 must be greater than 0"),
    (dict(gpus=8, swap_s=-1), "swap_s=-1 must not be negative"),
])
def test_invalid_recovery_config(kwargs, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(")):
        SimConfig(**kwargs)
