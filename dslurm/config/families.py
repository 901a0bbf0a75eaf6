"""The model families the built-in decoder runs, and how a Hugging Face config.json maps onto
`ModelShape` and back. The one home of that mapping: `model.init_from` reads it (the job's shape,
the check of a directory), `dslurm ckpt export --hf` writes it, `dslurm plan` gets the real model
through the job's resolved shape. Tensor names live in dslurm/checkpoint/hf_layout.py and follow
the flags a family sets here.

| model_type | classes | differs from Llama |
|---|---|---|
| llama   | LlamaForCausalLM   | - (Llama 2, 3, 3.1-3.3: rope_type llama3) |
| mistral | MistralForCausalLM | sliding_window (attention to the last N keys) |
| qwen2   | Qwen2ForCausalLM   | q/k/v projections with a bias (Qwen2, Qwen2.5) |
| qwen3   | Qwen3ForCausalLM   | RMSNorm on every q/k head before RoPE; head_dim set apart from hidden_size |

Anything in a config.json that would change the computation and that the built-in model does not
do is refused by its key (`unsupported`), before a job is submitted. Pure and torch-free.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dslurm.config.models import ModelShape, RopeScaling
from dslurm.errors import UserError

CONFIG = "config.json"
DEFAULT_SEQ_LEN = 2048
"""seq_len of a job that takes its shape from config.json and states none: at most this, as
TRL's SFT default (max_position_embeddings of a Llama 3.1 is 131072: far too long to train on)."""


@dataclass(frozen=True)
class Family:
    model_type: str
    architecture: str
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding: bool = False  # `sliding_window` alone turns it on (Mistral), not `use_sliding_window`


FAMILIES = {f.model_type: f for f in (
    Family("llama", "LlamaForCausalLM"),
    Family("mistral", "MistralForCausalLM", sliding=True),
    Family("qwen2", "Qwen2ForCausalLM", qkv_bias=True),
    Family("qwen3", "Qwen3ForCausalLM", qk_norm=True),
)}
ROPE_TYPES = ("default", "llama3", "linear")

# config.json key -> ModelShape field, for the fields a job may also state.
FIELDS = (("hidden_size", "dim"), ("num_hidden_layers", "n_layers"), ("num_attention_heads", "n_heads"),
          ("num_key_value_heads", "n_kv_heads"), ("intermediate_size", "ffn_dim"),
          ("vocab_size", "vocab_size"), ("rope_theta", "rope_theta"), ("rms_norm_eps", "norm_eps"))
KEY_OF = {fld: key for key, fld in FIELDS} | {"seq_len": "max_position_embeddings"}


