"""The fast paths of a save and a restore keep every guarantee (docs/checkpoint.md, "Benchmark"):
the finiteness check by a sum, run beside the shard write; torch's zip crc32 off while dslurm's
streams cover every byte; old generations' bytes deleted off the save's path; tensors read
straight into the model, and everything else still the checked way. One process."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dslurm import checkpoint as ck
from dslurm.checkpoint import dcp as cdcp
from dslurm.checkpoint import generation
from dslurm.checkpoint import io as cio
from dslurm.checkpoint.dcp import CheckpointManager

pytestmark = pytest.mark.integration


def _gen(run_dir: Path) -> Path:
    ptr = ck.read_pointer(run_dir)
    assert ptr is not None
    return ck.generations_dir(run_dir) / ptr.generation


def _save(run_dir: Path, step: int, state: dict[str, Any], **kw: Any) -> cdcp.SaveOutcome:
    with CheckpointManager(run_dir, **kw) as mgr:
        mgr.save(step, state, {}, blocking=True)
    assert mgr.last_outcome is not None
    return mgr.last_outcome


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_all_finite_by_sum_agrees_with_isfinite(dtype):
    big = torch.finfo(dtype).max
    cases = [torch.ones(1000, dtype=dtype), torch.full((1000,), big, dtype=dtype),  # the sum overflows
             torch.tensor([big, -big, 1.0], dtype=dtype)]
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.zeros(1000, dtype=dtype)
        t[617] = bad
        cases.append(t)
    cases.append(torch.tensor([float("inf"), -float("inf")], dtype=dtype))  # sums to NaN, not inf
    for t in cases:
        assert generation.all_finite(t) == bool(torch.isfinite(t).all()), t


def test_non_finite_state_is_never_committed(tmp_path):
    """The check runs beside the shard write now: a NaN still fails the save on its way, the
    written generation is removed and the pointer keeps the previous one."""
    run_dir, model = tmp_path / "run", nn.Linear(64, 64)
    assert _save(run_dir, 1, {"model": model}).ok
    good = _gen(run_dir).name
    with torch.no_grad():
        model.weight[3, 5] = float("nan")
    out = _save(run_dir, 2, {"model": model})
    assert not out.ok and "non-finite" in out.reason and "model.weight" in out.reason
    assert _gen(run_dir).name == good
    assert [g.name for g in ck.list_generations(run_dir)] == [good]
    with torch.no_grad():  # finite but huge: the sum overflows, the exact check lets it through
        model.weight.fill_(3e38)
    assert _save(run_dir, 3, {"model": model}).ok


def test_a_failed_rank_file_fails_the_save(tmp_path, monkeypatch):
    """The rank file is written beside the shards: its failure still fails the save, before
    anything commits."""
    run_dir = tmp_path / "run"
    assert _save(run_dir, 1, {"model": nn.Linear(8, 8)}).ok
    real = ck.atomic_write_json

    def failing(path: Path, obj: Any) -> None:
        if path.parent.name == ck.RANKS:
            raise OSError(28, "No space left on device")
        real(path, obj)

    monkeypatch.setattr(ck, "atomic_write_json", failing)
    out = _save(run_dir, 2, {"model": nn.Linear(8, 8)})
    assert not out.ok and "No space left" in out.reason
    assert ck.read_pointer(run_dir).step == 1 and len(ck.list_generations(run_dir)) == 1


@pytest.mark.parametrize("io_threads", [1, 3])
def test_streamed_sums_equal_the_files_and_zip_crc_setting_is_restored(tmp_path, io_threads):
    """Sums taken on a helper thread while the kernel copies (several files at once with
    io_threads) equal a re-read of every file; torch's own zip crc32 setting is back as it was."""
    state = {"model": nn.Sequential(*[nn.Linear(512, 1024) for _ in range(4)])}  # 2 MB weights
    for before in (True, False):
        torch.serialization.set_crc32_options(before)
        try:
            run_dir = tmp_path / f"run-{before}"
            assert _save(run_dir, 1, state, io_threads=io_threads).ok
            assert torch.serialization.get_crc32_options() is before
        finally:
            torch.serialization.set_crc32_options(True)
        gen = _gen(run_dir)
        assert ck.verify_generation(gen, full=True) == []
        files = ck.read_manifest(gen)["files"]
        assert sum(1 for n in files if n.endswith(".distcp")) == io_threads
        for rel, want in files.items():
            assert ck.file_crc32(gen / rel) == (want["size"], want["crc32"]), rel


