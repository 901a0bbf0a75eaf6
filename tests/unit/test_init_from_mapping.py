"""`model.init_from`, the pure parts: HF names back to the built-in ones, the q/k row order undone
for any row range a shard holds, the config.json check and the refusals of a bad directory.
The whole load under FSDP x TP and PP: tests/integration/test_init_from.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dslurm.checkpoint import hf_layout
from dslurm.checkpoint import init_from as inf
from dslurm.config import families
from dslurm.config.models import PRESETS, ModelShape
from dslurm.errors import UserError

TINY = PRESETS["tiny"]  # dim 64, 4 heads of 16, 2 kv heads


def test_builtin_name_is_the_inverse_of_hf_name():
    for name in hf_layout.expected_names(TINY):
        assert hf_layout.builtin_name(hf_layout.hf_name(name)) == name
    with pytest.raises(ValueError, match="rotary_emb"):
        hf_layout.builtin_name("model.layers.0.self_attn.rotary_emb.inv_freq")


def test_from_half_split_undoes_to_half_split():
    w = torch.arange(32 * 3, dtype=torch.float32).view(32, 3)
    assert torch.equal(hf_layout.from_half_split(hf_layout.to_half_split(w, 2), 2), w)
    assert not torch.equal(hf_layout.to_half_split(w, 2), w)


def test_head_span_covers_partial_heads():
    assert hf_layout.head_span(0, 16, 16) == (0, 1)
    assert hf_layout.head_span(8, 24, 16) == (0, 2)  # half a head on each side: both heads read
    assert hf_layout.head_span(16, 17, 16) == (1, 2)


def _write(tmp: Path, tensors: dict[str, torch.Tensor], name: str = "model.safetensors") -> dict[str, inf.Entry]:
    save_file(tensors, str(tmp / name))
    return inf.read_header(tmp / name)


@pytest.mark.parametrize("rows", [(0, 32), (0, 8), (8, 16), (12, 28), (24, 32)])
@pytest.mark.parametrize("cols", [(0, 64), (32, 64), (5, 9)])
def test_a_shard_of_q_rows_reads_the_interleaved_rows_of_its_box(tmp_path, rows, cols):
    """Any box (FSDP x TP shards cut heads anywhere) equals the box of the fully converted tensor."""
    builtin = torch.randn(32, 64)  # 2 heads of 16 rows in the trainer's interleaved order
    e = _write(tmp_path, {"k": hf_layout.to_half_split(builtin, 2)})["k"]
    box = (rows[1] - rows[0], cols[1] - cols[0])
    got = inf.read_local(e, (rows[0], cols[0]), box, heads=2)
    assert torch.equal(got, builtin[rows[0]:rows[1], cols[0]:cols[1]])


def test_column_shards_are_read_in_blocks(tmp_path, monkeypatch):
    monkeypatch.setattr(inf, "BLOCK_BYTES", 3 * 64 * 2)  # 3 bf16 rows per read: several blocks
    w = torch.randn(10, 64).to(torch.bfloat16)
    e = _write(tmp_path, {"w": w})["w"]
    assert torch.equal(inf.read_local(e, (1, 32), (8, 32), heads=None), w[1:9, 32:])
    n = _write(tmp_path, {"n": torch.randn(64)}, "n.safetensors")["n"]
    assert inf.read_box(n, (16,), (16,)).shape == (16,)


def _cfg(shape: ModelShape, **kw) -> dict:
    return {**families.hf_config(shape, "float32"), **kw}


def test_a_config_json_changed_since_the_job_was_loaded_names_each_field():
    cfg = _cfg(TINY, hidden_size=128, num_hidden_layers=2, max_position_embeddings=32)
    differ, other = families.config_problems(cfg, TINY)
    assert differ == {"dim": 128, "n_layers": 2, "seq_len": 32} and other == []
    msg = inf.shape_message(Path("/w/llama"), TINY, differ, other)
    for part in ("model.init_from /w/llama", "model.dim: the job has 64, config.json has hidden_size=128",
                 "model.n_layers: the job has 4, config.json has num_hidden_layers=2", "max_position_embeddings=32",
                 "Fix: drop the model's shape fields"):
        assert part in msg, msg
    assert families.config_problems(_cfg(TINY), TINY) == ({}, [])
    _, other = families.config_problems(_cfg(TINY, tie_word_embeddings=True), TINY)
    assert other == ["tie_embeddings differs (config.json: True, the job: False)"]


def _hf_dir(tmp: Path, shape: ModelShape, drop: str | None = None, reshape: str | None = None) -> Path:
    tensors = {}
    for name, dims in hf_layout.full_shapes(shape).items():
        hf = hf_layout.hf_name(name)
        tensors[hf] = torch.zeros(dims[0] + 1 if hf == reshape else dims[0], *dims[1:])
    tensors.pop(drop, None)
    names = sorted(tensors)
    half = len(names) // 2
    files = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for f, ns in files.items():
        save_file({n: tensors[n] for n in ns}, str(tmp / f))
    (tmp / inf.INDEX).write_text(json.dumps({"weight_map": {n: f for f, ns in files.items() for n in ns}}))
    (tmp / inf.CONFIG).write_text(json.dumps(_cfg(shape)))
    return tmp


def _check(path: Path, shape: ModelShape) -> None:
    entries = inf.open_dir(path)
    inf.check_tensors(path, entries, inf.wanted(shape, hf=True), shape)


def test_a_complete_directory_passes(tmp_path):
    _check(_hf_dir(tmp_path, TINY), TINY)


def test_a_missing_tensor_names_the_tensor_and_the_fix(tmp_path):
    path = _hf_dir(tmp_path, TINY, drop="model.layers.3.mlp.up_proj.weight")
    with pytest.raises(UserError) as err:
        _check(path, TINY)
    msg = str(err.value)
    assert "no file holds model.layers.3.mlp.up_proj.weight (the job's layers.3.feed_forward.w3.weight)" in msg
    assert str(path) in msg and "Fix:" in msg and err.value.exit_code == 2


def test_a_tensor_of_the_wrong_shape_names_its_file(tmp_path):
    path = _hf_dir(tmp_path, TINY, reshape="model.norm.weight")
    index = json.loads((path / inf.INDEX).read_text())["weight_map"]
    with pytest.raises(UserError, match=rf"{index['model.norm.weight']} holds model.norm.weight with shape "
                                        r"\[65\], the job's model needs \[64\]"):
        _check(path, TINY)


def test_a_shard_the_index_names_but_is_gone(tmp_path):
    path = _hf_dir(tmp_path, TINY)
    (path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(UserError, match="names model-00002-of-00002.safetensors, which is missing"):
        inf.open_dir(path)


def test_torch_files_and_no_directory_are_refused_with_the_fix(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(UserError, match="re-export with `dslurm ckpt export --format safetensors`"):
        inf.open_dir(tmp_path)
    with pytest.raises(UserError, match="not a directory"):
        inf.open_dir(tmp_path / "nope")


def test_tied_embeddings_have_no_output_projection_of_their_own():
    tied = dataclasses.replace(TINY, tie_embeddings=True)
    assert "output.weight" not in inf.wanted(tied, hf=True) and "output.weight" in inf.wanted(TINY, hf=True)
    assert inf.wanted(TINY, hf=True)["layers.0.attention.wk.weight"] == ("model.layers.0.self_attn.k_proj.weight", 2)
    assert inf.wanted(TINY, hf=False)["layers.0.attention.wk.weight"] == ("layers.0.attention.wk.weight", None)


def test_parameter_names_of_wrapped_blocks_are_the_unsplit_models():
    assert inf.canonical("layers.1._checkpoint_wrapped_module.attention.wq.weight") == "layers.1.attention.wq.weight"
