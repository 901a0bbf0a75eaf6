"""A Llama-style decoder built from `dslurm.config.models.ModelShape`.

RMSNorm, rotary position embeddings (RoPE), SwiGLU feed-forward and grouped-query
attention (what `ModelShape.num_params` counts). The families of dslurm/config/families.py
differ only in a few switches of the shape: q/k/v biases (Qwen2), an RMSNorm on each q/k head
before RoPE (Qwen3), Llama 3.1's scaled RoPE frequencies, a sliding attention window (Mistral),
a tied output projection. Written for the parallel wrappers in `train/parallel/`:

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
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dslurm.config.models import ModelShape, RopeScaling


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


def rope_freqs(head_dim: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """The inverse frequencies, scaled as transformers' modeling_rope_utils does for rope_type
    llama3 (long wavelengths slowed by `factor`, a smooth blend between) and linear."""
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return freqs
    if scaling.rope_type == "linear":
        return freqs / scaling.factor
    old, factor = scaling.original_max_position_embeddings, scaling.factor
    low_wavelen, high_wavelen = old / scaling.low_freq_factor, old / scaling.high_freq_factor
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_wavelen, freqs / factor, freqs)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def rope_cache(head_dim: int, seq_len: int, theta: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """cos/sin table of shape (seq_len, head_dim // 2, 2) for interleaved-pair RoPE.

    Real-valued rather than complex: complex tensors do not mix well with DTensor and
    torch.compile, and a real table is trivially sliced per sequence shard.
    """
    freqs = rope_freqs(head_dim, theta, scaling)
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


class SeqShard(Protocol):
    """A context-parallel rank's share of the sequence (train/parallel/cp.py `ContextShard`)."""

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """global positions of this rank's tokens"""

    def key_positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """global positions of the gathered keys, in the order `gather` returns them"""

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """every rank's (batch, local_len, ...) shard along dim 1 (autograd: backward reduce-scatters)"""


class Attention(nn.Module):
    """Causal grouped-query attention: n_kv_heads key/value heads shared by n_heads queries.
    A sliding window (Mistral) and the documents of a packed sequence (`docs`: (batch, seq)
    document ids) narrow the keys each query sees (`attention_mask`); the mask is built here,
    where the sequence is whole even under sequence parallel. Under context parallel (`cp` set by
    train/parallel/cp.py) x holds this rank's chunks of the sequence: RoPE and the mask take each
    query's and key's global position, and the keys and values of the whole sequence are gathered."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.head_dim = shape.head_dim
        self.n_rep = shape.n_heads // shape.n_kv_heads
        kv = shape.n_kv_heads * shape.head_dim
        self.wq = nn.Linear(shape.dim, shape.n_heads * shape.head_dim, bias=shape.qkv_bias)
        self.wk = nn.Linear(shape.dim, kv, bias=shape.qkv_bias)
        self.wv = nn.Linear(shape.dim, kv, bias=shape.qkv_bias)
        self.wo = nn.Linear(shape.n_heads * shape.head_dim, shape.dim, bias=False)
        # Qwen3: each head's q and k normalised over head_dim before RoPE (weights in the
        # interleaved-pair order of the rows they scale: dslurm/checkpoint/hf_layout.py).
        self.q_norm = RMSNorm(shape.head_dim, shape.norm_eps) if shape.qk_norm else None
        self.k_norm = RMSNorm(shape.head_dim, shape.norm_eps) if shape.qk_norm else None
        self.window = shape.sliding_window
        self.cp: SeqShard | None = None

    def forward(self, x: torch.Tensor, rope: torch.Tensor, docs: torch.Tensor | None = None) -> torch.Tensor:
        bs, seq, _ = x.shape
        q_pos = k_pos = None
        if self.cp is not None:
            q_pos, k_pos = self.cp.positions(seq, x.device), self.cp.key_positions(seq, x.device)
            rope = rope[q_pos]
        full = seq if k_pos is None else len(k_pos)
        mask = attention_mask(full, self.window, docs, x.device, q_pos=q_pos, k_pos=k_pos)
        # -1 heads: under TP each rank holds n_heads/tp query and n_kv_heads/tp kv heads.
        q = self.wq(x).view(bs, seq, -1, self.head_dim)
        k = self.wk(x).view(bs, seq, -1, self.head_dim)
        v = self.wv(x).view(bs, seq, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, rope), apply_rope(k, rope)
        if self.cp is not None:  # before repeat_interleave: gather n_kv_heads, not n_heads
            k, v = self.cp.gather(k), self.cp.gather(v)
        # Repeat kv heads so each query head has its group's kv (consecutive query heads
        # share one kv head; TP column shards keep whole groups because tp | n_kv_heads).
        k = k.repeat_interleave(self.n_rep, dim=2)
        v = v.repeat_interleave(self.n_rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             attn_mask=mask, is_causal=mask is None)
        y: torch.Tensor = self.wo(out.transpose(1, 2).reshape(bs, seq, -1))
        return y


def attention_mask(seq: int, window: int | None, docs: torch.Tensor | None = None,
                   device: torch.device | str = "cpu", *, q_pos: torch.Tensor | None = None,
                   k_pos: torch.Tensor | None = None) -> torch.Tensor | None:
    """The keys each query may see (True), or None for plain causal attention: causal, within
    `window` positions (q - k < window, as transformers' sliding_window), and with `docs`
    (batch, seq) document ids of a packed sequence, inside its own document only. `seq` is the
    whole sequence; `q_pos`/`k_pos` (context parallel): the global positions of the queries and
    keys present, in their order (default: all of them, in order)."""
    if q_pos is None and k_pos is None and (window is None or window >= seq) and docs is None:
        return None
    qi = torch.arange(seq, device=device) if q_pos is None else q_pos
    ki = torch.arange(seq, device=device) if k_pos is None else k_pos
    mask = qi[:, None] >= ki[None, :]
    if window is not None and window < seq:
        mask = mask & (qi[:, None] - ki[None, :] < window)
    if docs is None:
        return mask
    dq = docs if q_pos is None else docs[:, q_pos]
    dk = docs if k_pos is None else docs[:, k_pos]
    return (mask & (dq[:, :, None] == dk[:, None, :]))[:, None]


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return y


class TransformerBlock(nn.Module):
    """Pre-norm residual block: x + attn(norm(x)), then + ffn(norm(.))."""

    def __init__(self, shape: ModelShape, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention = Attention(shape)
        self.feed_forward = FeedForward(shape.dim, shape.ffn_dim)
        self.attention_norm = RMSNorm(shape.dim, shape.norm_eps)
        self.ffn_norm = RMSNorm(shape.dim, shape.norm_eps)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, docs: torch.Tensor | None = None) -> torch.Tensor:
        # docs as a keyword: TP's PrepareModuleInput lays out the positional (x, rope) only
        h = x + self.attention(self.attention_norm(x), rope, docs=docs)
        y: torch.Tensor = h + self.feed_forward(self.ffn_norm(h))
        return y


class Transformer(nn.Module):
    """The decoder. `forward(tokens) -> logits` on the full model; on a pipeline stage
    without embedding (or output) it takes (or returns) hidden states."""

    rope: torch.Tensor  # a buffer (register_buffer below): declared for the type checker

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.shape = shape
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(shape.vocab_size, shape.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(shape, i) for i in range(shape.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(shape.dim, shape.norm_eps)
        self.output: nn.Linear | None = nn.Linear(shape.dim, shape.vocab_size, bias=False)
        if shape.tie_embeddings:  # one Parameter in two modules (pp 1 only: dslurm/config/layout.py)
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: derived from the shape, so it never enters a checkpoint.
        self.register_buffer("rope", self._rope(), persistent=False)
        # Documents of packed instruction data, one per microbatch of a pipeline step, and the
        # microbatch being run: how they reach a stage, whose forward the schedule calls with
        # hidden states only (train/parallel/pp.py sets `chunk`; its shape inference runs a
        # forward outside any microbatch, which must take none).
        self.chunk_docs: list[torch.Tensor] | None = None
        self.chunk: int | None = None
        self.init_weights()

    def _rope(self) -> torch.Tensor:
        s = self.shape
        return rope_cache(s.head_dim, s.seq_len, s.rope_theta, s.rope_scaling)

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
                elif name.endswith("bias"):
                    nn.init.zeros_(p)
                else:
                    std = std_out if name.endswith(("wo.weight", "w2.weight")) else 0.02
                    nn.init.trunc_normal_(p, std=std, a=-3 * std, b=3 * std)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not self.shape.tie_embeddings:
            std = self.shape.dim ** -0.5
            nn.init.trunc_normal_(self.output.weight, std=std, a=-3 * std, b=3 * std)
        with torch.no_grad():
            self.rope.copy_(self._rope())

    def forward(self, tokens: torch.Tensor, docs: torch.Tensor | None = None) -> torch.Tensor:
        """`docs` (batch, seq): the example id of every position of packed sequences (attention stays
        inside an example); None takes the running microbatch's of `chunk_docs`, if any."""
        if docs is None and self.chunk is not None and self.chunk_docs:
            docs = self.chunk_docs[self.chunk]
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.rope, docs=docs)
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
