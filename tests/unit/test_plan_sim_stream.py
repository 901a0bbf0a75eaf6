"""`plan simulate` streams its trials: bounded chunks, the same statistics as one pass over the
same draws, and a refusal (exit 2) past MAX_TRIALS instead of an OOM on a login node."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dslurm.plan import sim_stream
from dslurm.plan.recovery_sim import Draws
from dslurm.plan.simulate import SimConfig, score, size_spares
from testkit import run_cli


def test_chunks_are_bounded_and_streamed_stats_match_one_pass_over_the_same_draws(monkeypatch):
    monkeypatch.setattr(sim_stream, "CELLS", 2_000)
    cfg = SimConfig(gpus=4096, trials=600, horizon_h=300, node_loss_fraction=0.5)
    parts = list(sim_stream.chunks(cfg))
    size = sim_stream.chunk_trials(cfg)
    assert len(parts) >= 4 and all(p.runs.shape[0] <= size for p in parts)
    assert sum(p.runs.shape[0] for p in parts) == cfg.trials
    width = max(p.runs.shape[1] for p in parts)
    pad = [(np.pad(p.runs, ((0, 0), (0, width - p.runs.shape[1])), constant_values=np.inf),
            np.pad(p.node_loss, ((0, 0), (0, width - p.runs.shape[1])))) for p in parts]
    whole = Draws(runs=np.concatenate([r for r, _ in pad]), node_loss=np.concatenate([n for _, n in pad]))
    for mechanism in ("requeue", "shrink"):
        c = SimConfig(gpus=4096, trials=600, horizon_h=300, node_loss_fraction=0.5, mechanism=mechanism, spares=2)
        want = score(c, whole, [900, 1800, 3600])
        got = sim_stream.score_streamed(cfg, [c], [900, 1800, 3600])[0]
        np.testing.assert_allclose(got.mean, want.mean, rtol=1e-12)
        assert got.failures_mean == pytest.approx(want.failures_mean)
        assert got.requeues_mean == pytest.approx(want.requeues_mean)
        assert got.shrinks_mean == pytest.approx(want.shrinks_mean)
        assert got.best == want.best
        for q in ("p05", "p50", "p95"):  # histogram percentiles: within a few bins of the exact ones
            np.testing.assert_allclose(getattr(got, q), getattr(want, q), atol=5e-3)
    assert sim_stream.size_spares_streamed(cfg, 0.9) == size_spares(cfg, whole, 0.9)


def test_one_chunk_is_the_unstreamed_simulation_exactly():
    cfg = SimConfig(gpus=4096, trials=200, horizon_h=500)
    assert sim_stream.chunk_trials(cfg) >= cfg.trials
    from dslurm.plan.simulate import simulate
    want, got = simulate(cfg, [1800]), sim_stream.score_streamed(cfg, [cfg], [1800])[0]
    assert (got.mean, got.p05, got.p95) == (want.mean, want.p05, want.p95)


def test_trials_past_the_cap_are_refused_with_exit_2_and_1e3_is_a_count():
    r = run_cli("plan", "simulate", "--gpus", "8", "--trials", "1e8", timeout=30)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "--trials 100000000" in r.stderr and f"--trials {sim_stream.MAX_TRIALS} or fewer" in r.stderr
    r = run_cli("plan", "simulate", "--gpus", "8", "--trials", "1e2", "--mechanism", "requeue", "--save", "sync",
                "--interval-s", "3600", "--json", timeout=60)
    assert r.returncode == 0, r.stderr
    r = run_cli("plan", "simulate", "--gpus", "8", "--trials", "2.5", timeout=30)
    assert r.returncode == 2 and "not a whole number" in r.stderr


def test_simulate_says_how_it_chose_the_best_interval():
    r = run_cli("plan", "simulate", "--gpus", "1024", "--trials", "50", "--mechanism", "requeue", "--save", "sync",
                "--json", timeout=60)
    out = json.loads(r.stdout)
    assert out["best_interval_from"].startswith("searched: the best mean goodput among the scored intervals, 41 ")
    assert len(out["results"][0]["intervals"]) >= 41  # it did score them
    r = run_cli("plan", "simulate", "--gpus", "1024", "--trials", "50", "--mechanism", "requeue", "--save", "sync",
                "--interval-s", "600", "--interval-s", "1200", "--json", timeout=60)
    assert json.loads(r.stdout)["best_interval_from"] == "the best mean goodput of the 2 --interval-s given"
