"""Llama-style model shapes: named presets and the arithmetic on them.

Pure and torch-free, so the planner and the CLI can use it; the trainer builds the
torch module from the same `ModelShape`. The families a shape can describe (Llama, Mistral,
Qwen2, Qwen3: the fields after `norm_eps`) and how a Hugging Face config.json maps onto it
are in `dslurm.config.families`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class RopeScaling:
    """RoPE frequency scaling of a long-context model (config.json's rope_type and its numbers).

    llama3 (Llama 3.1-3.3): wavelengths below original/high_freq_factor keep their frequency,
    those above original/low_freq_factor are divided by `factor`, those between are blended;
    linear: every frequency divided by `factor`."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int
    seq_len: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    family: str = "llama"
    """config.json's model_type: llama, mistral, qwen2, qwen3 (dslurm.config.families)"""
    explicit_head_dim: int | None = None
    """head_dim when it is not dim / n_heads (Qwen3, Mistral Nemo); None: dim / n_heads"""
    qkv_bias: bool = False
    """q/k/v projections with a bias (Qwen2 / Qwen2.5)"""
    qk_norm: bool = False
    """RMSNorm over each query and key head before RoPE (Qwen3)"""
    tie_embeddings: bool = False
    """the output projection is the input embedding matrix (Llama 3.2 1B/3B, small Qwens)"""
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    """each query attends to at most this many keys, itself included (Mistral v0.1); None: all"""
    max_positions: int | None = None
    """config.json's max_position_embeddings (what an export writes back; seq_len is the training length)"""
    dtype: str | None = None
    """the published weights' dtype (config.json's torch_dtype): what `ckpt export --hf` writes by default"""

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.dim // self.n_heads

    def record(self) -> dict[str, Any]:
        """The shape as a checkpoint's meta.json records it: the fields added for the families
        only when they differ from their defaults, so a Llama saved before them compares equal."""
        out = dataclasses.asdict(self)
        for f in dataclasses.fields(self)[9:]:
            if getattr(self, f.name) == f.default:
                del out[f.name]
        return out

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> ModelShape:
        """The inverse of `record`."""
        rope = rec.get("rope_scaling")
        return cls(**{**rec, "rope_scaling": RopeScaling(**rope) if isinstance(rope, dict) else None})

    def problems(self) -> list[str]:
        """What makes this shape unbuildable, with the numbers (empty when fine)."""
        out = []
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "seq_len"):
            if getattr(self, name) <= 0:
                out.append(f"{name}={getattr(self, name)} must be positive")
        if out:
            return out
        if self.explicit_head_dim is None and self.dim % self.n_heads:
            out.append(f"dim({self.dim}) is not divisible by n_heads({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            out.append(f"n_heads({self.n_heads}) is not divisible by n_kv_heads({self.n_kv_heads})")
        if self.head_dim % 2:
            out.append(f"head_dim({self.head_dim}) must be even for RoPE")
        return out

    def layer_params(self, *, norms: bool = True) -> int:
        """Parameters of one transformer block (`norms=False`: without its RMSNorm weights, the
        ones tensor parallel replicates instead of splitting)."""
        d, q, kv = self.dim, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        attn = 2 * d * q + 2 * d * kv  # wq, wo, wk, wv
        attn += (q + 2 * kv) * self.qkv_bias
        mlp = 3 * d * self.ffn_dim  # SwiGLU: w1, w2, w3
        norm = 2 * d + 2 * self.head_dim * self.qk_norm  # two RMSNorm weights (+ Qwen3's q/k norms)
        return attn + mlp + (norm if norms else 0)

    def num_params(self, *, include_embedding: bool = True) -> int:
        """Parameter count. Without the embedding: what the matmuls use, so a tied output
        projection still counts (its matmul runs) while the input lookup does not."""
        d = self.dim
        total = self.n_layers * self.layer_params() + d + self.vocab_size * d  # final norm + output
        if include_embedding and not self.tie_embeddings:
            total += self.vocab_size * d
        return total

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token, PaLM appendix B: 6N + 12·L·H·Q·T.

        N excludes the input embedding (a lookup, no matmul); the attention term counts
        the score and value matmuls. No recomputation is counted: this is *model* FLOPs,
        so MFU does not reward activation checkpointing.
        """
        t = seq_len or self.seq_len
        n = self.num_params(include_embedding=False)
        return 6.0 * n + 12.0 * self.n_layers * self.n_heads * self.head_dim * self.attended(t)

    def attended(self, seq_len: int) -> float:
        """Mean keys a query attends to, over a causal sequence of seq_len, times 2 (the PaLM
        term counts the full square; a sliding window shortens it). seq_len without a window."""
        w = self.sliding_window
        if w is None or w >= seq_len:
            return float(seq_len)
        return 2.0 * (seq_len * w - w * (w - 1) / 2) / seq_len


PRESETS: dict[str, ModelShape] = {
    # Small enough for 8 CPU processes on 2 cores; dims divisible by tp in {1,2,4}.
    "tiny": ModelShape(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=256,
                       seq_len=64, rope_theta=10000.0),
    "small": ModelShape(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=256,
                        seq_len=256, rope_theta=10000.0),
    # Llama 3.2 1B, Llama 3 8B, 70B and 405B shapes.
    "1b": ModelShape(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                     vocab_size=128256, seq_len=4096),
    "8b": ModelShape(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                     vocab_size=128256, seq_len=8192),
    "70b": ModelShape(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                      vocab_size=128256, seq_len=8192),
    "405b": ModelShape(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248,
                       vocab_size=128256, seq_len=8192),
}


def shape_from(preset: str, **overrides: int | float | None) -> ModelShape:
    """A preset with the given fields replaced (None means "keep the preset's")."""
    base = PRESETS[preset]
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})  # type: ignore[arg-type]
