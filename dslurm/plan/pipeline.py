"""Pipeline bubble and tensor-parallel shard shapes (seed 000, 2.4)."""

from __future__ import annotations

from dslurm.errors import UserError
from dslurm.plan._check import count


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle share of a GPipe/1F1B schedule: (p−1)/(m+p−1), equal stage times, free transfers.

    4 stages: 4 microbatches → 3/7 ≈ 43%; 16 → 3/19 ≈ 16%.
    """
    count("stages", stages)
    count("microbatches", microbatches)
    return (stages - 1) / (microbatches + stages - 1)


def microbatches_for_bubble(stages: int, max_bubble: float) -> int:
    """Fewest microbatches that keep the bubble at or under `max_bubble` (inverse of the above)."""
    count("stages", stages)
    if not 0 < max_bubble < 1:
        raise UserError(f"max_bubble={max_bubble} must be in (0, 1)")
    if stages == 1:
        return 1
    # (p-1)/(m+p-1) <= x  <=>  m >= (p-1)(1-x)/x ; round up, with a guard for float noise.
    need = (stages - 1) * (1 - max_bubble) / max_bubble
    m = max(1, int(need))
    return m if bubble_fraction(stages, m) <= max_bubble + 1e-12 else m + 1


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
