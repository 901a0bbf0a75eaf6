"""A Llama-style decoder built from `dslurm.config.models.ModelShape`.

RMSNorm, rotary position embeddings (RoPE), SwiGLU feed-forward and grouped-query
attention, with untied input embedding and output projection (what `ModelShape.num_params`
counts). Written for the parallel wrappers in `train/parallel/`:

- layers live in a `ModuleDict` keyed by the layer index ("0", "1", ...), so a pipeline
  stage can delete the layers it does not own and the remaining parameter names are those
  of the unsplit model (DCP reshards across PP layouts by name);
- `tok_embeddings`, `norm` and `output` may be set to None on a pipeline stage that does not
  hold them; `forward` then takes/returns hidden states instead of tokens/logits;
- attention infers its local head count from the projection output, so the same code runs
  on a tensor-parallel shard (wq/wk/wv column-sharded: n_heads/tp heads per rank).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dslurm.config.models import ModelShape


class RMSNorm(nn.Module):
    """Root-mean-square norm (no mean subtraction, no bias), computed in fp32 for stability."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_cache(head_dim: int, seq_len: int, theta: float) -> torch.Tensor:
    """cos/sin table of shape (seq_len, head_dim // 2, 2) for interleaved-pair RoPE.

    Real-valued rather than complex: complex tensors do not mix well with DTensor and
    torch.compile, and a real table is trivially sliced per sequence shard.
    """
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x (batch, seq, heads, head_dim) by the cached angles."""
    xf = x.float().unflatten(-1, (-1, 2))
    cos = rope[: x.shape[1], :, 0].unsqueeze(1)  # (seq, 1, head_dim/2): broadcast over heads
    sin = rope[: x.shape[1], :, 1].unsqueeze(1)
    a, b = xf[..., 0], xf[..., 1]
    out = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    """Causal grouped-query attention: n_kv_heads key/value heads shared by n_heads queries."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.head_dim = shape.head_dim
        self.n_rep = shape.n_heads // shape.n_kv_heads
        kv = shape.n_kv_heads * shape.head_dim
        self.wq = nn.Linear(shape.dim, shape.n_heads * shape.head_dim, bias=False)
        self.wk = nn.Linear(shape.dim, kv, bias=False)
        self.wv = nn.Linear(shape.dim, kv, bias=False)
        self.wo = nn.Linear(shape.n_heads * shape.head_dim, shape.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        bs, seq, _ = x.shape
        # -1 heads: under TP each rank holds n_heads/tp query and n_kv_heads/tp kv heads.
        q = self.wq(x).view(bs, seq, -1, self.head_dim)
        k = self.wk(x).view(bs, seq, -1, self.head_dim)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        # Repeat kv heads so each query head has its group's kv (consecutive query heads
        # share one kv head; TP column shards keep whole groups because tp | n_kv_heads).
        k = k.repeat_interleave(self.n_rep, dim=2)
        v = v.repeat_interleave(self.n_rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(bs, seq, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + ffn(norm(.))."""

    def __init__(self, shape: ModelShape, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(shape)
        self.feed_forward = FeedForward(shape.dim, shape.ffn_dim)
        self.attention_norm = RMSNorm(shape.dim, shape.norm_eps)
        self.ffn_norm = RMSNorm(shape.dim, shape.norm_eps)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """The decoder. `forward(tokens) -> logits` on the full model; on a pipeline stage
    without embedding (or output) it takes (or returns) hidden states."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.shape = shape
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(shape.vocab_size, shape.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(shape, i) for i in range(shape.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(shape.dim, shape.norm_eps)
        self.output: nn.Linear | None = nn.Linear(shape.dim, shape.vocab_size, bias=False)
        # Not persistent: derived from the shape, so it never enters a checkpoint.
        self.register_buffer("rope", rope_cache(shape.head_dim, shape.seq_len, shape.rope_theta),
                             persistent=False)
        self.init_weights()

    def init_weights(self) -> None:
        """Deterministic init given the torch seed (normal 0.02, depth-scaled output projections,
        as in GPT-2/Llama reference code, so the residual stream does not grow with depth)."""
        std_out = 0.02 / math.sqrt(2 * self.shape.n_layers)
        if self.tok_embeddings is not None:
            nn.init.normal_(self.tok_embeddings.weight, std=1.0)
        for block in self.layers.values():
            for name, p in block.named_parameters():
                if name.endswith("norm.weight"):
                    nn.init.ones_(p)
                else:
                    std = std_out if name.endswith(("wo.weight", "w2.weight")) else 0.02
                    nn.init.trunc_normal_(p, std=std, a=-3 * std, b=3 * std)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None:
            std = self.shape.dim ** -0.5
            nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)
        with torch.no_grad():
            self.rope.copy_(rope_cache(self.shape.head_dim, self.shape.seq_len, self.shape.rope_theta))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h


def build_model(shape: ModelShape, seed: int, device: str | torch.device = "cpu") -> Transformer:
    """The full model, initialised from `seed` so every rank (and every layout) starts from
    the same weights. On the meta device nothing is allocated: the caller shards, then calls
    `to_empty(device=...)` and `init_weights()`."""
    torch.manual_seed(seed)
    with torch.device(device):
        return Transformer(shape)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over all tokens. Works on DTensor logits under `loss_parallel()`."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