def rope_params(cfg: dict[str, Any]) -> dict[str, Any]:
    """The RoPE dict of either transformers layout: 4.x `rope_scaling` (which transformers 5 still
    lets win) or 5.x `rope_parameters`, with rope_theta from the top level when it is not inside."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    params = dict(params) if isinstance(params, dict) else {}
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))  # the four families' default
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


def unsupported(cfg: dict[str, Any]) -> list[str]:
    """What in config.json the built-in model cannot run, each naming its key and value."""
    mt = cfg.get("model_type")
    if mt not in FAMILIES:
        return [f"model_type is {mt!r}; supported: {', '.join(FAMILIES)}"]
    fam, out = FAMILIES[mt], []
    if cfg.get("hidden_act", "silu") != "silu":
        out.append(f"hidden_act is {cfg.get('hidden_act')!r}; the built-in model uses 'silu'")
    for key in ("attention_bias", "mlp_bias"):
        if cfg.get(key):
            out.append(f"{key} is true; the built-in {mt} has no biases there")
    rope = rope_params(cfg)
    if rope["rope_type"] not in ROPE_TYPES:
        out.append(f"rope_type is {rope['rope_type']!r}; supported: {', '.join(ROPE_TYPES)}")
    prf = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if prf not in (None, 1, 1.0):
        out.append(f"partial_rotary_factor is {prf!r}; the built-in model rotates the whole head")
    if not fam.sliding and cfg.get("use_sliding_window"):
        out.append("use_sliding_window is true; the built-in model runs sliding windows only as Mistral does "
                   "(every layer)")
    layer_types = cfg.get("layer_types")
    if not fam.sliding and isinstance(layer_types, list) and set(layer_types) - {"full_attention"}:
        out.append(f"layer_types has {sorted(set(layer_types) - {'full_attention'})}; only full_attention is built in")
    if cfg.get("use_mrope"):
        out.append("use_mrope is true: multimodal RoPE (Qwen2-VL); the built-in model is text only")
    if cfg.get("quantization_config"):
        out.append("quantization_config is set: quantized weights; give the unquantized checkpoint")
    if float(cfg.get("attention_dropout") or 0.0) != 0.0:
        out.append(f"attention_dropout is {cfg['attention_dropout']}; the built-in model has no dropout")
    heads, head_dim = cfg.get("num_attention_heads"), cfg.get("head_dim")
    if isinstance(head_dim, int) and head_dim % 2:
        out.append(f"head_dim is {head_dim}; RoPE needs an even head_dim")
    if not isinstance(heads, int) or not isinstance(cfg.get("hidden_size"), int):
        out.append("hidden_size and num_attention_heads must be integers")
    return out


def _head_dim(cfg: dict[str, Any]) -> int | None:
    """head_dim when it differs from hidden_size / heads (Qwen3's class default is 128)."""
    hd = cfg.get("head_dim", 128 if cfg.get("model_type") == "qwen3" else None)
    return hd if isinstance(hd, int) and hd * cfg["num_attention_heads"] != cfg["hidden_size"] else None


def _scaling(rope: dict[str, Any]) -> RopeScaling | None:
    if rope["rope_type"] == "default":
        return None
    keys = ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    extra = {k: rope[k] for k in keys if k in rope} if rope["rope_type"] == "llama3" else {}
    return RopeScaling(rope_type=rope["rope_type"], factor=float(rope.get("factor", 1.0)), **extra)


def _dtype(cfg: dict[str, Any]) -> str | None:
    d = cfg.get("dtype") or cfg.get("torch_dtype")
    return d if d in ("float32", "bfloat16", "float16") else None


def shape_of(cfg: dict[str, Any], where: str, seq_len: int | None = None) -> ModelShape:
    """The model a config.json describes. `seq_len`: the job's (None: max_position_embeddings, at
    most DEFAULT_SEQ_LEN). UserError naming every key the built-in model cannot run."""
    if problems := unsupported(cfg):
        raise UserError(f"{where}: {CONFIG} describes a model the built-in decoder cannot run: "
                        + "; ".join(problems) + ". Fix: point model.init_from at a Llama, Mistral, Qwen2/2.5 or "
                        "Qwen3 checkpoint (docs/trainer.md, the families table)")
    fam, rope = FAMILIES[cfg["model_type"]], rope_params(cfg)
    max_pos = int(cfg.get("max_position_embeddings") or DEFAULT_SEQ_LEN)
    window = cfg.get("sliding_window") if fam.sliding else None
    try:
        return ModelShape(
            dim=int(cfg["hidden_size"]), n_layers=int(cfg["num_hidden_layers"]),
            n_heads=int(cfg["num_attention_heads"]),
            n_kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
            ffn_dim=int(cfg["intermediate_size"]), vocab_size=int(cfg["vocab_size"]),
            seq_len=seq_len if seq_len is not None else min(max_pos, DEFAULT_SEQ_LEN),
            rope_theta=float(rope["rope_theta"]), norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            family=fam.model_type, explicit_head_dim=_head_dim(cfg), qkv_bias=fam.qkv_bias, qk_norm=fam.qk_norm,
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), rope_scaling=_scaling(rope),
            sliding_window=int(window) if isinstance(window, int) else None, max_positions=max_pos,
            dtype=_dtype(cfg))
    except KeyError as exc:
        raise UserError(f"{where}: {CONFIG} has no {exc.args[0]!r}, which every {fam.model_type} config.json "
                        "has. Fix: copy the model's own config.json into the directory") from None
    except (TypeError, ValueError) as exc:
        raise UserError(f"{where}: {CONFIG} holds a value that is not a number ({exc}). Fix: copy the model's "
                        "own config.json into the directory") from None


def read_config(directory: Path, where: str) -> dict[str, Any]:
    """config.json of a model directory (UserError naming the file if it is not JSON)."""
    path = directory / CONFIG
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{where}: {path} is not a readable JSON file ({exc}). Fix: copy the model's own "
                        f"{CONFIG}") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{where}: {path} holds no JSON object. Fix: copy the model's own {CONFIG}")
    return cfg


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isclose(a, b, rel_tol=1e-9)
    return bool(a == b)


