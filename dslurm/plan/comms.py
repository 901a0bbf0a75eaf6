"""Collective traffic per rank and its time on a link (seed 000 eq. 2.3, seed 004).

Volumes are bytes one rank *sends*; it receives the same amount separately. Times are
volume over a per-rank link bandwidth: a lower bound that ignores latency and overlap.

Bus bandwidth follows nccl-tests (doc/PERFORMANCE.md): for a collective on a buffer of S bytes
that takes t seconds, algbw = S / t and busbw = algbw x factor, with factor 2(n−1)/n for
all-reduce, (n−1)/n for all-gather and reduce-scatter (S = the gathered / unreduced size) and 1
for send/recv. busbw is what one rank's slowest link carries, so it compares across n and with
the hardware; the time of a collective at a known busbw is S x factor / busbw, which is exactly
the bytes one rank sends above over that bandwidth.
"""

from __future__ import annotations

from collections.abc import Sequence

from dslurm.errors import UserError
from dslurm.plan._check import count, non_negative, positive


def reduce_scatter_bytes(size_bytes: float, ranks: int) -> float:
    """Bytes one rank sends in a ring reduce-scatter of a `size_bytes` tensor: (N−1)/N·G."""
    non_negative("size_bytes", size_bytes)
    count("ranks", ranks)
    return (ranks - 1) / ranks * size_bytes


def all_gather_bytes(size_bytes: float, ranks: int) -> float:
    """Bytes one rank sends in a ring all-gather whose *gathered* result is `size_bytes`."""
    return reduce_scatter_bytes(size_bytes, ranks)  # the mirror image of reduce-scatter


def ring_allreduce_bytes(size_bytes: float, ranks: int | None = None) -> float:
    """Bytes one rank sends in a ring all-reduce: 2(N−1)/N·G (reduce-scatter + all-gather).

    `ranks=None` gives the large-N limit 2·G, which seed 004 uses ("close to twice the size
    no matter how many GPUs").
    """
    if ranks is None:
        return 2.0 * non_negative("size_bytes", size_bytes)
    return 2.0 * reduce_scatter_bytes(size_bytes, ranks)


def fsdp_step_bytes(param_bytes: float, grad_bytes: float, ranks: int) -> float:
    """Bytes one rank sends per step under full sharding (ZeRO-3/FSDP).

    Weights are all-gathered twice (forward, and again in backward after resharding) and
    gradients reduce-scattered once: ~1.5× the DDP all-reduce volume for equal dtypes.
    """
    return 2 * all_gather_bytes(param_bytes, ranks) + reduce_scatter_bytes(grad_bytes, ranks)


def transfer_time_s(size_bytes: float, gbytes_per_s: float) -> float:
    """Seconds to move `size_bytes` over a link of `gbytes_per_s` (decimal GB/s)."""
    non_negative("size_bytes", size_bytes)
    positive("link_gbytes_per_s", gbytes_per_s)
    return size_bytes / (gbytes_per_s * 1e9)


def allreduce_time_s(size_bytes: float, gbytes_per_s: float, ranks: int | None = None) -> float:
    """Bandwidth-bound time of a ring all-reduce of `size_bytes` (seed 004: 16 GB → 36 ms on NVLink)."""
    return transfer_time_s(ring_allreduce_bytes(size_bytes, ranks), gbytes_per_s)


BUS_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send_recv")


def bus_factor(op: str, ranks: int) -> float:
    """nccl-tests' busbw / algbw for `op` over `ranks` ranks: 2(n−1)/n, (n−1)/n, or 1 (send/recv)."""
    count("ranks", ranks)
    if op == "all_reduce":
        return 2.0 * (ranks - 1) / ranks
    if op in ("all_gather", "reduce_scatter"):
        return (ranks - 1) / ranks
    if op == "send_recv":
        return 1.0
    raise UserError(f"op={op!r} is unknown; choose one of {', '.join(BUS_OPS)}")


def busbw_gbytes_per_s(op: str, size_bytes: float, ranks: int, seconds: float) -> float:
    """Bus bandwidth (decimal GB/s) of a measured collective: algbw (size / time) × `bus_factor`.

    An 8-rank all-reduce of 1 GB in 10 ms: algbw 100 GB/s, busbw 175 GB/s.
    """
    non_negative("size_bytes", size_bytes)
    positive("seconds", seconds)
    return size_bytes / seconds / 1e9 * bus_factor(op, ranks)


def collective_time_s(op: str, size_bytes: float, ranks: int, busbw: float) -> float:
    """Seconds for `op` on `size_bytes` over `ranks` ranks at bus bandwidth `busbw` (GB/s):
    size × bus_factor / busbw, the inverse of `busbw_gbytes_per_s`. 0 for a group of one."""
    non_negative("size_bytes", size_bytes)
    if ranks == 1 and op != "send_recv":
        return 0.0
    return transfer_time_s(size_bytes * bus_factor(op, ranks), busbw)


def allreduce_mean(values: Sequence[float]) -> float:
    """What an averaging all-reduce hands every rank (seed 000 eq. 2.2): sum / N."""
    if not values:
        count("ranks", 0)
    return sum(values) / len(values)


def collective_spans(ready_s: Sequence[float], transfer_s: float) -> list[float]:
    """Per-rank time spent inside one synchronising collective.

    Every rank waits for the last one to arrive, then all transfer together, so an early
    rank records its wait plus the transfer and the straggler only the transfer (seed 000,
    2.8: 45 ms vs 130 ms input, 70 ms all-reduce → 155 ms vs 70 ms).
    """
    if not ready_s:
        count("ranks", 0)
    for i, t in enumerate(ready_s):
        non_negative(f"ready_s[{i}]", t)
    non_negative("transfer_s", transfer_s)
    last = max(ready_s)
    return [last - t + transfer_s for t in ready_s]
