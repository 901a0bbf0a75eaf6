"""A slow rank's cause: each rank's step split into data wait, compute, collective wait and
optimizer, and the part that makes the others wait. Pure.

In synchronous training every rank's step takes as long as the slowest one's: the others wait
for it inside a collective, so step times alone (the `slow` list of the stragglers event)
rarely tell who is slow, and never why. What does tell is *arrival*: the Flight Recorder notes
when each rank entered each collective (`time_created_ns`, per process group and sequence
number; dslurm/observe/forensics.py). For collective #N of group G the last member to arrive
made every other member wait `t_last - t_own`. That wait is taken out of the phase the waiting
rank was in (FSDP's all-gathers sit inside `compute`, the loss agreement after `optimizer`'s
clipping) and summed as its collective wait; what is left of each phase is the rank's own work:

    data = data phase; compute = compute phase - waits inside it;
    optimizer = optimizer phase - waits inside it; collective wait = all waits

The split is exact for blocking collectives; an asynchronous one (FSDP's prefetched all-gather,
its reduce-scatter) is waited for later than it is entered, so there the wait is an upper bound.
Who is slow is therefore decided from *lateness*, which needs no wait time: at each collective a
rank's lateness is how long after the first member it arrived; the increase since its own
previous collective is charged to the phase it spent that interval in (`lateness`). The rank that
fell behind by at least `min_share` of the median step is named, with the part where it did.

Relative scores are NVRx's (nvidia-resiliency-ext straggler detection): per part, the best
(shortest) rank's time over this rank's, 1.0 = the fastest, 0.5 = twice as slow (NVRx flags a
section below 0.7, `THRESHOLD`); they come with each named rank. The wall clocks of different
hosts must agree to well under the waits measured (NTP: about a millisecond); on a GPU the
host's arrival is when the kernel was queued, not when it ran, so there the split measures the
host's side (see docs/health.md).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

PARTS = ("data", "compute", "optimizer")
"""the parts of a step that are a rank's own work (collective wait is their effect on others)"""
THRESHOLD = 0.7
MIN_SHARE = 0.1


@dataclass(frozen=True)
class RankStep:
    """One rank's last step, as it sends it to the straggler check."""

    rank: int
    host: str
    step_s: float
    spans: list[tuple[str, int, int]] = field(default_factory=list)
    """(phase, start ns, end ns), wall clock; a phase may appear more than once"""
    arrivals: list[tuple[str, int, int]] = field(default_factory=list)
    """(group, collective #, entered at ns) of the collectives entered during the step"""


def _phase_at(spans: Sequence[tuple[str, int, int]], t: int) -> str | None:
    for name, a, b in spans:
        if a <= t <= b:
            return name
    return None


def split(steps: Sequence[RankStep]) -> dict[int, dict[str, float]]:
    """rank -> seconds of data, compute, optimizer (own work) and collective_wait in its last step."""
    arrive: dict[tuple[str, int], dict[int, int]] = {}
    for s in steps:
        for group, seq, t in s.arrivals:
            arrive.setdefault((group, seq), {})[s.rank] = t
    waits: dict[int, dict[str, float]] = {s.rank: {} for s in steps}
    by_rank = {s.rank: s for s in steps}
    for ranks in arrive.values():
        if len(ranks) < 2:
            continue  # entered by one rank only in this window: nothing to compare
        last = max(ranks.values())
        for r, t in ranks.items():
            w: float = (last - t) / 1e9
            phase = _phase_at(by_rank[r].spans, t) or "other"
            waits[r][phase] = waits[r].get(phase, 0.0) + w
    out = {}
    for s in steps:
        phase_s: dict[str, float] = {}
        for name, a, b in s.spans:
            phase_s[name] = phase_s.get(name, 0.0) + (b - a) / 1e9
        mine = waits[s.rank]
        own = {p: max(0.0, phase_s.get(p, 0.0) - mine.get(p, 0.0)) for p in PARTS}
        out[s.rank] = {**own, "collective_wait": sum(mine.values())}
    return out


