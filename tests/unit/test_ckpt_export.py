"""`dslurm ckpt export`: the pure parts (sizes, shard plan, file names, the HF Llama names and row
order) and the export of a real single-process generation (CheckpointManager, real DCP files):
round trips through torch.load and the safetensors package, the dtype cast, size sharding with its
index, refusal of corrupt generations, crash safety, and the CLI's errors.
The FSDP x TP generation and the transformers logits check: tests/integration/test_ckpt_export_dist.py."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dslurm import checkpoint as ck
from dslurm.checkpoint import export as ex
from dslurm.checkpoint import hf_layout
from dslurm.checkpoint.dcp import CheckpointManager
from dslurm.cli import main
from dslurm.config.models import PRESETS
from dslurm.errors import UserError
from dslurm.runtime.state import train_state
from train.model import build_model, cross_entropy

TINY = PRESETS["tiny"]


# ---------------------------------------------------------------- pure parts


@pytest.mark.parametrize("text,want", [("5GB", 5 * 10**9), ("500MB", 500 * 10**6), ("2GiB", 2 * 2**30),
                                       ("1.5kb", 1500), ("123", 123), (" 10 MiB ", 10 * 2**20), ("7B", 7)])
def test_parse_size(text, want):
    assert ex.parse_size(text) == want


@pytest.mark.parametrize("text", ["", "0", "5XB", "GB", "-1GB", "5 G B", "0.1B"])
def test_parse_size_refuses_nonsense_naming_the_flag(text):
    with pytest.raises(UserError, match="--max-shard-size .*e.g. 5GB"):
        ex.parse_size(text)


def test_plan_shards_greedy_in_order_and_oversize_alone():
    sizes = [("a", 40), ("b", 50), ("c", 20), ("big", 300), ("d", 10), ("e", 95)]
    assert ex.plan_shards(sizes, 100) == [["a", "b"], ["c"], ["big"], ["d"], ["e"]]
    assert ex.plan_shards(sizes, None) == [["a", "b", "c", "big", "d", "e"]]
    assert ex.plan_shards(sizes, 10**9) == [["a", "b", "c", "big", "d", "e"]]
    assert ex.plan_shards([], 100) == []


def test_file_names_follow_the_hf_conventions():
    assert ex.file_names("safetensors", 1) == ["model.safetensors"]
    assert ex.file_names("torch", 1) == ["pytorch_model.bin"]
    assert ex.file_names("safetensors", 3)[1] == "model-00002-of-00003.safetensors"
    assert ex.file_names("torch", 2) == ["pytorch_model-00001-of-00002.bin", "pytorch_model-00002-of-00002.bin"]


def test_index_doc_maps_every_name_to_its_file():
    doc = ex.index_doc([["b", "a"], ["c"]], ["f1", "f2"], 123)
    assert doc == {"metadata": {"total_size": 123}, "weight_map": {"a": "f1", "b": "f1", "c": "f2"}}


def test_natural_order_puts_layer_10_after_layer_2():
    names = ["layers.10.w", "layers.2.w", "norm.weight", "layers.1.w"]
    assert sorted(names, key=ex.natural_key) == ["layers.1.w", "layers.2.w", "layers.10.w", "norm.weight"]


@pytest.mark.parametrize("flags", [{"qkv_bias": True}, {"qk_norm": True, "explicit_head_dim": 32},
                                   {"tie_embeddings": True}])
def test_every_familys_names_and_shapes_are_the_models_parameters(flags):
    shape = dataclasses.replace(TINY, **flags)
    params = dict(build_model(shape, 0).named_parameters())
    assert hf_layout.full_shapes(shape) == {k: tuple(p.shape) for k, p in params.items()}
    assert sorted(hf_layout.builtin_name(hf_layout.hf_name(n)) for n in params) == sorted(params)


def test_hf_names_cover_the_built_in_model_one_to_one():
    model_names = list(build_model(TINY, 0).state_dict())
    assert sorted(hf_layout.expected_names(TINY)) == sorted(model_names)  # the mapping tracks train/model.py
    hf = [hf_layout.hf_name(n) for n in model_names]
    assert len(set(hf)) == len(hf)
    assert hf_layout.hf_name("layers.3.feed_forward.w1.weight") == "model.layers.3.mlp.gate_proj.weight"
    assert hf_layout.hf_name("layers.3.feed_forward.w2.weight") == "model.layers.3.mlp.down_proj.weight"
    assert hf_layout.hf_name("output.weight") == "lm_head.weight"
    for bad in ("layers.x.attention.wq.weight", "layers.0.attention.wo.bias", "rope", "model.norm.weight"):
        with pytest.raises(ValueError, match="not a parameter"):
            hf_layout.hf_name(bad)


def test_rope_rows_go_from_interleaved_pairs_to_halves_per_head():
    w = torch.arange(16.0).reshape(8, 2)  # 2 heads of head_dim 4, rows numbered by their index
    got = hf_layout.to_half_split(w, heads=2)[:, 0] / 2
    assert got.tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert hf_layout.rope_heads("layers.0.attention.wq.weight", TINY) == TINY.n_heads
    assert hf_layout.rope_heads("layers.0.attention.wk.weight", TINY) == TINY.n_kv_heads
    assert hf_layout.rope_heads("layers.0.attention.wv.weight", TINY) is None


# ---------------------------------------------------------------- a real generation


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A run directory whose pointer names a generation of the tiny model after one AdamW step
    (so the optimizer state exists and must be left out), and the model's parameters."""
    run_dir = tmp_path_factory.mktemp("run")
    model = build_model(TINY, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, TINY.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    opt.step()
    with CheckpointManager(run_dir, model_shape=dataclasses.asdict(TINY)) as mgr:
        assert mgr.save(1, train_state([model], [opt]))
    return run_dir, {k: v.detach().clone() for k, v in model.state_dict().items()}


def gen_of(run_dir: Path) -> Path:
    return ck.generations_dir(run_dir) / ck.read_pointer(run_dir).generation


def test_torch_export_round_trips_bit_identical_without_optimizer_state(run, tmp_path):
    run_dir, params = run
    res = ex.export(gen_of(run_dir), tmp_path / "out", fmt="torch")
    got = torch.load(tmp_path / "out" / "pytorch_model.bin", weights_only=True)
    assert sorted(got) == sorted(params) and res.files == ["pytorch_model.bin"]
    assert all(torch.equal(got[k], params[k]) and got[k].dtype == torch.float32 for k in params)
    info = json.loads((tmp_path / "out" / ex.INFO).read_text())
    assert info["generation"] == gen_of(run_dir).name and info["step"] == 1 and info["tensors"] == len(params)


def test_safetensors_bf16_sharded_with_index(run, tmp_path):
    run_dir, params = run
    out = tmp_path / "out"
    limit = 60_000
    res = ex.export(gen_of(run_dir), out, fmt="safetensors", dtype="bf16", max_shard_bytes=limit)
    index = json.loads((out / ex.INDEX["safetensors"]).read_text())
    assert sorted(index["weight_map"]) == sorted(params) and len(res.files) > 2
    assert set(index["weight_map"].values()) == set(res.files)
    got: dict[str, torch.Tensor] = {}
    for f in res.files:
        part = load_file(out / f)
        # a file past the limit holds one tensor only (too big to share)
        assert sum(t.numel() * t.element_size() for t in part.values()) <= limit or len(part) == 1
        assert all(index["weight_map"][k] == f for k in part)
        got.update(part)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in got.values())
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], params[k].to(torch.bfloat16)) for k in params)