def test_large_writes_go_in_pieces_with_writeback_started(tmp_path, monkeypatch):
    """A tensor's bytes are written in pieces, each piece's writeback started as soon as it is in
    the page cache (io.write_ahead): the ranges asked for tile every large record exactly, at the
    offsets the file really has, and the file (fsync'd as before) reads back bit for bit. Were
    the offsets wrong, the head start would go to the wrong pages and this would show it."""
    assert cio._SYNC_FILE_RANGE is not None  # Linux/glibc here: the head start is really taken
    asked: list[tuple[int, int]] = []
    real = cio.write_ahead

    def spy(fd: int, offset: int, length: int) -> None:
        asked.append((offset, length))
        real(fd, offset, length)

    monkeypatch.setattr(cio, "write_ahead", spy)
    weight = torch.randn(5 * (cio._PIECE // 4) + 12345)  # five pieces and a bit: 20 MiB + 48 kB
    run_dir = tmp_path / "run"
    assert _save(run_dir, 1, {"model": {"w": weight, "b": torch.randn(7)}}).ok
    shard = next(p for p in _gen(run_dir).iterdir() if p.name.endswith(".distcp"))
    data = shard.read_bytes()
    assert [n for _, n in asked] == [cio._PIECE] * 5 + [weight.nbytes - 5 * cio._PIECE]
    start = asked[0][0]
    assert all(a + n == b for (a, n), (b, _) in zip(asked, asked[1:]))  # contiguous, in order
    assert data[start:start + weight.nbytes] == weight.numpy().tobytes()  # the offsets are the file's
    assert ck.verify_generation(_gen(run_dir), full=True) == []


@pytest.mark.parametrize("async_mode", [False, True])
def test_old_generations_leave_at_once_and_no_trash_survives_close(tmp_path, async_mode):
    run_dir, model = tmp_path / "run", nn.Linear(256, 256)
    with CheckpointManager(run_dir, keep=2, async_mode=async_mode) as mgr:
        for step in (1, 2, 3, 4):
            assert mgr.save(step, {"model": model}, {}, blocking=True)
            assert [g.step for g in ck.list_generations(run_dir)] == [max(1, step - 1), step][-min(step, 2):]
    # no polling: close() joined the reaper (the trainer's os._exit right after would kill it)
    assert not any(ck.generations_dir(run_dir).glob(f"{ck.TRASH}*"))
    assert sorted(p.name for p in ck.generations_dir(run_dir).iterdir()) == \
        [g.name for g in ck.list_generations(run_dir)]


def _killed_process_trash(run_dir: Path) -> Path:
    """What a process killed mid-delete (or before its reaper ran) leaves: a renamed generation."""
    trash = ck.generations_dir(run_dir) / f"{ck.TRASH}step-00000001-dead.beef"
    (trash / ck.RANKS).mkdir(parents=True)
    (trash / "__0_0.distcp").write_bytes(b"\0" * 4096)
    return trash


def test_trash_a_killed_process_left_is_gone_after_the_next_manager(tmp_path):
    run_dir = tmp_path / "run"
    _save(run_dir, 1, {"model": nn.Linear(4, 4)})
    trash = _killed_process_trash(run_dir)
    with CheckpointManager(run_dir):
        pass  # no save: opening the run is enough
    assert not trash.exists()
    assert [g.step for g in ck.list_generations(run_dir)] == [1]


def test_a_save_commits_while_old_trash_is_still_there(tmp_path, monkeypatch):
    run_dir, model = tmp_path / "run", nn.Linear(4, 4)
    trash = _killed_process_trash(run_dir)
    gate, real = threading.Event(), ck.empty_trash

    def slow_empty_trash(d: Any) -> None:
        assert gate.wait(30)
        real(d)

    monkeypatch.setattr(ck, "empty_trash", slow_empty_trash)
    mgr = CheckpointManager(run_dir, keep=2)
    try:
        for step in (1, 2, 3):
            assert mgr.save(step, {"model": model}, {}, blocking=True)
        assert trash.exists()  # the reaper is still held: the saves did not wait for it
        assert ck.read_pointer(run_dir).step == 3  # type: ignore[union-attr]
    finally:
        gate.set()
        mgr.close()
    assert not any(ck.generations_dir(run_dir).glob(f"{ck.TRASH}*"))
    assert [g.step for g in ck.list_generations(run_dir)] == [2, 3]


def test_two_tier_trash_is_emptied_on_both_tiers(tmp_path):
    from dslurm.checkpoint import tiers
    run_dir, scratch = tmp_path / "run", str(tmp_path / "scratch" / "%n")
    local = tiers.local_run_dir(tiers.expand_scratch(scratch, tiers.node_name()), run_dir)
    durable_trash, local_trash = _killed_process_trash(run_dir), _killed_process_trash(local)
    model = nn.Linear(64, 64)
    with CheckpointManager(run_dir, keep=2, scratch=scratch, keep_local=1) as mgr:
        for step in (1, 2, 3):
            assert mgr.save(step, {"model": model}, {}, blocking=True)
    for d in (run_dir, local):
        assert not any(ck.generations_dir(d).glob(f"{ck.TRASH}*")), d
    assert not durable_trash.exists() and not local_trash.exists()
    assert [g.step for g in ck.list_generations(run_dir)] == [2, 3]


def _restore(run_dir: Path, state: dict[str, Any]) -> cdcp.RestoreResult:
    with CheckpointManager(run_dir) as mgr:
        res = mgr.restore(state)
    assert res is not None
    return res


def _count_checked_way(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Large tensor items served DCP's way (torch.load into a new storage, then copy_)."""
    served: list[int] = []
    real = cio.CrcReader._serve

    def spy(self: cio.CrcReader, stream: Any, req: Any, planner: Any, sinfo: Any) -> None:
        if sinfo.length >= cio._BIG:
            served.append(sinfo.length)
        real(self, stream, req, planner, sinfo)

    monkeypatch.setattr(cio.CrcReader, "_serve", spy)
    return served


def test_restore_reads_large_tensors_into_the_model_itself(tmp_path, monkeypatch):
    run_dir, model = tmp_path / "run", nn.Linear(1024, 768)
    assert _save(run_dir, 1, {"model": model}).ok
    fresh = nn.Linear(1024, 768)
    where = fresh.weight.data_ptr()
    served = _count_checked_way(monkeypatch)
    res = _restore(run_dir, {"model": fresh})
    assert not res.fell_back and served == []
    assert fresh.weight.data_ptr() == where and torch.equal(fresh.weight, model.weight)
    assert torch.equal(fresh.bias, model.bias)


def test_restore_into_another_dtype_or_a_strided_tensor_is_exact(tmp_path, monkeypatch):
    """Another dtype, or a destination that is not one contiguous block: the bytes go through a
    host tensor (still read once, summed), then copy_ converts or scatters them."""
    run_dir, model = tmp_path / "run", nn.Linear(1024, 768)
    assert _save(run_dir, 1, {"model": model}).ok
    served = _count_checked_way(monkeypatch)
    half = nn.Linear(1024, 768).to(torch.bfloat16)
    assert not _restore(run_dir, {"model": half}).fell_back
    assert torch.equal(half.weight, model.weight.detach().to(torch.bfloat16))
    strided = torch.empty(1024, 768).t()  # (768, 1024) with transposed strides
    assert not _restore(run_dir, {"model": {"weight": strided, "bias": torch.empty(768)}}).fell_back
    assert torch.equal(strided, model.weight.detach())
    assert served == []


def test_a_stored_strided_tensor_goes_the_checked_way(tmp_path, monkeypatch):
    """DCP saves a transposed view whole (its storage is all of it), strides and all: not one
    block in the destination's order, so it is loaded DCP's way, through the same checked view."""
    run_dir = tmp_path / "run"
    base = torch.randn(1024, 768)
    assert _save(run_dir, 1, {"w": base.t()}).ok
    served = _count_checked_way(monkeypatch)
    out = torch.empty(768, 1024)
    assert not _restore(run_dir, {"w": out}).fell_back
    assert torch.equal(out, base.t()) and len(served) == 1


def test_flipped_byte_after_a_stop_save_is_caught_on_restore(tmp_path):
    """The stop save no longer re-reads anything: a byte altered on the medium after it is caught
    by the restore's sums over what it reads into the model, and the previous generation loads."""
    run_dir, model = tmp_path / "run", nn.Linear(1024, 768)
    assert _save(run_dir, 1, {"model": model}).ok
    first = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.weight.add_(1.0)
    assert _save(run_dir, 2, {"model": model}).ok
    shard = next(_gen(run_dir).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    fresh = nn.Linear(1024, 768)
    res = _restore(run_dir, {"model": fresh})
    assert res.fell_back and res.step == 1 and f"{shard}: crc32" in res.reason
    assert all(torch.equal(v, first[k]) for k, v in fresh.state_dict().items())


def test_zip_crc_setting_is_per_thread_and_restored():
    """Off only in the thread whose stream is open (torch keeps it per thread), back after."""
    torch.serialization.set_crc32_options(True)
    inside, release, seen = threading.Event(), threading.Event(), []

    def hold() -> None:
        with cio._no_zip_crc32():
            seen.append(torch.serialization.get_crc32_options())
            inside.set()
            release.wait(5)

    t = threading.Thread(target=hold)
    t.start()
    assert inside.wait(5)
    assert torch.serialization.get_crc32_options() is True  # this thread's torch.save unaffected
    release.set()
    t.join()
    assert seen == [False]
    with cio._no_zip_crc32():
        assert torch.serialization.get_crc32_options() is False
    assert torch.serialization.get_crc32_options() is True
