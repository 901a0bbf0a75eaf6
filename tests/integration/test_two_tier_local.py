"""Two-tier checkpoints in one process (no process group): local commit then durable copy, full
scratch and full durable disks, retention on both tiers, the lag policies, resume from either
tier. The two-"node" torchrun cases live in test_two_tier_dist.py."""

from __future__ import annotations

import errno
import random
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dslurm import checkpoint as ck
from dslurm.checkpoint import tiers
from dslurm.checkpoint.dcp import CheckpointManager, TrainState
from dslurm.checkpoint.twotier import NodeWriter
from testkit import RecordingLedger

pytestmark = pytest.mark.integration
Ledger = RecordingLedger


class Run:
    """Model + AdamW + LambdaLR + torch and Python RNG + a sampler position in `extra`."""

    def __init__(self, seed: int = 0) -> None:
        torch.manual_seed(seed)
        random.seed(seed)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.2), nn.Linear(16, 4))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0 / (1 + s))
        self.state = {"train": TrainState(self.model, self.opt, self.sched)}
        self.extra: dict[str, Any] = {"sampler": {"index": 5}}

    def step(self) -> float:
        g = torch.Generator().manual_seed(self.extra["sampler"]["index"])
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        x = x * (1 + random.random())
        self.extra["sampler"]["index"] += 3
        loss = nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad()
        return loss.item()


def _mgr(tmp: Path, **kw: Any) -> CheckpointManager:
    kw.setdefault("async_mode", True)
    return CheckpointManager(tmp / "run", scratch=str(tmp / "scratch" / "%n"), **kw)


def _local_dir(tmp: Path) -> Path:
    return tiers.local_run_dir(tiers.expand_scratch(str(tmp / "scratch" / "%n"), tiers.node_name()), tmp / "run")


def test_local_commit_then_durable_copy(tmp_path):
    run, ledger = Run(), Ledger()
    with _mgr(tmp_path, ledger=ledger) as mgr:
        run.step()
        assert mgr.save(1, run.state, run.extra)
        mgr.wait()
        out = mgr.last_outcome
    assert out.ok and out.tier == "two_tier" and out.lag_s is not None and out.local_s is not None
    ptr = ck.read_pointer(tmp_path / "run")
    assert ptr.generation == out.generation and not ck.verify_generation(ck.generations_dir(tmp_path / "run")
                                                                         / ptr.generation)
    rec = tiers.read_record(ck.generations_dir(_local_dir(tmp_path)) / out.generation, 0)
    assert rec is not None and rec.step == 1 and "__0_0.distcp" in rec.files
    assert ledger.names() == ["ckpt_local_commit", "ckpt_save"]
    save = ledger.events[-1]
    assert save.tier == "two_tier" and save.lag_s == out.lag_s and save.local_commit_t


def _train(tmp: Path, steps: int, saves: tuple[int, ...], **kw: Any) -> tuple[Run, list[float]]:
    run, losses = Run(), []
    with _mgr(tmp, **kw) as mgr:
        for s in range(1, steps + 1):
            losses.append(run.step())
            if s in saves:
                mgr.save(s, run.state, run.extra)
    return run, losses


def _resume(tmp: Path, steps: int) -> tuple[Any, Run, list[float]]:
    run = Run(seed=7)
    with _mgr(tmp) as mgr:
        res = mgr.restore(run.state, run.extra)
        losses = [run.step() for _ in range(res.step, steps)]
    return res, run, losses


def test_resume_from_local_and_from_durable_is_bit_identical(tmp_path):
    ref, ref_losses = _train(tmp_path / "ref", 6, ())
    _train(tmp_path / "a", 3, (2, 3))
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # same scratch name: the hash is of the run dir
    res, run, losses = _resume(tmp_path / "a", 6)
    assert res.tier == "local" and res.step == 3 and losses == ref_losses[3:]
    assert all(torch.equal(p, q) for p, q in zip(ref.model.parameters(), run.model.parameters()))
    shutil.rmtree(tmp_path / "b" / "scratch")  # node loss
    res, run, losses = _resume(tmp_path / "b", 6)
    assert res.tier == "durable" and res.step == 3 and "no local generation" in res.tier_reason
    assert losses == ref_losses[3:]


def _scratch_full(monkeypatch: pytest.MonkeyPatch) -> None:
    def write_data(self, plan, planner):
        (Path(self.path) / f"{plan.storage_data.prefix}0.distcp").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(NodeWriter, "write_data", write_data)


def _durable_full(monkeypatch: pytest.MonkeyPatch) -> None:
    def copy_file(src, dst, **kw):
        Path(dst).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(tiers, "copy_file", copy_file)


@pytest.mark.parametrize("which", ["scratch", "durable"])
def test_full_disk_never_moves_the_pointer(tmp_path, monkeypatch, which):
    run, ledger = Run(), Ledger()
    with _mgr(tmp_path, ledger=ledger) as mgr:
        run.step()
        mgr.save(1, run.state, run.extra)
        mgr.wait()
        good = ck.read_pointer(tmp_path / "run").generation
        with monkeypatch.context() as m:
            (_scratch_full if which == "scratch" else _durable_full)(m)
            run.step()
            mgr.save(2, run.state, run.extra)
            mgr.wait()
        out = mgr.last_outcome
        assert not out.ok and "No space left on device" in out.reason
        assert ("local tier" if which == "scratch" else "durable copy") in out.reason
        assert ck.read_pointer(tmp_path / "run").generation == good
        assert [g.name for g in ck.list_generations(tmp_path / "run")] == [good]  # partial removed
        local = [g.step for g in ck.list_generations(_local_dir(tmp_path))]
        # a full scratch leaves nothing local; a full durable disk leaves the local commit (valid)
        assert local == ([1] if which == "scratch" else [1, 2])
        run.step()
        assert mgr.save(3, run.state, run.extra)  # on_error=continue: training goes on
    assert ck.read_pointer(tmp_path / "run").step == 3
    assert "ckpt_save_failed" in ledger.names()


