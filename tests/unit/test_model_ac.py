"""Activation checkpointing changes memory, never the numbers; state_dict names survive."""

from __future__ import annotations

import pytest
import torch

from dslurm.config.models import PRESETS
from train.model import build_model, cross_entropy
from train.parallel.ac import apply_ac

TINY = PRESETS["tiny"]


def _loss_and_grads(mode: str):
    model = build_model(TINY, seed=0)
    apply_ac(model, mode)
    tokens = torch.randint(0, TINY.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return model, loss.item(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recomputation_gives_the_same_loss_and_gradients(mode):
    _, ref_loss, ref_grads = _loss_and_grads("none")
    model, loss, grads = _loss_and_grads(mode)
    assert loss == pytest.approx(ref_loss, abs=1e-6)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads, ref_grads))
    assert set(model.state_dict()) == set(build_model(TINY, seed=0).state_dict())


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="none, selective or full"):
        apply_ac(build_model(TINY, seed=0), "some")
