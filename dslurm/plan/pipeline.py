"""Pipeline bubble and first-stage residency per schedule, tensor-parallel shard shapes (seed 000, 2.4).

Which schedule each number assumes (p stages, m microbatches per schedule step, v virtual
stages per rank, equal stage times, free transfers):

| schedule        | bubble / ideal compute | idle share of the step | first stage holds (microbatches of L/p layers) |
|-----------------|------------------------|------------------------|------------------------------------------------|
| GPipe           | (p-1)/m                | (p-1)/(m+p-1)          | m (every forward before any backward)          |
| 1F1B            | (p-1)/m                | (p-1)/(m+p-1)          | min(p, m)                                      |
| Interleaved1F1B | (p-1)/(v*m)            | (p-1)/(v*m+p-1)        | min(p + (p-1)/v, m) = p(1 + (p-1)/(p*v))       |

The bubble of GPipe and 1F1B is the same (seed 000 eq. 2.4, from GPipe); 1F1B changes memory,
not idle time. Interleaving cuts the bubble by v (Narayanan et al. 2021, "Efficient large-scale
language model training on GPU clusters using Megatron-LM", arXiv 2104.04473, sec. 2.2.2) at the
price of v times more point-to-point sends and more activations on the first stage: Korthikanti
et al. 2022 ("Reducing activation recomputation in large transformer models", arXiv 2205.05198,
sec. 4.2.3) give the first stage's activation memory under interleaving as (1 + (p-1)/(p*v))
times the 1F1B figure. That is Megatron's warmup count (megatron/core/pipeline_parallel/
schedules.py): rank 0 runs 2(p-1) + (v-1)p forward chunks before its first backward, so
2(p-1) + (v-1)p + 1 chunks of L/(p*v) layers are in flight = p + (p-1)/v microbatches of L/p
layers. PyTorch's ScheduleInterleaved1F1B uses the same warmup. v comes from
`dslurm.config.layout.stages_per_rank` (the trainer's own count).
"""

from __future__ import annotations

from dslurm.config.layout import stages_per_rank
from dslurm.errors import UserError
from dslurm.plan._check import count

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
"""The schedules the trainer runs (train/parallel/pp.py); `parallel.pp_schedule` in a job."""


def _schedule(schedule: str) -> str:
    if schedule not in SCHEDULES:
        raise UserError(f"pp_schedule={schedule!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    return schedule


def bubble_fraction(stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Idle share of one schedule step: (p−1)/(v·m + p−1); v = 1 for GPipe and 1F1B.

    4 stages: 4 microbatches → 3/7 ≈ 43%; 16 → 3/19 ≈ 16%. Interleaved, 2 stages, v=2, 8
    microbatches → 1/17 ≈ 5.9%.
    """
    count("stages", stages)
    count("microbatches", microbatches)
    count("virtual_stages", virtual_stages)
    return (stages - 1) / (virtual_stages * microbatches + stages - 1)


def bubble_overhead(stages: int, microbatches: int, virtual_stages: int = 1) -> float:
    """Bubble time over ideal compute time, Narayanan et al.'s t_pb/t_id: (p−1)/(v·m).

    The same bubble as `bubble_fraction`, measured against the work instead of the step:
    overhead = fraction / (1 − fraction). 2 stages, v=2, 8 microbatches → 1/16 = 6.25%.
    """
    count("stages", stages)
    count("microbatches", microbatches)
    count("virtual_stages", virtual_stages)
    return (stages - 1) / (virtual_stages * microbatches)


def schedule_bubble(schedule: str, stages: int, microbatches: int) -> tuple[float, float]:
    """(idle share of the step, bubble over ideal compute) of a named schedule."""
    v = stages_per_rank(_schedule(schedule))
    return bubble_fraction(stages, microbatches, v), bubble_overhead(stages, microbatches, v)


def stage_in_flight(schedule: str, stages: int, microbatches: int, rank: int = 0) -> float:
    """Microbatches of L/p layers whose activations pipeline rank `rank` holds at its peak.

    GPipe: m on every rank. 1F1B: min(p − rank, m) (the first stage p). Interleaved1F1B with v
    chunks per rank: 2(p−1−rank) + (v−1)p + 1 chunks of L/(p·v) layers, at most all v·m of
    them, divided by v; on the first stage p + (p−1)/v = p·(1 + (p−1)/(p·v)) when uncapped
    (module docstring). 2 stages, v=2, 8 microbatches: first stage 2.5, last stage 1.5.
    """
    count("stages", stages)
    count("microbatches", microbatches)
    schedule = _schedule(schedule)
    if not 0 <= rank < stages:
        raise UserError(f"rank={rank} must be in [0, {stages})")
    if stages == 1:
        return 1.0
    if schedule == "GPipe":
        return float(microbatches)
    v = stages_per_rank(schedule)
    if v == 1:
        return float(min(stages - rank, microbatches))
    chunks = min(2 * (stages - 1 - rank) + (v - 1) * stages + 1, v * microbatches)
    return chunks / v


def logits_in_flight(schedule: str, microbatches: int) -> int:
    """Microbatches whose output logits the last stage holds at once: all of them under GPipe
    (every forward, loss included, before any backward), else one (the loss's backward follows
    its forward at once on the last stage)."""
    count("microbatches", microbatches)
    return microbatches if _schedule(schedule) == "GPipe" else 1


def microbatches_for_bubble(stages: int, max_bubble: float, virtual_stages: int = 1) -> int:
    """Fewest microbatches that keep the idle share at or under `max_bubble` (inverse of the above)."""
    count("stages", stages)
    count("virtual_stages", virtual_stages)
    if not 0 < max_bubble < 1:
        raise UserError(f"max_bubble={max_bubble} must be in (0, 1)")
    if stages == 1:
        return 1
    # (p-1)/(vm+p-1) <= x  <=>  m >= (p-1)(1-x)/(x v) ; round up, with a guard for float noise.
    need = (stages - 1) * (1 - max_bubble) / (max_bubble * virtual_stages)
    m = max(1, int(need))
    return m if bubble_fraction(stages, m, virtual_stages) <= max_bubble + 1e-12 else m + 1


def tp_shard_shapes(rows: int, cols: int, tp: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Per-GPU shapes of an MLP's two matrices under Megatron tensor parallelism.

    The first (rows × cols) is split by columns, the second (cols × rows) by rows, so one
    all-reduce finishes the block. 4,096 × 16,384 at tp=4 → (4096, 4096) and (4096, 4096).
    """
    count("rows", rows)
    count("cols", cols)
    count("tp", tp)
    if cols % tp:
        raise UserError(f"tp={tp} does not divide the hidden size {cols}; choose a divisor")
    return (rows, cols // tp), (cols // tp, rows)
