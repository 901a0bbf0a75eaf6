"""CheckpointManager in one process (no process group): resume equivalence, fallback, full disk,
in-flight policy, shape refusal, lock. The torchrun cases live in test_checkpoint_dist.py."""

from __future__ import annotations

import errno
import logging
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.checkpoint import filesystem as dcp_fs

from dslurm import checkpoint as ck
from dslurm.checkpoint.dcp import CheckpointManager, TrainState
from dslurm.runtime.state import train_state
from testkit import ReadCounter, RecordingLedger, mount_tmpfs

pytestmark = pytest.mark.integration
Ledger = RecordingLedger


class Tiny(nn.Module):
    def __init__(self, dim: int = 16):
        super().__init__()
        self.l1, self.drop, self.l2 = nn.Linear(8, dim), nn.Dropout(0.2), nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.drop(torch.relu(self.l1(x))))


class Run:
    """A tiny training run whose every random source must come back on resume: dropout and input
    noise (torch RNG), a jitter (Python RNG), the sampler position (in `extra`), AdamW, LambdaLR."""

    def __init__(self, seed: int = 0, dim: int = 16):
        torch.manual_seed(seed)
        random.seed(seed)
        self.model = Tiny(dim)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.sched = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0 / (1 + s))
        self.state = {"train": TrainState(self.model, self.opt, self.sched)}
        self.extra: dict[str, Any] = {"sampler": {"index": 5}, "tokens_seen": 0}

    def step(self) -> float:
        g = torch.Generator().manual_seed(self.extra["sampler"]["index"])
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
        x = x + 0.1 * torch.randn_like(x) * (1 + random.random())
        self.extra["sampler"]["index"] += 3  # not derivable from the step: must come from extra
        self.extra["tokens_seen"] += 4
        loss = nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad()
        return loss.item()

    def params(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.model.parameters()]


def train(run_dir: Path, steps: int, saves: tuple[int, ...] = (), **kw: Any) -> tuple[Run, list[float]]:
    run, losses = Run(), []
    with CheckpointManager(run_dir, **kw) as mgr:
        for s in range(1, steps + 1):
            losses.append(run.step())
            if s in saves:
                mgr.save(s, run.state, run.extra)
    return run, losses


@pytest.mark.parametrize("async_mode", [False, True])
def test_resume_is_bit_identical(tmp_path, async_mode):
    ref, ref_losses = train(tmp_path / "ref", 8)
    train(tmp_path / "run", 4, saves=(2, 4), async_mode=async_mode)
    resumed = Run(seed=99)  # other init and RNG seeds: everything must come from the checkpoint
    with CheckpointManager(tmp_path / "run") as mgr:
        res = mgr.restore(resumed.state, resumed.extra)
    assert res is not None and res.step == 4 and not res.fell_back and res.rng_restored
    assert res.extra == {"sampler": {"index": 17}, "tokens_seen": 16} == resumed.extra
    losses = [resumed.step() for _ in range(4)]
    assert losses == ref_losses[4:]
    assert all(torch.equal(a, b) for a, b in zip(resumed.params(), ref.params()))
    assert resumed.sched.last_epoch == ref.sched.last_epoch == 8


@pytest.mark.parametrize("kind", ["script", "trainer"])
def test_a_save_before_the_first_step_is_bit_identical(tmp_path, kind):
    """DCP's get_optimizer_state_dict gives an empty optimizer a zero-gradient lr-0 step (torch's
    _init_optim_state): AdamW's step counter became 1, so both the run that saved at step 0 and a
    run resumed from that save took their first real step with the bias correction of step 2."""
    ref, ref_losses = train(tmp_path / "ref", 3)

    def state(r: Run) -> dict[str, Any]:  # the script API's TrainState, or the trainer's Statefuls
        return r.state if kind == "script" else train_state([r.model], [r.opt])

    run = Run()
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(0, state(run), run.extra)  # before any optimizer step
    assert not run.opt.state  # the live optimizer is left as it was
    assert [run.step() for _ in range(3)] == ref_losses
    resumed = Run(seed=99)
    with CheckpointManager(tmp_path / "run") as mgr:
        res = mgr.restore(state(resumed), resumed.extra)
    assert res is not None and res.step == 0
    assert all(float(st["step"]) == 0 for st in resumed.opt.state.values())  # a fresh optimizer's count
    assert [resumed.step() for _ in range(3)] == ref_losses
    assert all(torch.equal(a, b) for a, b in zip(resumed.params(), ref.params()))


