"""No checkpoint runs code: a hostile pickle in a generation whose manifest agrees (crc32 and size
recomputed, the pointer moved onto it) is refused unrun by `ckpt verify`, `ckpt export`, the
restore and the per-rank state, naming the file and the class (dslurm/checkpoint/unpickle.py)."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import pickle
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from dslurm import checkpoint as ck
from dslurm.checkpoint import unpickle
from dslurm.checkpoint.dcp import CheckpointManager
from dslurm.checkpoint.per_rank import entry_for, restore
from dslurm.config.models import PRESETS
from dslurm.errors import UserError
from dslurm.observe.forensics import read_dumps
from dslurm.runtime.state import train_state
from testkit import ROOT, run_cli
from train.model import build_model

TINY = dataclasses.replace(PRESETS["tiny"], n_layers=1, dim=32, n_heads=2, n_kv_heads=2, vocab_size=64)


class Hostile:
    """What an attacker writes: unpickling it runs `touch MARKER` (os.system pickles as posix.system)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (os.system, (f"touch {self.marker}",))


def _reseal(gen: Path, run_dir: Path) -> None:
    """Make the manifest and the pointer agree with whatever the generation now holds."""
    files = [str(p.relative_to(gen)) for p in gen.rglob("*") if p.is_file() and p.name != ck.MANIFEST]
    ck.write_manifest(gen, ck.parse_step(gen.name) or 0, ck.checksum_files(gen, files))
    ck.write_pointer(run_dir, gen.name, ck.parse_step(gen.name) or 0)


def _model_and_state():
    model = build_model(TINY, 0)
    return model, train_state([model], [torch.optim.AdamW(model.parameters(), lr=1e-2)])


@pytest.fixture
def run(tmp_path) -> tuple[Path, Path]:
    run_dir = tmp_path / "run"
    model, state = _model_and_state()
    with CheckpointManager(run_dir, model_shape=dataclasses.asdict(TINY)) as mgr:
        assert mgr.save(1, state)
    ptr = ck.read_pointer(run_dir)
    assert ptr is not None
    return run_dir, ck.generations_dir(run_dir) / ptr.generation


def test_a_genuine_metadata_passes_the_gate_and_loads_as_dcps_own(run):
    _, gen = run
    assert unpickle.check_file(gen / ".metadata") is None
    md = unpickle.load_file(gen / ".metadata")
    assert type(md).__name__ == "Metadata" and md.state_dict_metadata
    # The check itself needs no torch (ckpt verify answers without it).
    probe = ("import sys; from pathlib import Path; from dslurm.checkpoint import unpickle; "
             f"assert unpickle.check_file(Path({str(gen / '.metadata')!r})) is None; "
             "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", probe], check=True, cwd=ROOT)


