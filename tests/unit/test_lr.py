"""Warmup + cosine schedule: values at the key points, and the LambdaLR factor."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from train.lr import lr_at, lr_factor, lr_lambda, schedule_for

KW = dict(lr=1e-3, warmup_steps=10, total_steps=110, min_lr_ratio=0.1)


def test_key_points():
    assert lr_at(0, **KW) == pytest.approx(1e-4)  # first step already moves
    assert lr_at(4, **KW) == pytest.approx(5e-4)
    assert lr_at(9, **KW) == pytest.approx(1e-3)  # end of warmup: the peak
    assert lr_at(10, **KW) == pytest.approx(1e-3)  # cosine starts at the peak
    assert lr_at(60, **KW) == pytest.approx(0.55e-3)  # halfway: (1 + 0.1) / 2
    assert lr_at(35, **KW) == pytest.approx(1e-4 + 0.9e-3 * (1 + math.cos(math.pi / 4)) / 2)
    assert lr_at(110, **KW) == pytest.approx(1e-4)  # floor
    assert lr_at(10_000, **KW) == pytest.approx(1e-4)


def test_monotone_after_warmup_and_never_below_the_floor():
    values = [lr_at(s, **KW) for s in range(10, 120)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert min(values) == pytest.approx(1e-4)


def test_no_warmup_and_zero_floor():
    kw = dict(lr=2.0, warmup_steps=0, total_steps=100, min_lr_ratio=0.0)
    assert lr_at(0, **kw) == pytest.approx(2.0)
    assert lr_at(50, **kw) == pytest.approx(1.0)
    assert lr_at(100, **kw) == 0.0


def test_invalid_arguments():
    with pytest.raises(ValueError, match="min_lr_ratio"):
        lr_factor(0, warmup_steps=1, total_steps=2, min_lr_ratio=1.5)
    with pytest.raises(ValueError, match="step"):
        lr_factor(-1, warmup_steps=1, total_steps=2, min_lr_ratio=0.1)
    with pytest.raises(ValueError, match="min_lr_ratio"):
        lr_lambda(warmup_steps=1, total_steps=2, min_lr_ratio=-0.1)  # checked when built


def test_lambda_factor_follows_the_pure_function():
    # LambdaLR sets lr = base_lr * factor(last_epoch), with last_epoch 0 for the first step.
    # Not exercised with a real optimizer here: constructing one imports torch._dynamo
    # (3-7 s on 2 cores); the trainer's integration tests run the real scheduler.
    factor = lr_lambda(warmup_steps=10, total_steps=110, min_lr_ratio=0.1)
    for step in range(120):
        assert KW["lr"] * factor(step) == pytest.approx(lr_at(step, **KW)), step


def test_schedule_for_reads_the_train_spec():
    train = SimpleNamespace(lr=1e-3, warmup_steps=10, steps=110, min_lr_ratio=0.1)
    at = schedule_for(train)
    assert [at(s) for s in (0, 60, 110)] == [lr_at(s, **KW) for s in (0, 60, 110)]