def _two_saves(tmp_path: Path) -> tuple[Path, list[str], list[torch.Tensor]]:
    run_dir = tmp_path / "run"
    run, mgr = Run(), CheckpointManager(tmp_path / "run")
    for s in range(1, 5):
        run.step()
        if s in (2, 4):
            mgr.save(s, run.state, run.extra)
        if s == 2:
            at2 = run.params()
    mgr.close()
    return run_dir, [g.name for g in ck.list_generations(run_dir)], at2


def _restore(run_dir: Path, ledger: Ledger | None = None) -> tuple[Run, Any]:
    run = Run(seed=7)
    with CheckpointManager(run_dir, ledger=ledger) as mgr:
        return run, mgr.restore(run.state, run.extra)


def test_altered_shard_falls_back_loudly(tmp_path, caplog):
    run_dir, (g2, g4), at2 = _two_saves(tmp_path)
    shard = ck.generations_dir(run_dir) / g4 / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x40
    shard.write_bytes(bytes(data))
    ledger = Ledger()
    with caplog.at_level(logging.INFO):
        run, res = _restore(run_dir, ledger)
    assert res.generation == g2 and res.step == 2 and res.fell_back
    assert str(shard) in res.reason and "crc32" in res.reason
    assert "CHECKPOINT FALLBACK" in caplog.text and "REJECTED" in caplog.text
    assert ledger.names() == ["restore_rejected", "ckpt_fallback"] and ledger.events[1].rejected == [g4]
    rej = ledger.events[0]
    assert (rej.generation, rej.copy, rej.tensor) == (g4, "durable", "") and str(shard) in rej.reason
    assert all(torch.equal(a, b) for a, b in zip(run.params(), at2))
    assert run.extra["sampler"]["index"] == 11


def test_wrong_but_well_checksummed_tensor_is_rejected_by_the_fingerprint(tmp_path):
    """A tensor rewritten with other values, the manifest and the pointer rewritten to agree: every
    crc32 checks, and only the fingerprint (each rank's per-tensor crc32s, saved beside its RNG)
    tells; the restore falls back, names the tensor, and the generation is never tried again."""
    import io
    import pickle
    import zlib
    run_dir, (g2, g4), at2 = _two_saves(tmp_path)
    gen = ck.generations_dir(run_dir) / g4
    md = pickle.loads((gen / ".metadata").read_bytes())
    key, info = next((k, v) for k, v in md.storage_data.items() if k.fqn.endswith("weight"))
    shard = gen / info.relative_path
    raw = bytearray(shard.read_bytes())
    t = torch.load(io.BytesIO(bytes(raw[info.offset:info.offset + info.length])), weights_only=True)
    buf = io.BytesIO()
    torch.save(t + 1e-3, buf)
    assert len(buf.getvalue()) == info.length
    raw[info.offset:info.offset + info.length] = buf.getvalue()
    shard.write_bytes(bytes(raw))
    files = ck.read_manifest(gen)["files"]
    files[info.relative_path] = {"size": len(raw), "crc32": f"{zlib.crc32(bytes(raw)):08x}"}
    ck.write_manifest(gen, 4, files)
    ck.write_pointer(run_dir, g4, 4)
    assert ck.verify_generation(gen) == []  # every checksum agrees
    ledger = Ledger()
    run, res = _restore(run_dir, ledger)
    assert res.generation == g2 and res.fell_back and "fingerprint" in res.reason
    assert ledger.names() == ["restore_rejected", "ckpt_fallback"]
    assert ledger.events[0].tensor.endswith(key.fqn) and ledger.events[0].copy == "durable"
    assert all(torch.equal(a, b) for a, b in zip(run.params(), at2))
    assert not [g for g in ck.list_generations(run_dir) if g.name == g4 and g.committed]  # REJECTED.json