def differences(have: ModelShape, stated: dict[str, Any]) -> dict[str, Any]:
    """{field: config.json's value} for every field the job states that config.json's shape
    does not have; seq_len only when it is longer than max_position_embeddings allows (`have`
    then carries that limit)."""
    out = {f: getattr(have, f) for f, v in stated.items() if f != "seq_len" and not _same(getattr(have, f), v)}
    if "seq_len" in stated and stated["seq_len"] > have.seq_len:
        out["seq_len"] = have.seq_len
    return out


def mismatch_message(where: str, stated: dict[str, Any], differ: dict[str, Any]) -> str:
    """The exit-2 message of a job whose stated fields disagree with config.json: every field,
    both values, and the fix (drop them: the shape then comes from config.json)."""
    parts = [f"model.{f}: the job has {stated[f]}, {CONFIG} has {KEY_OF[f]}={v!r}" for f, v in differ.items()]
    fix = ", ".join(f"{f}: {v}" for f, v in differ.items() if f != "seq_len")
    if "seq_len" in differ:
        fix += f"{', ' if fix else ''}seq_len: at most {differ['seq_len']}"
    return (f"{where}: {CONFIG} does not match the job's model: " + "; ".join(parts)
            + f". Fix: drop model.preset and these fields (the shape then comes from {CONFIG}), or set in the "
            f"job's model: {fix} (or point model.init_from at weights of this shape)")


def config_problems(cfg: dict[str, Any], shape: ModelShape) -> tuple[dict[str, Any], list[str]]:
    """How a config.json differs from a model shape: ({field: config's value}, [what cannot run]).
    The check `model.init_from` makes before reading a tensor (the file may have changed since submit)."""
    if problems := unsupported(cfg):
        return {}, problems
    have = shape_of(cfg, CONFIG, seq_len=int(cfg.get("max_position_embeddings") or shape.seq_len))
    stated = {f: getattr(shape, f) for f in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size",
                                             "rope_theta", "norm_eps", "seq_len")}
    differ = differences(have, stated)
    other = [f"{name} differs ({CONFIG}: {getattr(have, name)!r}, the job: {getattr(shape, name)!r})"
             for name in ("family", "head_dim", "qkv_bias", "qk_norm", "tie_embeddings", "rope_scaling",
                          "sliding_window") if getattr(have, name) != getattr(shape, name)]
    return differ, other


def hf_config(shape: ModelShape, dtype: str) -> dict[str, Any]:
    """config.json for the family's `*ForCausalLM`. `dtype` is torch's name (bfloat16, float32).
    rope_theta is written at the top (transformers 4.x) and in rope_parameters (5.x); a scaled RoPE
    also as 4.x's rope_scaling (which transformers 5 reads first). No tokenizer travels with the
    weights, so bos/eos ids are left unset rather than guessed."""
    fam = FAMILIES[shape.family]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": shape.rope_theta}
    if shape.rope_scaling is not None:
        rs = shape.rope_scaling
        rope = {"rope_type": rs.rope_type, "rope_theta": shape.rope_theta, "factor": rs.factor}
        if rs.rope_type == "llama3":
            rope |= {"low_freq_factor": rs.low_freq_factor, "high_freq_factor": rs.high_freq_factor,
                     "original_max_position_embeddings": rs.original_max_position_embeddings}
    out: dict[str, Any] = {
        "architectures": [fam.architecture],
        "model_type": fam.model_type,
        "vocab_size": shape.vocab_size,
        "hidden_size": shape.dim,
        "intermediate_size": shape.ffn_dim,
        "num_hidden_layers": shape.n_layers,
        "num_attention_heads": shape.n_heads,
        "num_key_value_heads": shape.n_kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.max_positions or shape.seq_len,
        "rms_norm_eps": shape.norm_eps,
        "rope_theta": shape.rope_theta,
        "rope_parameters": rope,
        "tie_word_embeddings": shape.tie_embeddings,
        "attention_dropout": 0.0,
        "bos_token_id": None,
        "eos_token_id": None,
        "torch_dtype": dtype,
        "dtype": dtype,
    }
    if shape.rope_scaling is not None:
        out["rope_scaling"] = dict(rope)
    if fam.model_type in ("llama", "qwen3"):
        out["attention_bias"] = False
    if fam.model_type == "llama":
        out["mlp_bias"] = False
    if fam.sliding:
        out["sliding_window"] = shape.sliding_window
    else:
        out["use_sliding_window"] = False
    return out