@pytest.mark.parametrize("which", ["scratch", "durable"])
def test_full_disk_stops_when_asked(tmp_path, monkeypatch, which):
    run = Run()
    mgr = _mgr(tmp_path, on_error="stop")
    (_scratch_full if which == "scratch" else _durable_full)(monkeypatch)
    run.step()
    with pytest.raises(ck.CheckpointError, match="No space left on device"):
        mgr.save(1, run.state, run.extra)
        mgr.wait()
    assert ck.read_pointer(tmp_path / "run") is None
    mgr.close()


def test_retention_on_both_tiers(tmp_path):
    _train(tmp_path, 5, (1, 2, 3, 4, 5), keep=2, keep_local=1)
    assert [g.step for g in ck.list_generations(tmp_path / "run")] == [4, 5]
    assert [g.step for g in ck.list_generations(_local_dir(tmp_path))] == [5]


def _slow_copy(monkeypatch: pytest.MonkeyPatch, secs: float) -> None:
    real = tiers.copy_file

    def slow(src, dst, **kw):
        time.sleep(secs)
        return real(src, dst, **kw)
    monkeypatch.setattr(tiers, "copy_file", slow)


@pytest.mark.parametrize("policy", ["wait", "skip_local", "skip_durable"])
def test_lag_policies(tmp_path, monkeypatch, policy):
    _slow_copy(monkeypatch, 0.4)
    run, ledger = Run(), Ledger()
    with _mgr(tmp_path, ledger=ledger, on_lag=policy) as mgr:
        run.step()
        mgr.save(1, run.state, run.extra)
        time.sleep(0.3)  # local commit done, the copy of step 1 still running
        run.step()
        t = time.perf_counter()
        saved = mgr.save(2, run.state, run.extra)
        blocked = time.perf_counter() - t
    names = ledger.names()
    if policy == "wait":
        assert saved and blocked > 0.2 and names.count("ckpt_save") == 2
        commits = [e for e in ledger.events if e.NAME == "ckpt_local_commit"]
        saves = [e for e in ledger.events if e.NAME == "ckpt_save"]
        # the wait is recorded for the report (dslurm/observe/durability.py) and billed as stall
        assert commits[0].lag_wait_s == 0 and 0.2 < commits[1].lag_wait_s <= blocked
        assert saves[1].stall_s >= commits[1].lag_wait_s
    elif policy == "skip_local":
        assert not saved and blocked < 0.2 and names.count("ckpt_local_commit") == 1
        assert [e.reason for e in ledger.events if e.NAME == "ckpt_save_skipped"] == ["lag"]
    else:
        assert saved and blocked < 0.2 and names.count("ckpt_local_commit") == 2
        assert names.count("ckpt_durable_skipped") == 1 and names.count("ckpt_save") == 1
        assert ck.read_pointer(tmp_path / "run").step == 1
        assert [g.step for g in ck.list_generations(_local_dir(tmp_path))] == [1, 2]


def test_final_blocking_save_reaches_durable(tmp_path, monkeypatch):
    _slow_copy(monkeypatch, 0.2)
    run = Run()
    with _mgr(tmp_path, on_lag="skip_durable") as mgr:
        run.step()
        mgr.save(1, run.state, run.extra)
        run.step()
        assert mgr.save(2, run.state, run.extra, blocking=True)
        assert ck.read_pointer(tmp_path / "run").step == 2  # before save() returned


@pytest.mark.parametrize("tiers_", ["durable", "two_tier"])
def test_the_manager_takes_the_checkpoint_section_as_is(tmp_path, tiers_):
    """`CheckpointManager.from_spec` (what `runtime.manager_for` hands over): the job's
    `checkpoint` section picks the tier strategy and its policies; the site's scratch is used only
    with `tiers: two_tier`, and a save then commits in both tiers (durable: only in the run dir)."""
    from dslurm.config import CheckpointSpec
    spec = CheckpointSpec(keep=3, keep_every=10, async_save=True, on_inflight="skip", on_error="stop",
                          tiers=tiers_, keep_local=1, on_lag="skip_local")
    scratch, run = tmp_path / "scratch", tmp_path / "run"
    with CheckpointManager.from_spec(run, spec, scratch=str(scratch), layout={"dp": 1}) as mgr:
        assert mgr.tier.kind == tiers_
        s = mgr.settings
        assert (s.keep, s.keep_every, s.async_mode, s.on_inflight, s.on_error, s.layout) == \
            (3, 10, True, "skip", "stop", {"dp": 1})
        if tiers_ == "two_tier":
            assert (mgr.tier.keep_local, mgr.tier.on_lag) == (1, "skip_local")
        assert mgr.save(1, Run().state, {}, blocking=True)
    assert ck.read_pointer(run).step == 1
    assert scratch.exists() == (tiers_ == "two_tier")  # durable: the site's scratch is never touched
