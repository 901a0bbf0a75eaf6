"""Tensor parallel + sequence parallel + loss parallel via `parallelize_module`.

The plan is torchtitan's Llama plan: between blocks activations are sharded on the
sequence dim (Shard(1)); attention and feed-forward gather the sequence (Replicate), run
column-sharded input projections and row-sharded output projections that reduce-scatter
back to Shard(1). Norm weights become Replicate DTensors under SequenceParallel; without
SP they would stay plain tensors and `clip_grad_norm_` fails on mixed Tensor/DTensor
(reproduced here), so SP is not optional in this trainer.
With loss parallel the output projection keeps the logits vocab-sharded (Shard(-1)) and
cross-entropy runs under `torch.distributed.tensor.parallel.loss_parallel()`, so the full
(batch, seq, vocab) logits are never gathered.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from train.model import Transformer, TransformerBlock


def apply_tp(model: Transformer, tp_mesh: DeviceMesh, *, loss_parallel: bool = True) -> None:
    """Shard `model` (a full `Transformer` or a pipeline stage of one) over `tp_mesh` in place."""
    top: dict[str, Any] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if model.norm is not None:
        top["norm"] = SequenceParallel()
    if model.output is not None:
        top["output"] = ColwiseParallel(input_layouts=Shard(1),
                                        output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                        use_local_output=not loss_parallel)
    if top:
        parallelize_module(model, tp_mesh, top)
    if model.shape.tie_embeddings and model.tok_embeddings is not None and model.output is not None:
        # Each style made its own DTensor; both are Shard(0) over the vocabulary, so one can
        # serve as both again (the tie train/model.py made before sharding).
        model.output.weight = model.tok_embeddings.weight
    for block in model.layers.values():
        assert isinstance(block, TransformerBlock)  # TP comes first: no wrapper around the block yet
        qk_norm = {}
        if block.attention.q_norm is not None:
            # Qwen3's per-head norms see q/k with the heads (dim 2) split over tp: their weights
            # become Replicate DTensors whose gradients are summed over the tp ranks' heads.
            qk_norm = {f"attention.{n}": SequenceParallel(sequence_dim=2, use_local_output=True)
                       for n in ("q_norm", "k_norm")}
        parallelize_module(block, tp_mesh, {
            **qk_norm,
            "attention_norm": SequenceParallel(),
            # (x, rope): gather x's sequence shards; the rope table stays a plain tensor.
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None),
                                            desired_input_layouts=(Replicate(), None)),
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })
