"""The checkpoint's fast paths are feature-detected (dslurm/checkpoint/compat.py, issue 34): on the
torch under test they are on, and with them forced off (DSLURM_DCP_PUBLIC=1: what a torch without
those DCP internals gets) a save and a restore go DCP's public way and still restore bit for bit,
with every byte checked. The suite runs this file under both torches (scripts/test.sh). One process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dslurm import checkpoint as ck
from dslurm.checkpoint import compat
from dslurm.checkpoint import io as cio
from dslurm.checkpoint.dcp import CheckpointManager, TrainState

pytestmark = pytest.mark.integration


def _state(seed: int) -> tuple[dict[str, Any], nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(512, 768), nn.ReLU(), nn.Linear(768, 64))  # weights > 1 MiB: the big-item path
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    return {"train": TrainState(model, opt)}, model, opt


def _flat(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"m.{k}": v for k, v in model.state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        out.update({f"o.{i}.{k}": v for k, v in st.items() if isinstance(v, torch.Tensor)})
    return out


def _reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Which reader paths ran: our read_data's, and DCP's own."""
    seen = {"fast": 0, "dcp": 0}
    fast, dcp_own = cio.CrcReader._read_item, cio.dcp.FileSystemReader.read_data

    def spy_fast(self: Any, *a: Any) -> Any:
        seen["fast"] += 1
        return fast(self, *a)

    def spy_dcp(self: Any, *a: Any) -> Any:
        seen["dcp"] += 1
        return dcp_own(self, *a)

    monkeypatch.setattr(cio.CrcReader, "_read_item", spy_fast)
    monkeypatch.setattr(cio.dcp.FileSystemReader, "read_data", spy_dcp)
    return seen


def test_the_fast_paths_are_on_under_the_torch_tested():
    writer, sums = cio.crc_writer(Path("/nonexistent"), 1)
    assert compat.writer_streams(writer) and isinstance(writer.fs, cio.CrcFileSystem) and sums == {}
    assert compat._torch_narrow() is not None  # this torch still has it; the copy is the fallback


@pytest.mark.parametrize("public", [False, True], ids=["fast", "public-dcp"])
def test_save_and_restore_bit_for_bit_whichever_path(tmp_path, monkeypatch, public):
    if public:
        monkeypatch.setenv(compat.PUBLIC_ENV, "1")
    read_back: list[str] = []
    real = ck.checksum_files
    monkeypatch.setattr(ck, "checksum_files", lambda gen, names: read_back.extend(names) or real(gen, names))
    state, model, opt = _state(0)
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(3, state, {"k": 1}, blocking=True)
    assert mgr.last_outcome is not None and mgr.last_outcome.ok
    # the shards' crc32s: streamed while DCP wrote them, or (public) read back after the save
    assert any(n.endswith(".distcp") for n in read_back) == public
    seen = _reads(monkeypatch)
    fresh, fmodel, fopt = _state(1)
    extra: dict[str, Any] = {}
    with CheckpointManager(tmp_path / "run") as mgr:
        res = mgr.restore(fresh, extra)
    assert res is not None and not res.fell_back and res.step == 3 and extra == {"k": 1}
    want, got = _flat(model, opt), _flat(fmodel, fopt)
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert (seen["fast"] == 0 and seen["dcp"] > 0) if public else (seen["fast"] > 0 and seen["dcp"] == 0)


def test_a_flipped_byte_is_still_caught_on_the_public_path(tmp_path, monkeypatch):
    monkeypatch.setenv(compat.PUBLIC_ENV, "1")
    state, model, opt = _state(0)
    with CheckpointManager(tmp_path / "run") as mgr:
        mgr.save(1, state, {}, blocking=True)
        with torch.no_grad():
            model[0].weight.add_(1.0)
        mgr.save(2, state, {}, blocking=True)
    gen = ck.generations_dir(tmp_path / "run") / ck.read_pointer(tmp_path / "run").generation
    shard = next(gen.glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(bytes(data))
    fresh, _, _ = _state(1)
    with CheckpointManager(tmp_path / "run") as mgr:
        res = mgr.restore(fresh, {})
    assert res is not None and res.fell_back and res.step == 1 and f"{shard}: crc32" in res.reason


def test_the_narrow_copy_equals_torchs():
    t = torch.arange(60.0).reshape(3, 4, 5)
    for offsets, sizes in (((0, 0, 0), (3, 4, 5)), ((1, 2, 0), (2, 2, 5)), ((2, 0, 3), (1, 4, 2))):
        assert torch.equal(compat._narrow(t, offsets, sizes), compat._torch_narrow()(t, offsets, sizes))
