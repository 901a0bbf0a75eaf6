"""The families table (dslurm/config/families.py), pure: published config.json files (copied here as
their authors wrote them) give the shape the built-in decoder runs, every key it cannot run is
refused by name, a job's stated fields are checked against config.json, and the config.json an
export writes describes the same model again. The numbers against transformers itself:
tests/integration/test_families.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from dslurm.config import ModelSpec, families, load_job
from dslurm.config.models import ModelShape, RopeScaling
from dslurm.config.resolve import resolve
from dslurm.errors import UserError

ROOT = Path(__file__).resolve().parents[2]

LLAMA32_1B = {  # meta-llama/Llama-3.2-1B
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256}
QWEN25_05B = {  # Qwen/Qwen2.5-0.5B
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
    "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
    "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 14,
    "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
    "use_mrope": False, "use_sliding_window": False, "vocab_size": 151936}
QWEN3_06B = {  # Qwen/Qwen3-0.6B
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072, "max_position_embeddings": 40960,
    "max_window_layers": 28, "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28,
    "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
    "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_sliding_window": False,
    "vocab_size": 151936}
MISTRAL_7B_V01 = {  # mistralai/Mistral-7B-v0.1
    "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
    "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768, "model_type": "mistral",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0, "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "vocab_size": 32000}


def test_published_configs_give_the_shape_and_the_parameter_count_their_authors_state():
    llama = families.shape_of(LLAMA32_1B, "t")
    assert (llama.family, llama.dim, llama.n_layers, llama.n_kv_heads, llama.tie_embeddings) == ("llama", 2048, 16, 8,
                                                                                                 True)
    assert llama.rope_scaling == RopeScaling(rope_type="llama3", factor=32.0, low_freq_factor=1.0,
                                             high_freq_factor=4.0, original_max_position_embeddings=8192)
    assert llama.seq_len == families.DEFAULT_SEQ_LEN and llama.max_positions == 131072
    assert llama.dtype == "bfloat16" and llama.explicit_head_dim is None  # 64 = 2048 / 32
    assert llama.num_params() == 1_235_814_400  # "1.23B"
    qwen2 = families.shape_of(QWEN25_05B, "t")
    assert qwen2.qkv_bias and not qwen2.qk_norm and qwen2.sliding_window is None and qwen2.tie_embeddings
    assert qwen2.num_params() == 494_032_768  # "0.49B"
    qwen3 = families.shape_of(QWEN3_06B, "t")
    assert qwen3.qk_norm and not qwen3.qkv_bias and qwen3.head_dim == 128 and qwen3.explicit_head_dim == 128
    assert qwen3.num_params() == 596_049_920  # "0.6B", 0.44B without the embedding
    mistral = families.shape_of(MISTRAL_7B_V01, "t", seq_len=8192)
    assert mistral.sliding_window == 4096 and mistral.seq_len == 8192 and not mistral.tie_embeddings
    assert mistral.num_params() == 7_241_732_096  # "7.24B"


def test_what_the_built_in_model_cannot_run_is_refused_by_its_key():
    cases = {
        "model_type is 'gemma2'; supported: llama, mistral, qwen2, qwen3": {"model_type": "gemma2"},
        "rope_type is 'yarn'; supported": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
        "use_sliding_window is true": {"use_sliding_window": True},
        "quantization_config is set": {"quantization_config": {"quant_method": "awq"}},
        "hidden_act is 'gelu'": {"hidden_act": "gelu"},
        "mlp_bias is true": {"mlp_bias": True},
        "partial_rotary_factor is 0.5": {"partial_rotary_factor": 0.5},
        "use_mrope is true": {"use_mrope": True},
    }
    for want, change in cases.items():
        with pytest.raises(UserError) as err:
            families.shape_of({**QWEN25_05B, **change}, "model.init_from /w/q")
        assert want in str(err.value) and "model.init_from /w/q: config.json" in str(err.value), str(err.value)
        assert err.value.exit_code == 2
    with pytest.raises(UserError, match="config.json has no 'intermediate_size'"):
        families.shape_of({k: v for k, v in LLAMA32_1B.items() if k != "intermediate_size"}, "t")


@pytest.mark.parametrize("cfg", [LLAMA32_1B, QWEN25_05B, QWEN3_06B, MISTRAL_7B_V01])
def test_the_config_an_export_writes_describes_the_same_model(cfg):
    shape = families.shape_of(cfg, "t", seq_len=1024)
    out = families.hf_config(shape, "bfloat16")
    assert families.shape_of(out, "t", seq_len=1024) == shape
    assert out["architectures"] == cfg["architectures"] and out["model_type"] == cfg["model_type"]
    assert out["max_position_embeddings"] == cfg["max_position_embeddings"]  # not the training seq_len
    assert out["tie_word_embeddings"] == cfg["tie_word_embeddings"]
    assert families.config_problems(out, shape) == ({}, [])


def test_a_record_round_trips_and_a_llama_of_before_the_families_records_as_it_did():
    shape = families.shape_of(LLAMA32_1B, "t")
    assert ModelShape.from_record(json.loads(json.dumps(shape.record()))) == shape
    plain = ModelShape(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=256, seq_len=64)
    assert sorted(plain.record()) == sorted(["dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
                                             "seq_len", "rope_theta", "norm_eps"])


def _model_dir(tmp: Path, cfg: dict) -> Path:
    d = tmp / "weights"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_a_job_without_a_shape_takes_config_json_s(tmp_path):
    d = _model_dir(tmp_path, LLAMA32_1B)
    assert ModelSpec(init_from=str(d)).shape() == families.shape_of(LLAMA32_1B, "t")
    assert ModelSpec(init_from=str(d), seq_len=4096).shape().seq_len == 4096
    assert ModelSpec(init_from=str(d), n_layers=16, preset="1b").shape().tie_embeddings  # agreeing fields pass


def test_a_job_field_that_disagrees_with_config_json_is_named_with_both_values(tmp_path):
    d = _model_dir(tmp_path, LLAMA32_1B)
    with pytest.raises(UserError) as err:
        ModelSpec(init_from=str(d), n_layers=2, ffn_dim=128, seq_len=200000).shape()
    msg = str(err.value)
    for part in (f"model.init_from {d}: config.json does not match the job's model",
                 "model.n_layers: the job has 2, config.json has num_hidden_layers=16",
                 "model.ffn_dim: the job has 128, config.json has intermediate_size=8192",
                 "model.seq_len: the job has 200000, config.json has max_position_embeddings=131072",
                 "Fix: drop model.preset and these fields", "n_layers: 16, ffn_dim: 8192, seq_len: at most 131072"):
        assert part in msg, msg
    with pytest.raises(UserError, match="model.rope_theta: the job has 10000.0, config.json has rope_theta=500000.0"):
        ModelSpec(init_from=str(d), preset="tiny").shape()  # a stated preset states all of its fields


def test_no_config_json_and_no_shape_is_refused_with_the_fix(tmp_path):
    with pytest.raises(UserError, match="no config.json there, so the model's shape is unknown"):
        ModelSpec(init_from=str(tmp_path)).shape()
    assert ModelSpec(init_from=str(tmp_path), preset="tiny").shape().dim == 64  # a built-in-names export


def test_the_job_file_is_named_and_resolve_plans_the_real_model(tmp_path):
    d = _model_dir(tmp_path, {**LLAMA32_1B, "model_type": "phi3"})
    job = {"name": "ft", "nodes": 1, "model": {"init_from": str(d)}}
    with pytest.raises(UserError, match=r"^job: model.init_from .*model_type is 'phi3'"):
        load_job(data=job)
    (d / "config.json").write_text(json.dumps(LLAMA32_1B))
    from dslurm.config import load_site
    from dslurm.plan.inputs import from_resolved

    site = load_site(ROOT / "site-configs" / "local.yaml")
    res = resolve(site, load_job(data=job), base_dir=tmp_path)
    assert res.shape == families.shape_of(LLAMA32_1B, "t")
    assert from_resolved(res).model.num_params() == 1_235_814_400  # what `dslurm plan` sizes
    with pytest.raises(UserError, match=r"pp\(2\) with tie_word_embeddings"):
        resolve(site, load_job(data={**job, "parallel": {"pp": 2, "microbatches": 2}, "procs_per_node": 2}),
                base_dir=tmp_path)


def test_rope_scaling_and_head_dim_reach_the_flops_and_window_the_attention_term():
    base = ModelShape(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256, seq_len=32)
    windowed = dataclasses.replace(base, sliding_window=8)
    assert windowed.flops_per_token() < base.flops_per_token()
    assert dataclasses.replace(base, sliding_window=32).flops_per_token() == base.flops_per_token()
    wide = dataclasses.replace(base, explicit_head_dim=32)
    assert wide.num_params() > base.num_params() and wide.problems() == []
