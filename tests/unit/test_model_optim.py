"""Optimizer pieces on plain tensors: the norm/clip and the LR of each step (the DTensor
cases are checked against one process in tests/integration/test_parity.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dslurm.config.models import PRESETS
from train.lr import lr_at
from train.model import build_model
from train.optim import build_optimizers, clip_grad_norm_


def _model_with_grads():
    model = build_model(PRESETS["tiny"], seed=0)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def test_clip_matches_torch_and_returns_the_norm_before_clipping():
    a, b = _model_with_grads(), _model_with_grads()
    for pa, pb in zip(a.parameters(), b.parameters()):
        pb.grad = pa.grad.clone()
    ours = clip_grad_norm_(list(a.parameters()), 1.0)
    ref = torch.nn.utils.clip_grad_norm_(b.parameters(), 1.0)
    assert ours.item() == pytest.approx(ref.item(), rel=1e-6) and ours.item() > 1.0
    assert all(torch.allclose(pa.grad, pb.grad) for pa, pb in zip(a.parameters(), b.parameters()))
    after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in a.parameters()]))
    assert after.item() == pytest.approx(1.0, rel=1e-5)


def test_zero_max_norm_measures_without_clipping():
    model = _model_with_grads()
    before = [p.grad.clone() for p in model.parameters()]
    clip_grad_norm_(list(model.parameters()), 0.0)
    assert all(torch.equal(g, p.grad) for g, p in zip(before, model.parameters()))


def test_lr_of_each_step_follows_the_schedule():
    train = SimpleNamespace(lr=3e-3, warmup_steps=3, steps=10, min_lr_ratio=0.1, weight_decay=0.1)
    model = build_model(PRESETS["tiny"], seed=0)
    [opt], [sched] = build_optimizers([model], train)
    for step in range(12):
        assert opt.param_groups[0]["lr"] == pytest.approx(
            lr_at(step, lr=3e-3, warmup_steps=3, total_steps=10, min_lr_ratio=0.1))
        opt.step()
        sched.step()