def test_hf_layout_names_rows_and_config(run, tmp_path):
    run_dir, params = run
    ex.export(gen_of(run_dir), tmp_path / "out", fmt="safetensors", hf=True)
    got = load_file(tmp_path / "out" / "model.safetensors")
    assert torch.equal(got["lm_head.weight"], params["output.weight"])
    assert torch.equal(got["model.layers.1.self_attn.v_proj.weight"], params["layers.1.attention.wv.weight"])
    q = params["layers.0.attention.wq.weight"]
    assert torch.equal(got["model.layers.0.self_attn.q_proj.weight"], hf_layout.to_half_split(q, TINY.n_heads))
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (cfg["num_key_value_heads"], cfg["hidden_size"], cfg["torch_dtype"]) == (TINY.n_kv_heads, TINY.dim,
                                                                                   "float32")


def test_refuses_a_generation_that_fails_verification_and_leaves_nothing(run, tmp_path):
    run_dir, _ = run
    bad_run = tmp_path / "run"
    shutil.copytree(run_dir, bad_run, ignore=shutil.ignore_patterns(ck.LOCK))
    shard = next(gen_of(bad_run).glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ck.CheckpointError, match=f"refusing to export .*{shard}: crc32"):
        ex.export(gen_of(bad_run), tmp_path / "out", fmt="torch")
    assert not (tmp_path / "out").exists()
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    assert ex.export(gen_of(bad_run), tmp_path / "ok", fmt="torch").tensors  # restored bytes: sound again
    ck.mark_rejected(gen_of(bad_run), ["found corrupt by a restore"])
    with pytest.raises(ck.CheckpointError, match="REJECTED.json: a restore found this generation corrupt"):
        ex.export(gen_of(bad_run), tmp_path / "out", fmt="torch")