def test_restore_reads_each_shard_file_once(tmp_path):
    """The crc32 check is folded into the load: each shard is opened once and read once (before:
    a verify pass read every shard, then dcp.load read it again). Small items are read exactly
    once; large ones go straight into the tensor, and torch.load plus the running crc32 read
    their few kB of zip records twice (bounded below; a second read would double the bytes)."""
    run_dir = tmp_path / "run"
    run, big = Run(), nn.Linear(1024, 768)  # 3 MB weight: the direct path
    with CheckpointManager(run_dir) as mgr:
        run.step()
        mgr.save(1, {**run.state, "big": big}, run.extra)
    gen = ck.generations_dir(run_dir) / ck.read_pointer(run_dir).generation
    shards = {p.name: p.stat().st_size for p in gen.glob("*.distcp")}
    assert shards and sum(shards.values()) > 3 << 20
    fresh, big2 = Run(seed=7), nn.Linear(1024, 768)
    with ReadCounter(gen) as reads:
        with CheckpointManager(run_dir) as mgr:
            res = mgr.restore({**fresh.state, "big": big2}, fresh.extra)
    assert not res.fell_back and res.phases["load"] > 0
    assert {n: reads.opens[n] for n in shards} == {n: 1 for n in shards}
    for name, size in shards.items():
        assert size <= reads.bytes[name] <= size + 16 << 10, (name, size, reads.bytes[name])
    assert torch.equal(big2.weight, big.weight) and fresh.extra["sampler"]["index"] == 8

    _, (_, g4), _ = _two_saves(tmp_path / "small")  # only small items: every byte exactly once
    gen = ck.generations_dir(tmp_path / "small" / "run") / g4
    with ReadCounter(gen) as reads:
        _restore(gen.parent.parent)
    assert {n: reads.bytes[n] for n in shards} == {p.name: p.stat().st_size for p in gen.glob("*.distcp")}
    assert {n: reads.opens[n] for n in shards} == {n: 1 for n in shards}


def _item(gen: Path, fqn: str) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(gen).read_metadata()
    return next(v for k, v in md.storage_data.items() if k.fqn == fqn)


def test_bytes_no_load_reads_are_still_checked(tmp_path):
    """An item in a shard that the resumed state does not ask for (here: a tensor the new code
    dropped) is never read by dcp.load; it is read on its own for the file's crc32, so an altered
    byte there still rejects the generation."""
    run_dir = tmp_path / "run"
    run = Run()
    with CheckpointManager(run_dir) as mgr:
        for s in (1, 2):
            run.step()
            mgr.save(s, {**run.state, "aux": torch.arange(1000.0)}, run.extra)
    g1, g2 = [g.name for g in ck.list_generations(run_dir)]
    info = _item(ck.generations_dir(run_dir) / g2, "aux")
    shard = ck.generations_dir(run_dir) / g2 / info.relative_path
    fresh, res = _restore(run_dir)  # intact: the unread item is checked and the pointer stands
    assert res.generation == g2 and not res.fell_back
    data = bytearray(shard.read_bytes())
    data[info.offset + info.length - 8] ^= 0x01  # inside aux's float data
    shard.write_bytes(bytes(data))
    _, res = _restore(run_dir)
    assert res.generation == g1 and res.fell_back and f"{shard}: crc32" in res.reason


@pytest.mark.parametrize("where", ["data", "header", "tail"])
def test_altered_large_item_falls_back(tmp_path, where):
    """A large item is read straight into the tensor; a flipped bit in its data, in the zip
    records before it (torch may then fail to load it at all) or after it is still caught."""
    run_dir, run = tmp_path / "run", Run()
    with CheckpointManager(run_dir) as mgr:
        for s in (1, 2):
            run.step()
            mgr.save(s, {**run.state, "big": nn.Linear(1024, 768)}, run.extra)
    g1, g2 = [g.name for g in ck.list_generations(run_dir)]
    info = _item(ck.generations_dir(run_dir) / g2, "big.weight")
    assert info.length > 3 << 20
    shard = ck.generations_dir(run_dir) / g2 / info.relative_path
    at = {"data": info.offset + info.length // 2, "header": info.offset + 40,
          "tail": info.offset + info.length - 30}[where]
    data = bytearray(shard.read_bytes())
    data[at] ^= 0x04
    shard.write_bytes(bytes(data))
    with CheckpointManager(run_dir) as mgr:
        res = mgr.restore({**Run(seed=3).state, "big": nn.Linear(1024, 768)})
    assert res.generation == g1 and res.fell_back and f"{shard}: crc32" in res.reason


