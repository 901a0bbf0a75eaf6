"""The planner's figures for one rank of a job, as `dslurm plan check` measures them (pure).

The layout-wide planner (`dslurm.plan.layout`, `dslurm.plan.traffic`) speaks for the mean pipeline
rank. A real rank holds particular stages: loop-style placement (`dslurm.config.layout.stage_ids`),
contiguous layers per stage with the first stages one longer when uneven (`layer_split`), the
embedding on stage 0, the final norm and output on the last. Here the same formulas run on that
rank's own parameters and blocks:

- parameters it holds: the stages' matrices split over tp, their RMSNorm weights whole (tensor
  parallel replicates them), the lot sharded over dp_shard x cp by FSDP;
- params / grads / optimizer bytes: those times the trainer's bytes per parameter
  (`dslurm.plan.memory.trainer_bytes`);
- collectives of one micro-batch's forward and backward (`step_traffic` with one pass of one
  microbatch, on this rank's parameters and blocks); the pipeline's sends are not counted (the check
  runs no schedule);
- activations of that micro-batch: each block's stored activations, one rebuilt block under full
  recomputation and, on the last stage, the FP32 logits (`dslurm.plan.memory`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dslurm.config.layout import Layout, layer_split, stage_ids, stages_per_rank
from dslurm.config.models import ModelShape
from dslurm.plan.layout import Cluster, Workload
from dslurm.plan.memory import activation_bytes_per_layer, logits_bytes
from dslurm.plan.traffic import step_traffic


@dataclass(frozen=True, kw_only=True, slots=True)
class RankFigures:
    """What the planner expects of one rank."""

    stages: list[int]
    layers: int
    """transformer blocks the rank runs"""
    params: float
    """parameters it holds before FSDP shards them (its tp share)"""
    bytes: dict[str, float]
    """params, grads, optimizer, activations: bytes on this rank"""
    collectives: dict[tuple[str, str], float]
    """(dim, op) -> bytes (nccl-tests' S, summed over calls) of one micro-batch's forward and backward"""


def rank_stages(layout: Layout, schedule: str, rank: int) -> tuple[list[int], int]:
    """(the stages `rank` holds, the number of stages)."""
    if not layout.pp_enabled:
        return [0], 1
    return stage_ids(layout.coords(rank)["pp"], layout.pp, schedule), layout.pp * stages_per_rank(schedule)


def held_params(model: ModelShape, layout: Layout, stages: list[int], n_stages: int) -> tuple[float, int]:
    """(parameters of `stages` on one tp rank, before FSDP; their blocks)."""
    split = layer_split(model.n_layers, n_stages)
    layers = sum(len(split[s]) for s in stages)
    norms = model.layer_params() - model.layer_params(norms=False)
    tp_split = layers * model.layer_params(norms=False)
    whole = layers * norms
    if 0 in stages:
        tp_split += model.vocab_size * model.dim
    if n_stages - 1 in stages:
        whole += model.dim  # final norm
        if not model.tie_embeddings or 0 not in stages:
            tp_split += model.vocab_size * model.dim
    return tp_split / layout.tp + whole, layers


def rank_figures(model: ModelShape, layout: Layout, work: Workload, cluster: Cluster, recompute: str,
                 rank: int) -> RankFigures:
    """The planner's figures for `rank` (module docstring)."""
    stages, n_stages = rank_stages(layout, work.schedule, rank)
    local, layers = held_params(model, layout, stages, n_stages)
    last = n_stages - 1 in stages
    b = work.bytes
    sharded = local / (layout.fsdp_shard if layout.fsdp_enabled else 1)
    one = dataclasses.replace(work, grad_accum=1)
    one_mb = dataclasses.replace(layout, microbatches=1)
    coll: dict[tuple[str, str], float] = {}
    for c in step_traffic(model, one_mb, one, cluster, recompute, local_params=local, layers=layers,
                          ends=(0 in stages, last)):
        if c.dim != "pp":
            coll[(c.dim, c.op)] = coll.get((c.dim, c.op), 0.0) + c.calls * c.size_bytes
    seq = (work.seq_len or model.seq_len) // layout.cp
    shape = dict(seq_len=seq, micro_batch=work.micro_batch, dim=model.dim, ffn_dim=model.ffn_dim,
                 n_heads=model.n_heads, kv_dim=model.n_kv_heads * model.head_dim, tp=layout.tp)
    rc = recompute if recompute in ("none", "selective", "full") else "none"
    acts = layers * activation_bytes_per_layer(recompute=rc, **shape)  # type: ignore[arg-type]
    if rc == "full":
        acts += activation_bytes_per_layer(recompute="none", **shape)  # type: ignore[arg-type]
    if last:
        acts += logits_bytes(seq_len=seq, micro_batch=work.micro_batch, vocab_size=model.vocab_size, tp=layout.tp)
    return RankFigures(stages=stages, layers=layers, params=local,
                       bytes={"params": sharded * (b.weights + b.master), "grads": sharded * b.grads,
                              "optimizer": sharded * b.optimizer, "activations": acts},
                       collectives=coll)


def default_ranks(layout: Layout) -> list[int]:
    """Ranks that differ: the first pipeline stage's first rank, the last stage's first rank, and the
    world's last rank (the last tp, cp and dp_shard coordinates of the last stage: a TP edge)."""
    last_stage = layout.rank_of(pp=layout.pp - 1)
    return sorted({0, last_stage, layout.world_size - 1})
