"""The built-in Llama (train/model.py) in the Hugging Face Llama layout, for `dslurm ckpt export
--hf-llama`: parameter names, the row order of the query/key projections, and config.json.

Pure and torch-free (tensors are only reshaped through their own methods), so it is tested
without a model; tests/integration/test_ckpt_export.py checks the whole mapping by equal logits
of `transformers.LlamaForCausalLM` and the built-in model.

Why q/k rows are permuted: train/model.py rotates interleaved pairs (x[2i], x[2i+1]) by the
i-th frequency (Meta's original layout); HF's `rotate_half` pairs x[i] with x[i + head_dim/2].
Reordering each head's output rows of wq and wk (evens first, then odds) turns one into the
other; q and k get the same order, so every attention score is unchanged, and v/o keep theirs.
It is the `permute` of transformers' convert_llama_weights_to_hf.py.
"""

from __future__ import annotations

from typing import Any

from dslurm.config.models import ModelShape

# Built-in name (under layers.N.) -> HF name (under model.layers.N.)
_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",  # SwiGLU: w2(silu(w1 x) * w3 x)
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # untied: the built-in model has its own output projection
}


def hf_name(name: str) -> str:
    """The HF name of one built-in parameter name; ValueError for a name the model does not have."""
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}"
    raise ValueError(f"{name!r} is not a parameter of the built-in Llama (train/model.py)")


def expected_names(shape: ModelShape) -> list[str]:
    """Every parameter name of the built-in model of this shape (its state_dict keys)."""
    layers = [f"layers.{i}.{k}" for i in range(shape.n_layers) for k in _LAYER]
    return [*_TOP, *layers]


def rope_heads(name: str, shape: ModelShape) -> int | None:
    """How many heads a projection's rows hold when its rows must be reordered (wq, wk), else None."""
    if name.endswith("attention.wq.weight"):
        return shape.n_heads
    if name.endswith("attention.wk.weight"):
        return shape.n_kv_heads
    return None


def to_half_split(w: Any, heads: int) -> Any:
    """Rows of each head from interleaved-pair order (r0 i0, r0 i1, r1 i0, ...) to HF's half-split
    order (all pair-firsts, then all pair-seconds). `w` is (heads * head_dim, dim)."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()


def hf_config(shape: ModelShape, dtype: str) -> dict[str, Any]:
    """config.json for `LlamaForCausalLM`. `dtype` is torch's name (bfloat16, float32).
    rope_theta is written both at the top (transformers 4.x) and in rope_parameters (5.x).
    No tokenizer travels with the weights, so bos/eos ids are left unset rather than guessed."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.dim,
        "intermediate_size": shape.ffn_dim,
        "num_hidden_layers": shape.n_layers,
        "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.seq_len,
        "rms_norm_eps": shape.norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": shape.rope_theta},
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
