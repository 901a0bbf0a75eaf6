"""Model FLOPs and MFU (seed 000 eq. 2.5; PaLM appendix B)."""

from __future__ import annotations

from dslurm.plan._check import count, positive

RECOMPUTE_FLOPS_FACTOR = 4.0 / 3.0
"""Full recomputation adds one forward (1/3 of forward+backward): executed, not model, FLOPs."""


def model_flops_per_token(*, params: float, layers: int, heads: int, head_dim: int,
                          seq_len: int) -> float:
    """Training FLOPs per token, PaLM-style: 6N + 12·L·H·Q·T.

    N counts the matmul parameters (exclude the input embedding, a lookup); the second term
    is the attention score and value matmuls. Recomputation is deliberately not counted, so
    MFU does not reward it.
    """
    positive("params", params)
    for name, v in (("layers", layers), ("heads", heads), ("head_dim", head_dim),
                    ("seq_len", seq_len)):
        count(name, v)
    return 6.0 * params + 12.0 * layers * heads * head_dim * seq_len


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Achieved model FLOP/s over the aggregate dense peak at the run precision.

    20,000 tokens/s × 120 GFLOP/token on 8 PFLOP/s → 0.30.
    """
    positive("tokens_per_s", tokens_per_s)
    positive("flops_per_token", flops_per_token)
    positive("peak_flops", peak_flops)
    return tokens_per_s * flops_per_token / peak_flops


def tokens_per_s_at(mfu_target: float, flops_per_token: float, peak_flops: float) -> float:
    """Throughput a given MFU implies (to turn a plan into an expected step time)."""
    positive("mfu", mfu_target)
    positive("flops_per_token", flops_per_token)
    positive("peak_flops", peak_flops)
    return mfu_target * peak_flops / flops_per_token