def test_a_hostile_metadata_runs_nothing_on_verify_export_ls_or_restore(run, tmp_path):
    run_dir, gen = run
    marker = tmp_path / "ran"
    (gen / ".metadata").write_bytes(pickle.dumps(Hostile(marker)))
    _reseal(gen, run_dir)
    for args in (["ckpt", "verify", str(run_dir)],
                 ["ckpt", "export", str(run_dir), "--format", "torch", "-o", str(tmp_path / "out")]):
        r = run_cli(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr
        assert str(gen / ".metadata") in r.stderr and "posix.system" in r.stderr and "fix:" in r.stderr
    r = run_cli("ckpt", "ls", str(run_dir))
    assert "BAD" in r.stdout and "posix.system" in r.stderr
    assert not (tmp_path / "out").exists()
    model, state = _model_and_state()
    with CheckpointManager(run_dir) as mgr, pytest.raises(ck.CheckpointError, match="posix.system"):
        mgr.restore(state)  # its only generation is refused: no sound one to fall back to
    assert not marker.exists(), "the hostile pickle ran"


def test_a_hostile_value_inside_a_shard_is_refused_on_restore(run, tmp_path):
    """DCP loads a saved non-tensor value with weights_only=False; dslurm's planner does not."""
    run_dir, _ = run
    marker = tmp_path / "ran"
    model, state = _model_and_state()
    with CheckpointManager(run_dir) as mgr:  # pickling it runs nothing; DCP stores it as a byte item
        assert mgr.save(2, {**state, "evil": Hostile(marker)})
    with CheckpointManager(run_dir) as mgr, pytest.raises(ck.CheckpointError, match="posix.system"):
        mgr.restore({**state, "evil": 0})
    assert not marker.exists(), "the hostile pickle ran"


def test_a_corrupt_metadata_is_refused_by_export_with_exit_2(run, tmp_path):
    run_dir, gen = run
    (gen / ".metadata").write_bytes(b"\x80\x04garbage, not a pickle")
    _reseal(gen, run_dir)
    r = run_cli("ckpt", "export", str(run_dir), "--format", "torch", "-o", str(tmp_path / "out"))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert str(gen / ".metadata") in r.stderr and "not a readable DCP metadata pickle" in r.stderr
    assert "--generation" in r.stderr
    (gen / ".metadata").write_bytes(pickle.dumps({"a": 1}))  # a pickle, but not DCP's metadata
    _reseal(gen, run_dir)
    r = run_cli("ckpt", "export", str(run_dir), "--format", "torch", "-o", str(tmp_path / "out"))
    assert r.returncode == 2 and "Traceback" not in r.stderr and "not DCP metadata" in r.stderr, r.stderr


def test_hostile_per_rank_state_is_refused_naming_the_rank_file_and_class(tmp_path):
    marker = tmp_path / "ran"
    buf = io.BytesIO()
    torch.save({"pos": Hostile(marker)}, buf)
    raw = buf.getvalue()
    gen = tmp_path / "gen"
    (gen / ck.RANKS).mkdir(parents=True)
    rec = {"b64": base64.b64encode(raw).decode(), "crc": f"{zlib.crc32(raw):08x}"}
    (gen / ck.RANKS / "rank-00000.json").write_text(json.dumps({"rank": 0, "state": {"pos": rec}}))
    with pytest.raises(UserError) as err:
        restore([entry_for("pos", {"batch": 0})], gen, 1, 0, 1)
    assert "rank-00000.json (pos)" in str(err.value) and "posix.system" in str(err.value)
    assert "add_safe_globals" in str(err.value)
    assert not marker.exists()


def test_a_flight_recorder_dump_naming_a_class_is_skipped_unrun(tmp_path):
    marker = tmp_path / "ran"
    (tmp_path / "fr").mkdir()
    (tmp_path / "fr" / "rank-00000").write_bytes(pickle.dumps({"entries": [Hostile(marker)]}))
    assert read_dumps(tmp_path) == {}
    assert not marker.exists()


def test_init_from_reads_no_pickle_a_torch_weights_file_is_refused_unread(tmp_path):
    """model.init_from takes safetensors only (its header is JSON, its data raw bytes)."""
    from dslurm.checkpoint.init_from import open_dir

    marker = tmp_path / "ran"
    torch.save({"w": Hostile(marker)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(UserError, match="pytorch_model.bin: re-export with `dslurm ckpt export --format safetensors`"):
        open_dir(tmp_path)
    assert not marker.exists()


def test_the_chaos_selftest_reads_final_parameters_through_the_gate(run, tmp_path):
    from types import SimpleNamespace

    from dslurm.selftest.chaos.jobs import final_params

    run_dir, gen = run
    want = build_model(TINY, 0).state_dict()  # the fixture saved this model untrained
    got = final_params(SimpleNamespace(mode="builtin"), run_dir, None, tmp_path)  # type: ignore[arg-type]
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    marker = tmp_path / "ran"
    (gen / ".metadata").write_bytes(pickle.dumps(Hostile(marker)))
    with pytest.raises(unpickle.UnsafePickle, match="posix.system"):
        final_params(SimpleNamespace(mode="builtin"), run_dir, None, tmp_path)  # type: ignore[arg-type]
    assert not marker.exists()
