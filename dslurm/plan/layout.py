"""Memory per GPU of a parallel layout, and the choice of layout.

Seed 000 table 2.2: "parallelism selection begins with the resource that does not fit".
The search tries layouts from the cheapest communication upward and keeps the first that
fits: no pipeline before a pipeline (bubbles), small tensor parallelism inside the NVLink
domain before large (per-layer collectives), no recomputation before full recomputation
(+1/3 arithmetic), and the smallest data-parallel shard group that fits (DDP, then HSDP,
then FSDP over all ranks), because wider shard groups all-gather over slower links.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dslurm.config.layout import Layout, stages_per_rank
from dslurm.config.models import ModelShape
from dslurm.errors import UserError
from dslurm.plan._check import count, fraction, non_negative, positive
from dslurm.plan.memory import GB, RECOMPUTES, ByteLayout, activation_bytes_per_layer, logits_bytes
from dslurm.plan.pipeline import SCHEDULES, logits_in_flight, microbatches_for_bubble, stage_in_flight


@dataclass(kw_only=True, slots=True)
class Cluster:
    """What the job runs on."""

    nodes: int
    """Whole nodes in the allocation."""
    gpus_per_node: int = 8
    """GPUs (training processes) per node."""
    gpu_mem_gb: float = 80.0
    """Memory of one GPU (decimal GB)."""
    nvlink_domain: int | None = None
    """GPUs sharing one NVLink/NVSwitch domain; None = one node."""
    peak_tflops: float = 0.0
    """Dense BF16 peak per GPU (TFLOP/s) for MFU; 0 = unknown."""
    intra_gbytes_per_s: float = 0.0
    """Bus bandwidth of one GPU inside its NVLink domain / node (GB/s); 0 = unknown."""
    inter_gbytes_per_s: float = 0.0
    """Bandwidth of one node to the others (GB/s), shared by its GPUs; 0 = unknown."""
    memory_note: str = ""
    """Where gpu_mem_gb came from when it is not a GPU's (a CPU site: the node's memory per process)."""

    def __post_init__(self) -> None:
        count("nodes", self.nodes)
        count("gpus_per_node", self.gpus_per_node)
        positive("gpu_mem_gb", self.gpu_mem_gb)
        non_negative("peak_tflops", self.peak_tflops)
        non_negative("intra_gbytes_per_s", self.intra_gbytes_per_s)
        non_negative("inter_gbytes_per_s", self.inter_gbytes_per_s)
        if self.nvlink_domain is None:
            self.nvlink_domain = self.gpus_per_node
        count("nvlink_domain", self.nvlink_domain)

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(kw_only=True, slots=True)
class Workload:
    """The per-step shape of the training work and the memory rules."""

    micro_batch: int = 1
    """Sequences per GPU per forward pass."""
    seq_len: int | None = None
    """Tokens per sequence; None = the model's own."""
    global_batch: int | None = None
    """Sequences per optimizer step; bounds data parallelism when given."""
    microbatches: int | None = None
    """Pipeline microbatches per schedule step; None = from the global batch, or a ≤10% bubble."""
    grad_accum: int = 1
    """Gradient-accumulation passes per step (the job's); a proposal under a global batch
    chooses its own (all splits to the pipeline when pp > 1, else to accumulation)."""
    recompute: str | None = None
    """Force "none", "selective" or "full"; None = let the planner choose."""
    schedule: str = "1F1B"
    """Pipeline schedule (`parallel.pp_schedule`): sets the bubble and the stages' in-flight
    activations (`dslurm.plan.pipeline`)."""
    bytes: ByteLayout = field(default_factory=ByteLayout)
    """Persistent bytes per parameter (default 2+2+4+8)."""
    max_shard_gpus: int | None = None
    """Largest FSDP shard group (dp_shard × tp GPUs) to accept; None = any. All-gathers over
    thousands of ranks are latency-bound, so large runs cap the group and add pipeline stages."""
    reserve: float = 0.10
    """Share of GPU memory kept free for the CUDA context, NCCL buffers, fragmentation."""

    def __post_init__(self) -> None:
        count("micro_batch", self.micro_batch)
        count("grad_accum", self.grad_accum)
        for name in ("seq_len", "global_batch", "microbatches", "max_shard_gpus"):
            if getattr(self, name) is not None:
                count(name, getattr(self, name))
        if self.schedule not in SCHEDULES:
            raise UserError(f"schedule={self.schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}")
        if self.recompute is not None and self.recompute not in RECOMPUTES:
            raise UserError(f"recompute={self.recompute!r} is unknown; choose one of {', '.join(RECOMPUTES)}")
        fraction("reserve", self.reserve)


