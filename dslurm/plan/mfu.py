"""Model FLOPs and MFU (seed 000 eq. 2.5; PaLM appendix B)."""

from __future__ import annotations

from dslurm.errors import UserError
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


def recompute_flops_per_token(*, params: float, layers: int, heads: int, head_dim: int, seq_len: int,
                              recompute: str) -> float:
    """Arithmetic per token that recomputation adds on top of `model_flops_per_token`.

    "full" re-runs every block's forward in backward: the forward third of 6N + 12·L·H·Q·T,
    i.e. 2N + 4·L·H·Q·T (so executed = 4/3 × model FLOPs, `RECOMPUTE_FLOPS_FACTOR`).
    "selective" here is the trainer's op-level policy (train/parallel/ac.py: it saves matmul and
    attention outputs, recomputes norms, activations and RoPE): no matmul is re-run, so 0 counted
    FLOPs. (Korthikanti et al.'s selective recomputation, which re-runs the attention core, would
    add 4·L·H·Q·T.) "none": 0. Flash attention's own recomputation of the scores inside its
    backward kernel is counted by no one, as in PaLM.
    """
    if recompute not in ("none", "selective", "full"):
        raise UserError(f"recompute={recompute!r} is unknown; choose one of none, selective, full")
    if recompute != "full":
        return 0.0
    return model_flops_per_token(params=params, layers=layers, heads=heads, head_dim=head_dim,
                                 seq_len=seq_len) / 3.0


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


def conversion(*, model_flops: float, extra_flops: float, gpus: int, peak_tflops: float, bubble: float,
               tokens_per_step: float, tokens_per_s: float | None = None,
               targets: tuple[float, ...] = (0.3, 0.4, 0.5)) -> dict[str, object]:
    """tokens/s ↔ MFU for one run: what each MFU target means in tokens/s and step time, what
    1,000 tokens/s is worth, the ceiling, and (given `tokens_per_s`) the MFU and HFU of it.

    MFU counts model FLOPs only (`model_flops`, per token); HFU counts what the GPUs execute,
    recomputation included (`model_flops + extra_flops`). Even at peak arithmetic, a GPU idles
    in the pipeline bubble and spends `extra_flops` on recomputation, so
    MFU ≤ (1 − bubble) × model / (model + extra): the ceiling.
    """
    positive("model_flops", model_flops)
    count("gpus", gpus)
    positive("peak_tflops", peak_tflops)
    positive("tokens_per_step", tokens_per_step)
    if extra_flops < 0 or not 0 <= bubble < 1:
        raise UserError(f"extra_flops={extra_flops} must be >= 0 and bubble={bubble} in [0, 1)")
    peak = gpus * peak_tflops * 1e12
    executed = model_flops + extra_flops
    out: dict[str, object] = {
        "model_flops_per_token": model_flops, "executed_flops_per_token": executed, "peak_flops": peak,
        "mfu_per_1000_tokens_per_s": mfu(1000.0, model_flops, peak),
        "mfu_ceiling": (1.0 - bubble) * model_flops / executed,
        "at": [{"mfu": t, "tokens_per_s": tokens_per_s_at(t, model_flops, peak),
                "step_s": tokens_per_step / tokens_per_s_at(t, model_flops, peak)} for t in targets]}
    if tokens_per_s is not None:
        out["measured"] = {"tokens_per_s": tokens_per_s, "mfu": mfu(tokens_per_s, model_flops, peak),
                           "hfu": mfu(tokens_per_s, executed, peak)}
    return out