def test_size_mode_loads_without_crc_and_rejects_truncation(tmp_path):
    """verify_on_restore="size": no crc32 at all, plain DCP reads (which read some bytes twice:
    torch.load seeks back to zip records inside each item, 71 kB read of a 53 kB shard here)."""
    run_dir, (g2, g4), _ = _two_saves(tmp_path)
    shard = ck.generations_dir(run_dir) / g4 / "__0_0.distcp"
    with ReadCounter(shard.parent) as reads:
        with CheckpointManager(run_dir, verify_on_restore="size") as mgr:
            assert mgr.restore(Run(seed=7).state).generation == g4
    assert reads.opens[shard.name] == 1 and reads.bytes[shard.name] >= shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[:-10])
    with CheckpointManager(run_dir, verify_on_restore="size") as mgr:
        res = mgr.restore(Run(seed=7).state)
    assert res.generation == g2 and res.fell_back and "truncated" in res.reason


def test_pointer_to_missing_generation_falls_back(tmp_path):
    run_dir, (g2, g4), _ = _two_saves(tmp_path)
    ck.remove_generation(run_dir, g4)
    _, res = _restore(run_dir)
    assert res.generation == g2 and res.fell_back and "directory missing" in res.reason


def test_garbage_pointer_falls_back_to_newest_verified(tmp_path):
    run_dir, (_, g4), _ = _two_saves(tmp_path)
    (run_dir / ck.POINTER).write_bytes(b"\x00" * 7)
    _, res = _restore(run_dir)
    assert res.generation == g4 and res.fell_back and "garbage pointer" in res.reason


def test_empty_run_dir_is_a_logged_fresh_start(tmp_path, caplog):
    ledger = Ledger()
    with caplog.at_level(logging.INFO):
        run, res = _restore(tmp_path / "new", ledger)
    assert res is None and ledger.names() == ["ckpt_fresh_start"] and "fresh start" in caplog.text
    assert run.extra["sampler"]["index"] == 5