def memory_per_gpu(model: ModelShape, layout: Layout, work: Workload,
                   recompute: str = "none") -> dict[str, float]:
    """Bytes per GPU by kind for `layout` (the worst pipeline stage), and their total."""
    if recompute not in RECOMPUTES:
        raise UserError(f"recompute={recompute!r} is unknown; choose one of {', '.join(RECOMPUTES)}")
    b = work.bytes
    params = model.num_params()
    shard = layout.fsdp_shard  # dp_shard x cp: the cp ranks join FSDP's sharding (train/parallel/dims.py)
    state = params * b.total / (layout.tp * layout.pp * shard)
    # FSDP gathers the largest unit (a block, or the vocabulary matrix) and prefetches the
    # next; backward holds unsharded gradients of the same size before reduce-scatter.
    block = (params - 2 * model.vocab_size * model.dim) / model.n_layers
    unit = max(block, model.vocab_size * model.dim)
    buffers = 2 * unit * 2 * b.gathered / layout.tp if shard > 1 else 0.0  # weights + unsharded grads
    # Context parallel: each rank holds seq/cp tokens of every sequence (train/parallel/cp.py).
    seq = (work.seq_len or model.seq_len) // layout.cp
    shape: dict[str, Any] = dict(seq_len=seq, micro_batch=work.micro_batch, dim=model.dim, ffn_dim=model.ffn_dim,
                 n_heads=model.n_heads, kv_dim=model.n_kv_heads * model.head_dim, tp=layout.tp)
    per_stage = math.ceil(model.n_layers / layout.pp)
    rc: Any = recompute  # checked against RECOMPUTES above
    stored = activation_bytes_per_layer(recompute=rc, **shape)  # what each held layer keeps
    if layout.cp > 1 and recompute != "full":  # ... plus the other ranks' keys and values, gathered
        stored += 2.0 * 2 * (layout.cp - 1) * seq * work.micro_batch * shape["kv_dim"] / layout.tp
    # Under full recomputation one block is rebuilt at a time in backward: its whole
    # activations come on top of the stored layer inputs, once per GPU.
    rebuilt = activation_bytes_per_layer(recompute="none", **shape) if recompute == "full" else 0.0
    logits = logits_bytes(seq_len=seq, micro_batch=work.micro_batch, vocab_size=model.vocab_size, tp=layout.tp)
    if layout.pp == 1:
        acts = model.n_layers * stored + rebuilt + logits
    else:
        # The schedule decides how many microbatches each stage holds (`pipeline.stage_in_flight`):
        # the first stage the most layer activations, the last one fewer plus the logits.
        p, m = layout.pp, layout.microbatches
        first = stage_in_flight(work.schedule, p, m, 0) * per_stage * stored + rebuilt
        last = (stage_in_flight(work.schedule, p, m, p - 1) * per_stage * stored + rebuilt
                + logits_in_flight(work.schedule, m) * logits)
        acts = max(first, last)
    return {"state": state, "fsdp_buffers": buffers, "activations": acts,
            "total": state + buffers + acts}


@dataclass(kw_only=True, slots=True)
class Plan:
    """A layout with its memory, bubble, and the reason for each choice."""

    layout: Layout
    recompute: str
    """"none", "selective" or "full" activation recomputation"""
    grad_accum: int
    """gradient-accumulation passes per step (each of layout.microbatches pipeline microbatches)"""
    memory_gb: dict[str, float]
    budget_gb: float
    bubble: float
    """idle share of a schedule step under `schedule`: (p-1)/(v*m + p-1)"""
    reasons: dict[str, str]
    schedule: str = "1F1B"
    """the pipeline schedule the bubble and the activations assume"""
    bubble_overhead: float = 0.0
    """bubble time over ideal compute time under `schedule` (Narayanan et al.): (p-1)/(v*m)"""
    problems: list[str] = field(default_factory=list)
    """Why the layout cannot run (empty when it fits)."""
    warnings: list[str] = field(default_factory=list)
    """What will run but slowly (tp across NVLink domains)."""

    @property
    def fits(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, object]:
        lay = self.layout
        return {"layout": {"tp": lay.tp, "pp": lay.pp, "dp_shard": lay.dp_shard,
                           "dp_replicate": lay.dp_replicate, "cp": lay.cp, "recompute": self.recompute,
                           "microbatches": lay.microbatches, "grad_accum": self.grad_accum,
                           "schedule": self.schedule},
                "memory_gb": self.memory_gb, "budget_gb": self.budget_gb, "bubble": self.bubble,
                "bubble_overhead": self.bubble_overhead,
                "fits": self.fits, "reasons": self.reasons, "problems": self.problems,
                "warnings": self.warnings}


def _budget(cluster: Cluster, work: Workload) -> float:
    return cluster.gpu_mem_gb * GB * (1.0 - work.reserve)


def _gb(mem: dict[str, float]) -> dict[str, float]:
    return {k: round(v / GB, 2) for k, v in mem.items()}


def _splits(pp: int, dp: int, work: Workload) -> tuple[int, int] | None:
    """(pipeline microbatches, grad_accum) per step for `dp` replicas, or None when the global
    batch forbids it. Under a global batch this solves the one batch rule
    (`dslurm.config.layout`: global_batch = dp x grad_accum x microbatches x micro_batch) for the
    splits, sending them all to the pipeline when there is one (the smallest bubble)."""
    v = stages_per_rank(work.schedule)
    if work.global_batch is not None:
        per_step = dp * work.micro_batch
        if work.global_batch % per_step:
            return None
        n = work.global_batch // per_step
        m, accum = (n, 1) if pp > 1 else (1, n)
    elif pp == 1:
        m, accum = 1, work.grad_accum
    else:
        # No batch given: the asked microbatches, or enough for a bubble of at most 10%.
        m = work.microbatches or max(pp * v, microbatches_for_bubble(pp, 0.10, v))
        accum = work.grad_accum
    # Every schedule needs a microbatch per (virtual) stage (`Layout.schedule_problem`).
    return (m, accum) if m >= pp * v or pp == 1 else None
