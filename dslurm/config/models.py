"""Llama-style model shapes: named presets and the arithmetic on them.

Pure and torch-free, so the planner and the CLI can use it; the trainer builds the
torch module from the same `ModelShape`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


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

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def problems(self) -> list[str]:
        """What makes this shape unbuildable, with the numbers (empty when fine)."""
        out = []
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "seq_len"):
            if getattr(self, name) <= 0:
                out.append(f"{name}={getattr(self, name)} must be positive")
        if out:
            return out
        if self.dim % self.n_heads:
            out.append(f"dim({self.dim}) is not divisible by n_heads({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            out.append(f"n_heads({self.n_heads}) is not divisible by n_kv_heads({self.n_kv_heads})")
        if self.head_dim % 2:
            out.append(f"head_dim({self.head_dim}) must be even for RoPE")
        return out

    def num_params(self, *, include_embedding: bool = True) -> int:
        """Parameter count: untied input embedding and output projection, no biases."""
        d, kv = self.dim, self.n_kv_heads * self.head_dim
        attn = d * d + 2 * d * kv + d * d  # wq, wk, wv, wo
        mlp = 3 * d * self.ffn_dim  # SwiGLU: w1, w2, w3
        per_layer = attn + mlp + 2 * d  # two RMSNorm weights
        total = self.n_layers * per_layer + d + self.vocab_size * d  # final norm + output
        if include_embedding:
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
        return 6.0 * n + 12.0 * self.n_layers * self.n_heads * self.head_dim * t


PRESETS: dict[str, ModelShape] = {
    # Small enough for 8 CPU processes on 2 cores; dims divisible by tp in {1,2,4}.
    "tiny": ModelShape(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=192, vocab_size=256,
                       seq_len=64, rope_theta=10000.0),
    "small": ModelShape(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=768, vocab_size=256,
                        seq_len=256, rope_theta=10000.0),
    # Llama 3.2 1B, Llama 3 8B and 70B shapes.
    "1b": ModelShape(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
                     vocab_size=128256, seq_len=4096),
    "8b": ModelShape(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                     vocab_size=128256, seq_len=8192),
    "70b": ModelShape(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                      vocab_size=128256, seq_len=8192),
}


def shape_from(preset: str, **overrides: int | float | None) -> ModelShape:
    """A preset with the given fields replaced (None means "keep the preset's")."""
    base = PRESETS[preset]
    return replace(base, **{k: v for k, v in overrides.items() if v is not None})  # type: ignore[arg-type]