def _disk_full(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shard write starts, leaves a partial file, then the disk is full."""
    def write_data(self, plan, planner):
        (Path(self.path) / f"{plan.storage_data.prefix}0.distcp").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(dcp_fs._FileSystemWriter, "write_data", write_data)


@pytest.mark.parametrize("async_mode", [False, True])
def test_full_disk_keeps_pointer_and_continues(tmp_path, monkeypatch, async_mode, caplog):
    run, ledger = Run(), Ledger()
    with CheckpointManager(tmp_path, async_mode=async_mode, ledger=ledger) as mgr:
        run.step()
        mgr.save(1, run.state, run.extra)
        mgr.wait()
        good = ck.read_pointer(tmp_path).generation
        with monkeypatch.context() as m:
            _disk_full(m)
            run.step()
            with caplog.at_level(logging.ERROR):
                mgr.save(2, run.state, run.extra)
                mgr.wait()
        assert not mgr.last_outcome.ok and "No space left on device" in mgr.last_outcome.reason
        assert "FAILED, pointer unchanged" in caplog.text
        assert ck.read_pointer(tmp_path).generation == good
        assert [g.name for g in ck.list_generations(tmp_path)] == [good]  # failed one removed
        run.step()
        assert mgr.save(3, run.state, run.extra) is True  # training went on; the disk has room again
    assert ck.read_pointer(tmp_path).step == 3
    assert ledger.names() == ["ckpt_save", "ckpt_save_failed", "ckpt_save"]


@pytest.mark.parametrize("async_mode", [False, True])
def test_full_disk_stops_when_asked(tmp_path, monkeypatch, async_mode):
    run = Run()
    mgr = CheckpointManager(tmp_path, async_mode=async_mode, on_error="stop")
    _disk_full(monkeypatch)
    with pytest.raises(ck.CheckpointError, match="No space left on device"):
        mgr.save(1, run.state, run.extra)
        mgr.wait()  # async: the failure surfaces at the next collective point
    assert ck.read_pointer(tmp_path) is None
    mgr.close()


@pytest.fixture
def tiny_fs(tmp_path):
    """A real 1 MB tmpfs (needs root: skipped for another user, a failure for root): the disk really fills."""
    import subprocess

    mnt = tmp_path / "tiny"
    mount_tmpfs(mnt, "1m")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_really_full_disk_is_named_whatever_the_writer_reports(tiny_fs):
    """A short write can surface as torch's "unexpected pos" instead of ENOSPC; the reason must
    still say the disk is full, from the file system's own free space, and name it."""
    run = Run(dim=8192)  # ~0.9 MB of parameters + 2x AdamW state: more than the 1 MB disk
    run.step()
    with CheckpointManager(tiny_fs / "run", on_error="continue") as mgr:
        assert mgr.save(1, run.state, run.extra) is False
        reason = mgr.last_outcome.reason
    assert "No space left on device" in reason and str(tiny_fs) in reason, reason
    assert ck.read_pointer(tiny_fs / "run") is None and ck.list_generations(tiny_fs / "run") == []
    assert ck.disk_full_fact(tiny_fs / "run") == ""  # the failed generation's space was freed


def test_a_disk_with_room_is_not_called_full(tmp_path):
    assert ck.disk_full_fact(tmp_path / "not" / "yet" / "made") == ""


def _slow_writes(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    import time
    original = dcp_fs._FileSystemWriter.write_data

    def write_data(self, plan, planner):
        time.sleep(seconds)
        return original(self, plan, planner)
    monkeypatch.setattr(dcp_fs._FileSystemWriter, "write_data", write_data)


def test_inflight_skip_wait_and_blocking(tmp_path, monkeypatch, caplog):
    _slow_writes(monkeypatch, 0.4)
    run, ledger = Run(), Ledger()
    with CheckpointManager(tmp_path, async_mode=True, on_inflight="skip", ledger=ledger) as mgr:
        assert mgr.save(1, run.state, run.extra) is True
        with caplog.at_level(logging.INFO):
            assert mgr.save(2, run.state, run.extra) is False  # skipped, logged
            assert mgr.save(3, run.state, run.extra, blocking=True) is True  # signal saves wait
        assert "save skipped" in caplog.text and "waiting for the in-flight save" in caplog.text
    assert ledger.names() == ["ckpt_save_skipped", "ckpt_save", "ckpt_save"]
    assert ck.read_pointer(tmp_path).step == 3
    assert [g.step for g in ck.list_generations(tmp_path)] == [1, 3]


def test_async_stall_is_only_the_host_copy(tmp_path, monkeypatch):
    _slow_writes(monkeypatch, 0.5)
    run = Run()
    with CheckpointManager(tmp_path, async_mode=True) as mgr:
        mgr.save(1, run.state, run.extra)
        assert ck.read_pointer(tmp_path) is None  # not committed while the write is in flight
        mgr.wait()
        out = mgr.last_outcome
    assert out.ok and out.stall_s < 0.2 < 0.5 < out.total_s


def test_changed_model_shape_is_refused_naming_fields(tmp_path):
    train(tmp_path, 1, saves=(1,), model_shape={"dim": 16, "layers": 2})
    bigger = Run(dim=32)
    with CheckpointManager(tmp_path, model_shape={"dim": 32, "layers": 2}) as mgr:
        with pytest.raises(ck.CheckpointError, match="dim: 16 -> 32"):
            mgr.restore(bigger.state)
    with CheckpointManager(tmp_path) as mgr:  # no shape fields: the tensor shapes still tell
        with pytest.raises(ck.CheckpointError, match=r"train\.model\.l1\.weight: \(16, 8\) -> \(32, 8\)"):
            mgr.restore(bigger.state)


def test_changed_config_hash_alone_is_refused_then_allowed_with_shape_fields(tmp_path, caplog):
    train(tmp_path, 1, saves=(1,), config_hash="aaa", model_shape=None)
    with CheckpointManager(tmp_path, config_hash="bbb") as mgr:
        with pytest.raises(ck.CheckpointError, match="config_hash: aaa -> bbb"):
            mgr.restore(Run().state)
    train(tmp_path, 1, saves=(1,), config_hash="aaa", model_shape={"dim": 16})
    with CheckpointManager(tmp_path, config_hash="bbb", model_shape={"dim": 16}) as mgr:
        with caplog.at_level(logging.WARNING):
            assert mgr.restore(Run().state).step == 1
    assert "config hash aaa -> bbb (model shape unchanged)" in caplog.text


def test_second_manager_on_the_same_run_is_refused(tmp_path):
    with CheckpointManager(tmp_path):
        with pytest.raises(ck.RunLocked, match="run is being written by"):
            CheckpointManager(tmp_path)
    CheckpointManager(tmp_path).close()  # released on close