def scores(parts: Mapping[int, Mapping[str, float]]) -> dict[int, dict[str, float]]:
    """NVRx's relative scores per part: the fastest rank's time over this rank's (1.0 = fastest)."""
    out: dict[int, dict[str, float]] = {r: {} for r in parts}
    for p in PARTS:
        best = min((v.get(p, 0.0) for v in parts.values()), default=0.0)
        for r, v in parts.items():
            t = v.get(p, 0.0)
            out[r][p] = 1.0 if t <= 0 else round(min(1.0, best / t), 3)
    return out


def _overlap(spans: Sequence[tuple[str, int, int]], a: int, b: int) -> str:
    """The phase that holds most of [a, b] ("other" when none does)."""
    best, most = "other", 0
    for name, x, y in spans:
        got = min(b, y) - max(a, x)
        if got > most:
            best, most = name, got
    return best


def lateness(steps: Sequence[RankStep]) -> dict[int, dict[str, float]]:
    """rank -> seconds by which it fell behind the first arrival, per part of the step it spent
    falling behind in. For each collective a rank enters, its lateness is how long after the
    earliest member it arrived; only the increase since its previous collective is new (async
    collectives, FSDP's prefetches, carry the old lateness along), and that increase is charged
    to the phase that holds most of the time since that previous collective."""
    arrive: dict[tuple[str, int], dict[int, int]] = {}
    for s in steps:
        for group, seq, t in s.arrivals:
            arrive.setdefault((group, seq), {})[s.rank] = t
    first = {k: min(v.values()) for k, v in arrive.items() if len(v) > 1}
    out: dict[int, dict[str, float]] = {}
    for s in steps:
        charged: dict[str, float] = {}
        prev_t, prev_late = (s.spans[0][1] if s.spans else 0), 0.0
        for group, seq, t in sorted(s.arrivals, key=lambda x: x[2]):
            if (group, seq) not in first:
                continue
            late = (t - first[(group, seq)]) / 1e9
            if late > prev_late:
                part = _overlap(s.spans, prev_t, t)
                charged[part] = charged.get(part, 0.0) + late - prev_late
            prev_t, prev_late = t, late
        out[s.rank] = charged
    return out


def causes(steps: Sequence[RankStep], *, threshold: float = THRESHOLD,
           min_share: float = MIN_SHARE) -> tuple[dict[int, dict[str, float]], dict[int, dict[str, float]],
                                                  list[dict[str, Any]]]:
    """(parts, scores, slow): each rank's split, its relative scores, and the ranks named slow --
    rank, host, part, behind_s (how much it fell behind the others there), score (its relative
    score in that part), part_s -- slowest first. A rank is named when it fell behind by at least
    `min_share` of the median step in one part; below `threshold` its score agrees."""
    parts = split(steps)
    sc = scores(parts)
    if len(steps) < 2:
        return parts, sc, []
    step_med = statistics.median(s.step_s for s in steps) or 0.0
    hosts = {s.rank: s.host for s in steps}
    slow = []
    for r, charged in lateness(steps).items():
        own = {p: v for p, v in charged.items() if p in PARTS}
        if not own:
            continue
        p = max(own, key=lambda k: own[k])
        if own[p] >= min_share * step_med and own[p] > 0:
            slow.append({"rank": r, "host": hosts[r], "part": p, "behind_s": round(own[p], 6),
                         "score": sc[r][p], "part_s": round(parts[r][p], 6)})
    return parts, sc, sorted(slow, key=lambda x: -float(x["behind_s"]))


def sentence(slow: Mapping[str, Any]) -> str:
    """'rank 1 (node2) slow in data: 0.210 s behind the others, relative score 0.12'"""
    return (f"rank {slow.get('rank')} ({slow.get('host')}) slow in {slow.get('part')}: "
            f"{float(slow.get('behind_s') or 0):.3f} s behind the others, relative score {slow.get('score')}")
