"""Find a slow node or link in O(n) pair exchanges and O(1) rounds, never all pairs.

Nodes form a ring; each round exchanges data between disjoint neighbour pairs (i, i+1), so a
ring of n nodes needs 2 rounds (n even) or 3 (n odd, the wrap-around pair alone). A node whose
both pairs are slow is the culprit; a slow pair without such a node is a slow link.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


def ring_pairs(n: int) -> list[tuple[int, int]]:
    if n < 2:
        return []
    if n == 2:
        return [(0, 1)]
    return [(i, (i + 1) % n) for i in range(n)]


def ring_rounds(n: int) -> list[list[tuple[int, int]]]:
    """Neighbour pairs grouped so that no node appears twice in one round."""
    pairs = ring_pairs(n)
    if n <= 2:
        return [pairs] if pairs else []
    even = [p for p in pairs if p[0] % 2 == 0 and p[0] != n - 1]
    odd = [p for p in pairs if p[0] % 2 == 1]
    wrap = [(n - 1, 0)] if n % 2 else []  # odd ring: the wrap pair shares node 0 with round 0
    return [r for r in (even, odd, wrap) if r]


@dataclass(slots=True)
class Localization:
    baseline_s: float | None = None
    slow_pairs: list[tuple[int, int]] = field(default_factory=list)
    culprits: list[int] = field(default_factory=list)
    slow_links: list[tuple[int, int]] = field(default_factory=list)
    note: str = ""


def localize(pair_seconds: dict[tuple[int, int], float], n: int, factor: float) -> Localization:
    """Name slow nodes from neighbour-pair times. The baseline is the fastest pair, not the
    median: in a 3-node ring a slow node makes 2 of 3 pairs slow, so the median is slow too."""
    loc = Localization()
    if n < 3:
        loc.note = f"{n} node(s): ring localization needs >= 3 nodes; rely on busbw thresholds"
        return loc
    missing = [p for p in ring_pairs(n) if p not in pair_seconds]
    if missing:
        raise ValueError(f"pair times missing for {missing}")
    loc.baseline_s = min(pair_seconds.values())
    limit = factor * loc.baseline_s
    loc.slow_pairs = [p for p in ring_pairs(n) if pair_seconds[p] > limit]
    slow = set(loc.slow_pairs)
    for node in range(n):
        mine = [p for p in ring_pairs(n) if node in p]
        if all(p in slow for p in mine):
            loc.culprits.append(node)
    loc.slow_links = [p for p in loc.slow_pairs if not set(p) & set(loc.culprits)]
    return loc


def pair_partner(me: int, pair: tuple[int, int], node_ranks: list[list[int]]) -> int | None:
    """Rank I exchange with in `pair`: the same local rank on the other node (rail-aligned,
    so every NIC is exercised at once); None if I am not in the pair or have no counterpart."""
    a, b = (node_ranks[pair[0]], node_ranks[pair[1]])
    for mine, theirs in ((a, b), (b, a)):
        if me in mine:
            j = mine.index(me)
            return theirs[j] if j < len(theirs) else None
    return None


def measure_pairs(node_ranks: list[list[int]], nbytes: int, device: Any, delay: float = 0.0,
                  iters: int = 3) -> dict[tuple[int, int], float]:
    """Time bidirectional exchanges of this rank with its partner, round by round.
    Returns only this rank's own measurements; rank 0 gathers and takes the max per pair."""
    import torch
    import torch.distributed as dist

    me = dist.get_rank()
    send = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    recv = torch.empty_like(send)
    out: dict[tuple[int, int], float] = {}
    for round_pairs in ring_rounds(len(node_ranks)):
        for pair in round_pairs:
            peer = pair_partner(me, pair, node_ranks)
            if peer is not None:
                out[pair] = _exchange(send, recv, peer, device, delay, iters)
        dist.barrier()  # rounds must not overlap, or pairs of different rounds share a node
    return out


def _exchange(send: Any, recv: Any, peer: int, device: Any, delay: float, iters: int) -> float:
    import torch
    import torch.distributed as dist

    def once() -> None:
        ops = [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, recv, peer)]
        for req in dist.batch_isend_irecv(ops):
            req.wait()

    once()  # warmup: connection setup is not link speed
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        if delay:
            time.sleep(delay)  # fault injection
        once()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / iters
