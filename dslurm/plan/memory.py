"""Training memory per GPU: persistent state, its ZeRO/FSDP splits, and activations.

Seed 000, eq. 2.1: M_train ≈ P·(b_w + b_g + b_master + b_opt) + A. The byte layout is a
parameter because mixed-precision recipes differ; the default is the seed's BF16 weights
and gradients, FP32 master weights and two FP32 Adam moments (2+2+4+8 = 16 B/param).
Sizes are in bytes; GB means 1e9 bytes (decimal, as in the seeds).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dslurm.errors import UserError
from dslurm.plan._check import count, non_negative, positive

GB = 1e9

Sharding = Literal["ddp", "zero1", "zero2", "zero3", "fsdp"]
Recompute = Literal["none", "selective", "full"]
SHARDINGS: tuple[str, ...] = ("ddp", "zero1", "zero2", "zero3", "fsdp")
RECOMPUTES: tuple[str, ...] = ("none", "selective", "full")


@dataclass(kw_only=True, slots=True)
class ByteLayout:
    """Bytes per parameter of each persistent training tensor."""

    weights: float = 2.0
    """Compute copy of the weights (BF16)."""
    grads: float = 2.0
    """Gradients (BF16)."""
    master: float = 4.0
    """FP32 master weights the optimizer updates, so small steps do not round away."""
    optimizer: float = 8.0
    """Optimizer state: Adam's two FP32 moments."""
    gathered: float = 2.0
    """Bytes per value of the weights FSDP all-gathers for compute (and of the unsharded gradients
    before their reduction): the compute dtype, held only while a unit runs."""

    def __post_init__(self) -> None:
        for name in ("weights", "grads", "master", "optimizer", "gathered"):
            non_negative(f"bytes.{name}", getattr(self, name))

    @property
    def total(self) -> float:
        """Bytes per parameter of all persistent state (16 for the default layout)."""
        return self.weights + self.grads + self.master + self.optimizer


@dataclass(kw_only=True, slots=True)
class StateBytes:
    """Persistent state held by one rank, split by kind (bytes)."""

    weights: float
    grads: float
    master: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.weights + self.grads + self.master + self.optimizer


def trainer_bytes(dtype: str) -> ByteLayout:
    """What this project's trainer keeps per parameter (train/parallel/fsdp.py, train/optim.py),
    measured by `dslurm plan check`: FSDP2 shards the FP32 parameters themselves (they are the
    master copy: no persistent 16-bit weights), gradients stay FP32 (reduce_dtype float32), AdamW
    keeps two FP32 moments; with bf16 the weights are all-gathered in bf16 for compute."""
    return ByteLayout(weights=0.0, grads=4.0, master=4.0, optimizer=8.0,
                      gathered=2.0 if dtype == "bf16" else 4.0)


def persistent_state(params: float, layout: ByteLayout | None = None) -> StateBytes:
    """Full (unsharded) persistent state of a model with `params` parameters."""
    positive("params", params)
    b = layout or ByteLayout()
    return StateBytes(weights=params * b.weights, grads=params * b.grads,
                      master=params * b.master, optimizer=params * b.optimizer)


def train_memory(params: float, activations: float, layout: ByteLayout | None = None) -> float:
    """Eq. 2.1: persistent state plus activations (bytes). 8B + 40 GB → 168 GB."""
    non_negative("activations", activations)
    return persistent_state(params, layout).total + activations


def sharded_state(params: float, ranks: int, sharding: Sharding = "fsdp",
                  layout: ByteLayout | None = None) -> StateBytes:
    """Persistent state per rank when `ranks` data-parallel ranks shard it (seed 000, 2.4).

    ZeRO-1 shards master weights and optimizer state, ZeRO-2 also gradients, ZeRO-3 (and
    FSDP full sharding) also the weights. These are ideal subtotals: temporary all-gather
    buffers and allocator reserve come on top.
    """
    count("ranks", ranks)
    if sharding not in SHARDINGS:
        raise UserError(f"sharding={sharding!r} is unknown; choose one of {', '.join(SHARDINGS)}")
    full = persistent_state(params, layout)
    level = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3, "fsdp": 3}[sharding]
    return StateBytes(
        weights=full.weights / (ranks if level >= 3 else 1),
        grads=full.grads / (ranks if level >= 2 else 1),
        master=full.master / (ranks if level >= 1 else 1),
        optimizer=full.optimizer / (ranks if level >= 1 else 1),
    )


