"""The built-in Llama (train/model.py) in the Hugging Face Llama layout, for `dslurm ckpt export
--hf-llama` and back for `model.init_from` (dslurm/checkpoint/init_from.py): parameter names,
the row order of the query/key projections, and config.json (written, and checked against a job).

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


_LAYER_BACK = {v: k for k, v in _LAYER.items()}
_TOP_BACK = {v: k for k, v in _TOP.items()}


def builtin_name(name: str) -> str:
    """The built-in name of one HF Llama parameter name (the inverse of `hf_name`); ValueError
    for a name the built-in model has no parameter for (e.g. a rotary inv_freq buffer)."""
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    parts = name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and parts[3] in _LAYER_BACK:
        return f"layers.{parts[2]}.{_LAYER_BACK[parts[3]]}"
    raise ValueError(f"{name!r} is not a Hugging Face Llama parameter the built-in model has")


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


def from_half_split(w: Any, heads: int) -> Any:
    """The inverse of `to_half_split`: HF's half-split rows of each head back to interleaved pairs."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols).contiguous()


def head_span(start: int, stop: int, head_dim: int) -> tuple[int, int]:
    """The whole heads (first, end) that hold rows [start, stop) of a q/k projection: the rows a
    shard must read in HF's order to undo the reordering, which never leaves a head."""
    return start // head_dim, -(-stop // head_dim)


# config.json key -> ModelShape field, for the fields that must agree.
CONFIG_FIELDS = (("hidden_size", "dim"), ("num_hidden_layers", "n_layers"), ("num_attention_heads", "n_heads"),
                 ("num_key_value_heads", "n_kv_heads"), ("intermediate_size", "ffn_dim"),
                 ("vocab_size", "vocab_size"), ("rope_theta", "rope_theta"), ("rms_norm_eps", "norm_eps"))


def _rope(cfg: dict[str, Any]) -> tuple[Any, Any]:
    """(rope_theta, rope type) from either transformers layout: 5.x `rope_parameters`, 4.x
    top-level rope_theta with an optional `rope_scaling`."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    params = params if isinstance(params, dict) else {}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))  # LlamaConfig's default
    return theta, params.get("rope_type", params.get("type", "default"))


def config_problems(cfg: dict[str, Any], shape: ModelShape) -> tuple[dict[str, Any], list[str]]:
    """How an HF config.json differs from the job's model shape: ({ModelShape field: the config's
    value} for every differing shape field, [what the built-in model cannot run at all]).
    Absent keys take LlamaConfig's defaults."""
    theta, rope_type = _rope(cfg)
    values = {**cfg, "rope_theta": theta}
    values.setdefault("num_key_value_heads", values.get("num_attention_heads"))
    values.setdefault("rms_norm_eps", 1e-6)
    differ: dict[str, Any] = {}
    for key, fld in CONFIG_FIELDS:
        got, want = values.get(key), getattr(shape, fld)
        same = (isinstance(got, (int, float)) and not isinstance(got, bool)
                and abs(float(got) - float(want)) <= 1e-9 * max(abs(float(want)), 1e-30))
        if not same:
            differ[fld] = got
    other = []
    if cfg.get("model_type", "llama") != "llama":
        other.append(f"model_type is {cfg.get('model_type')!r}, not 'llama'")
    if cfg.get("hidden_act", "silu") != "silu":
        other.append(f"hidden_act is {cfg.get('hidden_act')!r}; the built-in model uses 'silu'")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            other.append(f"{key} is true; the built-in model has no biases")
    if rope_type != "default":
        other.append(f"rope type is {rope_type!r}; the built-in model has plain RoPE only")
    head_dim, heads, hidden = cfg.get("head_dim"), values.get("num_attention_heads"), values.get("hidden_size")
    if isinstance(head_dim, int) and isinstance(heads, int) and isinstance(hidden, int) and head_dim * heads != hidden:
        other.append(f"head_dim {head_dim} x num_attention_heads {heads} != hidden_size {hidden}; "
                     "the built-in model needs head_dim = dim / n_heads")
    max_pos = cfg.get("max_position_embeddings")
    if isinstance(max_pos, int) and max_pos < shape.seq_len:
        differ["seq_len"] = max_pos
    return differ, other


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
