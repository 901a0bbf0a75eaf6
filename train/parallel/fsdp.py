"""FSDP2 (`fully_shard`) per block and at the root; HSDP when dp_replicate > 1.

The mesh is the data-parallel part of the world mesh: 1-D `dp_shard` for FSDP, 2-D
(`dp_replicate`, `dp_shard`) for HSDP (replicate across the first dim, shard within the
second). With TP the parameters are already DTensors on the tp mesh and FSDP2 composes
them into 2-D (dp_shard, tp) DTensors.

Mixed precision: on GPU with dtype bf16, parameters are all-gathered and computed in bf16
while gradients are reduced in fp32 (the reduction is where bf16 loses the most); on CPU
everything stays fp32 (bf16 matmuls on CPU are slow and `dslurm.config.resolve` refuses them).
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from train.model import Transformer


def mp_policy(dtype: str, device_type: str) -> MixedPrecisionPolicy:
    """bf16 params + fp32 reduce on GPU when asked for bf16, fp32 otherwise."""
    if dtype == "bf16" and device_type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32)


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, *, dtype: str = "fp32", device_type: str = "cpu",
               pp_enabled: bool = False) -> None:
    """Shard each block, then the root (embedding, final norm, output) in place.

    With PP (or a shard group of one), parameters stay unsharded after forward: the schedule runs several microbatch
    forwards before their backwards and would otherwise all-gather every block per
    microbatch (torchtitan does the same).
    """
    policy = mp_policy(dtype, device_type)
    # Resharding frees memory only when there is more than one shard; on a shard group of one
    # it would just redo the (copying) all-gather in backward.
    reshard = not pp_enabled and dp_mesh.size(dp_mesh.ndim - 1) > 1
    blocks = list(model.layers.values())
    for i, block in enumerate(blocks):
        # The last block's parameters are needed again at once by backward: keep them.
        fully_shard(block, mesh=dp_mesh, mp_policy=policy,
                    reshard_after_forward=reshard and i < len(blocks) - 1)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy, reshard_after_forward=reshard)
