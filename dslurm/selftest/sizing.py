"""Size the self-check's Llama from the device's memory, with the planner's arithmetic
(dslurm/plan/memory.py). Pure: the memory, the disk budget and the base shape come in as numbers.

Layers first: the persistent state (weights, gradients, master copy, Adam) may take `state_share`
of the budget and its checkpoint must fit `max_saved_bytes` (the DCP part writes it several times
to the same disk, so the disk and the 8-minute bound cap it). Then the micro-batch: the largest one
whose activations and logits fill the rest of `fill` x memory. A model that fills the memory with
activations keeps the matmuls large (what MFU measures) without writing 100 GB checkpoints.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from dslurm.config.models import ModelShape
from dslurm.errors import UserError
from dslurm.plan.memory import ByteLayout, activation_bytes, logits_bytes, persistent_state

BF16_WORLD_OF_ONE = ByteLayout(weights=2.0, grads=4.0, master=4.0, optimizer=8.0)
"""FSDP2 on a shard group of one with bf16 mixed precision (train/parallel/fsdp.py): the bf16
compute copy stays gathered (no resharding on one shard), gradients are reduced in fp32, the
parameters are fp32, Adam keeps two fp32 moments."""
FP32 = ByteLayout(weights=0.0, grads=4.0, master=4.0, optimizer=8.0)
"""CPU (fp32 throughout): the parameters are the compute copy."""
LOGITS_COPIES = 4.0
"""fp32-sized copies of the logits alive at the loss's peak: its fp32 upcast, the log-softmax it
keeps for backward, their gradient, and the bf16 matmul output with its gradient (half each)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Sizing:
    """The model and micro-batch chosen, with the planned bytes behind the choice."""

    shape: ModelShape
    micro_batch: int
    memory_bytes: float
    """the device memory the plan fills"""
    state_bytes: float
    activation_bytes: float
    logits_bytes: float
    saved_bytes: float
    """what one DCP save of the training state writes: the fp32 parameters and Adam's moments"""

    @property
    def planned_bytes(self) -> float:
        return self.state_bytes + self.activation_bytes + self.logits_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["params"] = self.shape.num_params()
        d["planned_bytes"] = self.planned_bytes
        d["planned_fraction"] = self.planned_bytes / self.memory_bytes
        return d


def saved_bytes(shape: ModelShape, layout: ByteLayout) -> float:
    """Bytes a checkpoint of the training state holds (master weights + optimizer state)."""
    s = persistent_state(shape.num_params(), layout)
    return s.master + s.optimizer


def planned(shape: ModelShape, micro_batch: int, layout: ByteLayout, *, bytes_per_value: float,
            recompute: str = "selective") -> tuple[float, float, float]:
    """(persistent state, activations, logits) in bytes for one process holding the whole model."""
    act = activation_bytes(layers=shape.n_layers, recompute=recompute,  # type: ignore[arg-type]
                           seq_len=shape.seq_len, micro_batch=micro_batch, dim=shape.dim,
                           ffn_dim=shape.ffn_dim, n_heads=shape.n_heads,
                           kv_dim=shape.n_kv_heads * shape.head_dim, bytes_per_value=bytes_per_value)
    logits = LOGITS_COPIES * logits_bytes(seq_len=shape.seq_len, micro_batch=micro_batch,
                                          vocab_size=shape.vocab_size)
    return persistent_state(shape.num_params(), layout).total, act, logits


def size_model(memory_bytes: float, *, base: ModelShape, layout: ByteLayout, bytes_per_value: float,
               fill: float = 0.8, state_share: float = 0.4, max_saved_bytes: float | None = None,
               max_micro_batch: int = 256, recompute: str = "selective") -> Sizing:
    """The deepest model (up to base.n_layers) whose state fits, then the largest micro-batch."""
    if not 0 < fill <= 1 or not 0 < state_share <= 1:
        raise ValueError(f"fill={fill} and state_share={state_share} must be in (0, 1]")
    budget = fill * memory_bytes
    layers = 0
    for n in range(1, base.n_layers + 1):
        shape = replace(base, n_layers=n)
        state = persistent_state(shape.num_params(), layout).total
        too_big = max_saved_bytes is not None and saved_bytes(shape, layout) > max_saved_bytes
        if state > state_share * budget or too_big:
            break
        layers = n
    if layers == 0:
        raise UserError(f"selftest: {memory_bytes / 1e9:.1f} GB of device memory (or a checkpoint budget of "
                        f"{(max_saved_bytes or 0) / 1e9:.1f} GB) holds no layer of a dim-{base.dim} model. "
                        "Fix: free GPU memory or disk space (--dir on a larger disk)")
    shape = replace(base, n_layers=layers)
    best = None
    for mb in range(1, max_micro_batch + 1):
        state, act, logits = planned(shape, mb, layout, bytes_per_value=bytes_per_value, recompute=recompute)
        if state + act + logits > budget:
            break
        best = Sizing(shape=shape, micro_batch=mb, memory_bytes=memory_bytes, state_bytes=state,
                      activation_bytes=act, logits_bytes=logits, saved_bytes=saved_bytes(shape, layout))
    if best is None:
        raise UserError(f"selftest: {memory_bytes / 1e9:.1f} GB of device memory does not hold one sequence of "
                        f"{base.seq_len} tokens on a {layers}-layer dim-{base.dim} model. Fix: free GPU memory")
    return best