def test_a_failed_write_leaves_no_output_and_no_partial(run, tmp_path, monkeypatch):
    run_dir, _ = run
    real, calls = ex._write_file, []

    def disk_full_on_second(fmt, tensors, path):  # injected fault: the disk fills during file 2
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(fmt, tensors, path)

    monkeypatch.setattr(ex, "_write_file", disk_full_on_second)
    with pytest.raises(ck.CheckpointError, match="failed, nothing was left there: OSError.*No space left"):
        ex.export(gen_of(run_dir), tmp_path / "out", fmt="torch", max_shard_bytes=100_000)
    assert len(calls) == 2 and list(tmp_path.iterdir()) == []


def test_output_must_be_new_or_empty_and_key_must_exist(run, tmp_path):
    run_dir, _ = run
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    with pytest.raises(UserError, match="not an empty directory"):
        ex.export(gen_of(run_dir), tmp_path / "full", fmt="torch")
    with pytest.raises(UserError, match="no tensors under 'weights' .*it has: model, optim"):
        ex.export(gen_of(run_dir), tmp_path / "out", fmt="torch", key="weights")
    (tmp_path / "empty").mkdir()
    ex.export(gen_of(run_dir), tmp_path / "empty", fmt="torch")  # an empty directory is replaced
    assert (tmp_path / "empty" / "pytorch_model.bin").is_file()


# ---------------------------------------------------------------- the CLI


def test_cli_export_default_is_the_pointer_target(run, tmp_path, capsys):
    run_dir, _ = run
    assert main(["ckpt", "export", str(run_dir), "--format", "safetensors", "-o", str(tmp_path / "o")]) == 0
    assert f"OK {gen_of(run_dir).name} (step 1)" in capsys.readouterr().out
    assert (tmp_path / "o" / "model.safetensors").is_file()


@pytest.mark.parametrize("argv,code,message", [
    (["{missing}", "--format", "torch"], 2, "no such run directory"),
    (["{run}", "--format", "torch", "-g", "step-99"], 2, "--generation 'step-99': no such generation"),
    (["{run}", "--format", "torch", "--dtype", "int8"], 2, "argument --dtype: invalid choice: 'int8'"),
    (["{run}", "--format", "onnx"], 2, "argument --format: invalid choice: 'onnx'"),
    (["{run}", "--format", "torch", "--max-shard-size", "5XB"], 2, "--max-shard-size '5XB': not a size"),
    (["{empty}", "--format", "torch"], 1, "LATEST: missing; nothing is committed here"),
])
def test_cli_errors_are_one_clear_line(run, tmp_path, cli, argv, code, message):
    (tmp_path / "empty").mkdir()
    where = {"missing": tmp_path / "nope", "run": run[0], "empty": tmp_path / "empty"}
    argv = [a.format(**where) for a in argv]
    res = cli("ckpt", "export", *argv, "-o", str(tmp_path / "out"))
    assert res.returncode == code and message in res.stderr, res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "out").exists()
