"""A save's host copy overlapped with the next step (dslurm/checkpoint/staging.py) writes exactly the
state of the step it was taken at: compared tensor by tensor with a clone taken at that moment
(the single-process reference), with the copy ending before the next forward and, forced by
DSLURM_FAULT_STAGE_DELAY, after the next backward (the optimizer step must then wait for it).
Both background paths: async durable and two tiers. The model has a BatchNorm, whose running
statistics the next forward changes before any optimizer step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dslurm.checkpoint.dcp import CheckpointManager, TrainState

pytestmark = pytest.mark.integration


class Run:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = nn.Sequential(nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 8))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.state = {"train": TrainState(self.model, self.opt)}
        self.n = 0

    def forward_backward(self) -> None:
        g = torch.Generator().manual_seed(self.n)
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 8, generator=g)
        nn.functional.mse_loss(self.model(x), y).backward()

    def step(self) -> None:
        self.forward_backward()
        self.opt.step()
        self.opt.zero_grad()
        self.n += 1


def _flat(sd: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(sd, dict):
        return {k: v for key, val in sd.items() for k, v in _flat(val, f"{prefix}{key}.").items()}
    return {prefix.rstrip("."): sd.detach().clone() if isinstance(sd, torch.Tensor) else sd}


def _mgr(tmp: Path, tier: str) -> CheckpointManager:
    scratch = str(tmp / "scratch" / "%n") if tier == "two_tier" else None
    return CheckpointManager(tmp / "run", async_mode=True, scratch=scratch)


@pytest.mark.parametrize("tier", ["durable", "two_tier"])
@pytest.mark.parametrize("order", ["copy_before_forward", "copy_after_backward"])
def test_overlapped_save_holds_the_state_of_its_step(tmp_path, monkeypatch, tier, order):
    run = Run()
    with _mgr(tmp_path, tier) as mgr:
        for _ in range(3):
            run.step()
        reference = _flat(run.state["train"].state_dict())  # step 3, cloned before the save
        if order == "copy_after_backward":
            monkeypatch.setenv("DSLURM_FAULT_STAGE_DELAY", "0.6")
        assert mgr.save(3, run.state, {})
        stager = mgr._stager
        assert stager is not None and stager.overlap
        if order == "copy_before_forward":
            mgr.fence()
            assert not stager.busy
        run.forward_backward()  # step 4: BatchNorm's running statistics change here
        if order == "copy_after_backward":
            assert stager.busy, "the copy was meant to end after the backward"
        run.opt.step()  # the fence: waits for the copy before touching parameters and moments
        assert not stager.busy
        run.opt.zero_grad()
        after = _flat(run.state["train"].state_dict())
        mgr.wait()
        out = mgr.last_outcome
    assert out is not None and out.ok and out.step == 3, out
    changed = [k for k, v in reference.items() if isinstance(v, torch.Tensor) and not torch.equal(v, after[k])]
    assert any("running_mean" in k for k in changed) and any("exp_avg" in k for k in changed)

    fresh = Run()
    with _mgr(tmp_path, tier) as mgr:
        res = mgr.restore(fresh.state)
    assert res is not None and res.step == 3 and res.tier == ("local" if tier == "two_tier" else "durable")
    restored = _flat(fresh.state["train"].state_dict())
    assert restored.keys() == reference.keys()
    for k, v in reference.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(restored[k], v), k
        else:
            assert restored[k] == v, k
    if order == "copy_after_backward":  # the wait at the optimizer step counts as stall
        assert out.stall_s > 0.2, out


def test_no_overlap_stages_on_the_calling_thread(tmp_path):
    run = Run()
    run.step()
    with CheckpointManager(tmp_path / "run", async_mode=True, overlap_staging=False) as mgr:
        assert mgr.save(1, run.state, {})
        assert mgr._stager is not None and not mgr._stager.busy  # copied before save() returned
        run.step()
        mgr.wait()
        assert mgr.last_outcome is not None and mgr.last_outcome.ok
