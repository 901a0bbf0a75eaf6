"""Health during the run: the pure rules of the hang watchdog and of the non-finite loss policy.

Torch-free and I/O-free; the trainer's thin shells (train/watchdog.py, train/loop.py) call
these, and the tests hit them hard.

Hang bound. A step that makes no progress for `max(k x median step, floor)` seconds (capped at
the ceiling; the ceiling alone until the run has step times, and across a checkpoint save)
is a hang. The process-group timeout is the ceiling plus a grace, so a dead peer can never
block a collective for longer than the watchdog would wait: the watchdog speaks first, with
stacks and suspects; the timeout is only the backstop when the watchdog is off or stuck.

Suspects. When the watchdog fires every rank notes the last of the trainer's own collectives
it entered and whether it is still inside it. Ranks waiting inside a collective are victims;
a rank that is outside every collective (stuck in compute, data, a Python loop) or left no
note at all (stuck holding the GIL, dead) is the suspect. All ranks inside the same
collective means the transport itself hangs: no single suspect.

Non-finite loss. The ranks agree on "this step's loss or gradient norm is not finite" in the
same all-reduce that carries the loss and the stop flag, then each applies
`nonfinite_action` to the same inputs, so they act together.

Silent data corruption. Where parameters are replicated (HSDP replicas, dp_replicate > 1), the
replicas of one shard must hold identical bits. Every `sdc_every` steps, and before every save
(so no generation is committed that was not checked at its own step), each rank fingerprints
its local shards and the replicas compare: the replica that disagrees with a strict majority is
named; without a strict majority (2 replicas, or 3+ all different) every replica is a suspect
and none is named. The pointer then names a generation that passed its check: the rollback
target. Periodic device health: the site's burn-in thresholds applied to a cheap NVML poll.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

PG_GRACE_S = 60.0  # process-group timeout = the watchdog's ceiling + this
# Flight Recorder ring per process: enough for the last collectives of every group at a hang, and
# small because the straggler split reads the ring back every train.straggler_every steps (about
# 10 us per entry here: bench/bench_health.py). torchtitan's default for NCCL is 20000.
FR_ENTRIES = 500
FR_ENV = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


def enable_flight_recorder(env: MutableMapping[str, str], entries: int = FR_ENTRIES) -> bool:
    """PyTorch's Flight Recorder on for the process groups created after this: c10d reads
    `TORCH_FR_BUFFER_SIZE` when it creates its recorder (NCCL the same, falling back to
    `TORCH_NCCL_TRACE_BUFFER_SIZE`). A size the user set (0 = off) is kept: False then. The
    cost is one ring-buffer write in C++ per collective (bench/bench_health.py)."""
    if any(k in env for k in FR_ENV):
        return False
    env[FR_ENV[0]] = str(entries)
    return True


def hang_bound(step_times: Sequence[float], *, k: float, floor_s: float, ceiling_s: float) -> float:
    """Seconds without progress that count as a hang: max(k x median step, floor), at most the
    ceiling; the ceiling while no step time is known (first step, compile, restore)."""
    if not step_times:
        return ceiling_s
    return min(max(k * statistics.median(step_times), floor_s), ceiling_s)


def pg_timeout_s(ceiling_s: float) -> float:
    """The process-group timeout that lets the watchdog speak first (see the module doc)."""
    return ceiling_s + PG_GRACE_S


def poll_s(floor_s: float) -> float:
    """How often the watchdog looks: a quarter of the floor, between 0.25 s and 5 s."""
    return min(max(floor_s / 4, 0.25), 5.0)


def gather_s(bound_s: float) -> float:
    """How long a rank that fired waits for the other ranks' notes before naming suspects:
    they stopped progressing together, so their watchdogs fire within a poll of each other."""
    return min(max(bound_s / 2, 2.0), 30.0)


@dataclass(frozen=True)
class RankNote:
    """What one rank says when its watchdog fires."""

    rank: int
    host: str
    step: int
    """optimizer steps completed"""
    seq: int
    """how many of the trainer's collectives it has entered"""
    inside: bool
    """still inside the last one"""
    collective: str
    """the last one's name, e.g. step_agree"""
    groups: dict[str, Any] = field(default_factory=dict)
    """its Flight Recorder's view of each process group: the last c10d collective entered (#, op,
    still inside), dslurm/observe/forensics.py; empty when the recorder is off"""


def suspects(notes: Mapping[int, RankNote], world: int) -> tuple[list[int], str]:
    """The suspect ranks of a hang and why (see the module doc). Pure."""
    silent = [r for r in range(world) if r not in notes]
    outside = sorted(r for r, n in notes.items() if not n.inside)
    if silent or outside:
        parts = []
        if outside:
            parts.append(f"rank(s) {outside} outside every collective while "
                         f"{sorted(r for r, n in notes.items() if n.inside) or 'no rank'} wait inside one")
        if silent:
            parts.append(f"rank(s) {silent} left no note (stuck holding the interpreter, or dead)")
        return sorted(silent + outside), "; ".join(parts)
    seqs = {n.seq for n in notes.values()}
    if len(seqs) > 1:  # inside different collectives: those behind hold up those ahead
        low = min(seqs)
        behind = sorted(r for r, n in notes.items() if n.seq == low)
        return behind, f"rank(s) {behind} are inside an earlier collective (#{low}) than the others (#{max(seqs)})"
    names = {n.collective for n in notes.values()}
    return [], f"every rank is inside collective #{seqs.pop()} ({', '.join(sorted(names))}): the transport hangs"


# ------------------------------------------------------------------ non-finite loss