def activation_bytes_per_layer(*, seq_len: int, micro_batch: int, dim: int, ffn_dim: int,
                               n_heads: int, kv_dim: int | None = None, tp: int = 1,
                               recompute: Recompute = "none", flash_attention: bool = True,
                               gated_mlp: bool = True, bytes_per_value: float = 2.0) -> float:
    """Activations one pre-norm transformer block keeps for backward, per GPU (bytes).

    Counted per token, 16-bit: both norm inputs and outputs (4h), q/k/v (h + 2kv), the
    attention output (h), and in the MLP two ffn-wide tensors (GELU input and output) or
    three for SwiGLU (w1 and w3 outputs, their product): s·b·(12h + 4kv + 4f or 6f). For a
    GPT block (kv = h, f = 4h, GELU) that is 32·s·b·h: Korthikanti et al.'s 34·s·b·h
    (arXiv 2205.05198) less the two 1-byte dropout masks Llama-style models do not have.
    Without flash attention the softmax output adds 2·a·s²·b. Tensor parallelism with
    sequence parallelism divides everything by tp. "selective" recomputes the attention
    core (its s² term), so it equals "none" under flash attention; "full" keeps only the
    block input, 2·s·b·h.
    """
    for name, v in (("seq_len", seq_len), ("micro_batch", micro_batch), ("dim", dim),
                    ("ffn_dim", ffn_dim), ("n_heads", n_heads), ("tp", tp)):
        count(name, v)
    kv = dim if kv_dim is None else count("kv_dim", kv_dim)
    if recompute not in RECOMPUTES:
        raise UserError(f"recompute={recompute!r} is unknown; choose one of {', '.join(RECOMPUTES)}")
    positive("bytes_per_value", bytes_per_value)
    tokens = seq_len * micro_batch
    if recompute == "full":
        return bytes_per_value * tokens * dim / tp
    per_token = bytes_per_value / 2.0 * (12 * dim + 4 * kv + (6 if gated_mlp else 4) * ffn_dim)
    stored = tokens * per_token
    if not flash_attention and recompute == "none":
        stored += bytes_per_value * n_heads * seq_len * seq_len * micro_batch
    return stored / tp


def recompute_memory(*, layers: int, per_layer_bytes: float, layer_input_bytes: float) -> float:
    """Peak activations under full recomputation: every layer's input plus one rebuilt layer.

    Seed 000, 2.4: 32 × 0.3 GB of inputs + 5 GB rebuilt ≈ 15 GB instead of 32 × 5 = 160 GB.
    """
    count("layers", layers)
    non_negative("per_layer_bytes", per_layer_bytes)
    non_negative("layer_input_bytes", layer_input_bytes)
    return layers * layer_input_bytes + per_layer_bytes


def activation_bytes(*, layers: int, recompute: Recompute = "none", **shape: int | float | bool) -> float:
    """Activations of a stack of `layers` blocks per GPU (bytes); `shape` as for the per-layer estimate.

    Under full recomputation one block is rebuilt at a time during backward, so its full
    activations are added once on top of the stored inputs.
    """
    count("layers", layers)
    full = activation_bytes_per_layer(recompute="none", **shape)  # type: ignore[arg-type]
    if recompute == "full":
        kept = activation_bytes_per_layer(recompute="full", **shape)  # type: ignore[arg-type]
        return recompute_memory(layers=layers, per_layer_bytes=full, layer_input_bytes=kept)
    return layers * activation_bytes_per_layer(recompute=recompute, **shape)  # type: ignore[arg-type]


def logits_bytes(*, seq_len: int, micro_batch: int, vocab_size: int, tp: int = 1) -> float:
    """FP32 logits of the output layer (kept for the loss's backward), per GPU.

    With a 128k vocabulary this is several GB at sequence 8192: a term the per-layer
    formula misses. Loss-parallel TP splits it over the vocabulary.
    """
    for name, v in (("seq_len", seq_len), ("micro_batch", micro_batch),
                    ("vocab_size", vocab_size), ("tp", tp)):
        count(name, v)
    return 4.0 * seq_len * micro_batch * vocab_size / tp
