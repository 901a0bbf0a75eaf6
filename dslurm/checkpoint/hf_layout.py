"""The built-in decoder (train/model.py) in the Hugging Face layout of its family, for `dslurm ckpt
export --hf` and back for `model.init_from` (dslurm/checkpoint/init_from.py): parameter names and
the row order of the query/key projections (their biases and Qwen3's q/k norms included). Which
tensors a model has follows its shape's family flags (dslurm/config/families.py, where config.json
is mapped); this module is the one home of the names, for every family.

Pure and torch-free (tensors are only reshaped through their own methods), so it is tested
without a model; tests/integration/test_init_from.py checks the whole mapping by equal logits
of transformers' `*ForCausalLM` and the built-in model for each family.

Why q/k rows are permuted: train/model.py rotates interleaved pairs (x[2i], x[2i+1]) by the
i-th frequency (Meta's original layout); HF's `rotate_half` pairs x[i] with x[i + head_dim/2].
Reordering each head's output rows of wq and wk (evens first, then odds) turns one into the
other; q and k get the same order, so every attention score is unchanged, and v/o keep theirs.
It is the `permute` of transformers' convert_llama_weights_to_hf.py. A q/k bias is a row of its
own and moves with its rows; Qwen3's q/k norm weight scales the head_dim entries of every head,
so it is reordered as one head.
"""

from __future__ import annotations

from typing import Any

from dslurm.config.models import ModelShape

# Built-in name (under layers.N.) -> HF name (under model.layers.N.); every family has these.
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
_BIAS = {  # qkv_bias (Qwen2)
    "attention.wq.bias": "self_attn.q_proj.bias",
    "attention.wk.bias": "self_attn.k_proj.bias",
    "attention.wv.bias": "self_attn.v_proj.bias",
}
_QK_NORM = {  # qk_norm (Qwen3)
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
}
_ALL_LAYER = _LAYER | _BIAS | _QK_NORM
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",  # absent with tie_word_embeddings: the embedding serves as both
}


def hf_name(name: str) -> str:
    """The HF name of one built-in parameter name; ValueError for a name the model does not have."""
    if name in _TOP:
        return _TOP[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and parts[2] in _ALL_LAYER:
        return f"model.layers.{parts[1]}.{_ALL_LAYER[parts[2]]}"
    raise ValueError(f"{name!r} is not a parameter of the built-in decoder (train/model.py)")


_LAYER_BACK = {v: k for k, v in _ALL_LAYER.items()}
_TOP_BACK = {v: k for k, v in _TOP.items()}


def builtin_name(name: str) -> str:
    """The built-in name of one HF parameter name (the inverse of `hf_name`); ValueError for a
    name the built-in model has no parameter for (e.g. a rotary inv_freq buffer)."""
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and parts[3] in _LAYER_BACK:
        return f"layers.{parts[2]}.{_LAYER_BACK[parts[3]]}"
    raise ValueError(f"{name!r} is not a Hugging Face parameter the built-in model has")


def layer_names(shape: ModelShape) -> list[str]:
    """The parameter names of one block of this shape (under layers.N.)."""
    return [*_LAYER, *(_BIAS if shape.qkv_bias else ()), *(_QK_NORM if shape.qk_norm else ())]


def expected_names(shape: ModelShape) -> list[str]:
    """Every parameter of the built-in model of this shape (its named_parameters, a tied output
    projection counted once, as the embedding)."""
    top = [k for k in _TOP if not (shape.tie_embeddings and k == "output.weight")]
    return [*top, *(f"layers.{i}.{k}" for i in range(shape.n_layers) for k in layer_names(shape))]


def full_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every expected parameter's full shape."""
    d, q, kv, hd = shape.dim, shape.n_heads * shape.head_dim, shape.n_kv_heads * shape.head_dim, shape.head_dim
    layer = {"attention.wq.weight": (q, d), "attention.wk.weight": (kv, d), "attention.wv.weight": (kv, d),
             "attention.wo.weight": (d, q), "feed_forward.w1.weight": (shape.ffn_dim, d),
             "feed_forward.w3.weight": (shape.ffn_dim, d), "feed_forward.w2.weight": (d, shape.ffn_dim),
             "attention_norm.weight": (d,), "ffn_norm.weight": (d,), "attention.wq.bias": (q,),
             "attention.wk.bias": (kv,), "attention.wv.bias": (kv,), "attention.q_norm.weight": (hd,),
             "attention.k_norm.weight": (hd,)}
    top = {"tok_embeddings.weight": (shape.vocab_size, d), "norm.weight": (d,), "output.weight": (shape.vocab_size, d)}
    out = {}
    for name in expected_names(shape):
        out[name] = top[name] if name in top else layer[name.split(".", 2)[2]]
    return out


def rope_heads(name: str, shape: ModelShape) -> int | None:
    """How many heads a tensor's rows hold when they must be reordered (q/k weights and biases;
    a q/k norm weight is one head's worth), else None."""
    if name.endswith(("attention.wq.weight", "attention.wq.bias")):
        return shape.n_heads
    if name.endswith(("attention.wk.weight", "attention.wk.bias")):
        return shape.n_kv_heads
    if name.endswith(("attention.q_norm.weight", "attention.k_norm.weight")):
        return 1
    return None


def to_half_split(w: Any, heads: int) -> Any:
    """Rows of each head from interleaved-pair order (r0 i0, r0 i1, r1 i0, ...) to HF's half-split
    order (all pair-firsts, then all pair-seconds). `w` is (heads * head_dim, ...)."""
    rows, rest = w.shape[0], tuple(w.shape[1:])
    return w.reshape(heads, rows // heads // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest).contiguous()


def from_half_split(w: Any, heads: int) -> Any:
    """The inverse of `to_half_split`: HF's half-split rows of each head back to interleaved pairs."""
    rows, rest = w.shape[0], tuple(w.shape[1:])
    return w.reshape(heads, 2, rows // heads // 2, *rest).transpose(1, 2).reshape(rows, *rest).contiguous()


def head_span(start: int, stop: int, head_dim: int) -> tuple[int, int]:
    """The whole heads (first, end) that hold rows [start, stop) of a q/k projection: the rows a
    shard must read in HF's order to undo the reordering, which never leaves a head."""
    return start // head_dim, -(-stop // head_dim)