NonfinitePolicy = Literal["skip", "rollback", "stop", "off"]
Action = Literal["train", "skip", "rollback", "stop"]


@dataclass(frozen=True)
class NonfiniteDecision:
    action: Action
    reason: str


def nonfinite_action(policy: NonfinitePolicy, handled: int, max_handled: int) -> NonfiniteDecision:
    """What all ranks do with a step whose loss or gradient norm is not finite. `handled`: the
    non-finite steps already skipped or rolled back in this process. Pure."""
    if policy == "off":
        return NonfiniteDecision("train", "train.nonfinite=off: the step is taken (the checkpoint layer "
                                          "still refuses to commit non-finite state)")
    if policy == "stop":
        return NonfiniteDecision("stop", "train.nonfinite=stop")
    if handled >= max_handled:
        return NonfiniteDecision("stop", f"{handled} non-finite step(s) already handled by {policy} "
                                         f"(train.nonfinite_max={max_handled}): the run keeps diverging")
    return NonfiniteDecision(policy, f"train.nonfinite={policy} ({handled + 1} of {max_handled})")


# ------------------------------------------------------------------ silent data corruption

Fingerprint = tuple[int, ...]


@dataclass(frozen=True)
class SdcVerdict:
    ok: bool
    odd: list[int]
    """replica indices (dp_replicate coordinates) that disagree with the majority"""
    named: bool
    """a strict majority agreed, so `odd` names the culprit(s); False: all replicas are suspects"""
    why: str


def sdc_verdict(fingerprints: Sequence[Fingerprint]) -> SdcVerdict:
    """Compare one shard's fingerprints across its replicas (index = replica). Pure."""
    groups: dict[Fingerprint, list[int]] = {}
    for i, fp in enumerate(fingerprints):
        groups.setdefault(tuple(fp), []).append(i)
    if len(groups) <= 1:
        return SdcVerdict(True, [], True, f"{len(fingerprints)} replica(s) agree")
    biggest = max(groups.values(), key=len)
    if 2 * len(biggest) > len(fingerprints):
        odd = sorted(i for i in range(len(fingerprints)) if i not in biggest)
        return SdcVerdict(False, odd, True, f"replica(s) {odd} disagree with the majority {biggest}")
    every = list(range(len(fingerprints)))
    return SdcVerdict(False, every, False,
                      f"no majority among {len(fingerprints)} replicas ({len(groups)} different fingerprints): "
                      "every replica is a suspect (2 replicas cannot name one)")


def due(step: int, every: int) -> bool:
    """Is a periodic check (SDC, device poll) due after `step` optimizer steps? every=0: off. Pure."""
    return every > 0 and step % every == 0


def mismatched_params(mine: Sequence[int], majority: Sequence[int], names: Sequence[str],
                      limit: int = 5) -> list[str]:
    """The parameter names whose per-parameter fingerprints differ (at most `limit`). Pure."""
    return [n for n, a, b in zip(names, mine, majority) if a != b][:limit]


@dataclass(frozen=True)
class SdcSummary:
    suspects: list[int]
    hosts: list[str]
    named: bool
    blocklist: list[str]
    """hosts to keep out of the run: only those a strict majority named"""
    why: str
    params: list[str]


def sdc_summary(reports: Sequence[Mapping[str, Any]]) -> SdcSummary:
    """Every rank's word after a mismatch (rank, host, suspect, named, why, params) -> the run's
    verdict: a suspect host is blocklisted only when its replicas' majority named it. Pure."""
    sus = [r for r in reports if r["suspect"]]
    named = bool(sus) and all(r["named"] for r in sus)
    whys = sorted({str(r["why"]) for r in reports if r["why"]})
    params = sorted({str(p) for r in sus for p in r["params"]})[:5]
    return SdcSummary(suspects=sorted(int(r["rank"]) for r in sus), hosts=sorted({str(r["host"]) for r in sus}),
                      named=named, blocklist=sorted({str(r["host"]) for r in sus if r["named"]}),
                      why="; ".join(whys), params=params)

# ------------------------------------------------------------------ device health during the run

@dataclass(frozen=True)
class GpuReading:
    """One cheap NVML poll of one GPU (None: not supported)."""

    index: int
    temp_c: int | None = None
    throttle: list[str] = field(default_factory=list)
    """hardware slowdown reasons active now"""
    ecc_uncorrected: int | None = None
    xids: list[int] = field(default_factory=list)
    """Xid events since the last poll"""


def device_findings(now: Sequence[GpuReading], baseline: Mapping[int, int | None], *, max_temp_c: float,
                    hardware_xids: frozenset[int]) -> list[str]:
    """What is new and wrong since the start: temperature over the site's limit, hardware
    throttling, uncorrected ECC errors above the count at the start, any Xid. Pure."""
    out = []
    for g in now:
        if g.temp_c is not None and g.temp_c > max_temp_c:
            out.append(f"gpu{g.index}: temperature {g.temp_c} C > {max_temp_c:g} C")
        if g.throttle:
            out.append(f"gpu{g.index}: clock throttled: {', '.join(g.throttle)}")
        base = baseline.get(g.index)
        if g.ecc_uncorrected is not None and base is not None and g.ecc_uncorrected > base:
            out.append(f"gpu{g.index}: {g.ecc_uncorrected - base} new uncorrected ECC error(s)")
        if g.xids:
            hw = sorted(set(g.xids) & hardware_xids)
            out.append(f"gpu{g.index}: {'hardware ' if hw else ''}Xid {hw or sorted(set(g.xids))}")
    return out
