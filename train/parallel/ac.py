"""Activation checkpointing per transformer block: none, selective (op-level) or full.

full: recompute the whole block in backward (least memory, ~1/3 more compute).
selective: save the outputs of the expensive ops (matmuls, attention) and recompute the
cheap elementwise ones (norms, SiLU, RoPE) -- torchtitan's "op" SAC policy.
The wrapper's `_checkpoint_wrapped_module.` prefix is removed from state_dict keys by
CheckpointWrapper's own hooks, so checkpoints keep the unsplit model's names.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from train.model import Transformer

# Ops whose outputs are worth keeping: recomputing them costs FLOPs, not just bandwidth.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context() -> Any:  # (forward, recompute) contexts; torch leaves them untyped
    return create_selective_checkpoint_contexts(_policy)


def apply_ac(model: Transformer, mode: Literal["none", "selective", "full"]) -> None:
    """Wrap every block of `model.layers` in place (keys stay the layer indices)."""
    if mode == "none":
        return
    if mode not in ("selective", "full"):
        raise ValueError(f"activation_checkpoint={mode!r}; choose none, selective or full")
    for key, block in list(model.layers.items()):
        if mode == "full":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=_selective_context)
        model.layers[key] = wrapped
