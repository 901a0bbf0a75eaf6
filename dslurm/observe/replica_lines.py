"""The report's lines for replica groups (`recovery.replicas`, docs/recovery.md): each group's
line through its faults (lost at a step, for which cause; healed at which step, in how long, from
whom, with the steps and samples it missed) and the run's participants per step. Pure: from the
ledger's replica events (dslurm/observe/events/replicas.py)."""

from __future__ import annotations

from collections.abc import Iterable

from dslurm.observe import events as ev


def participants(events: Iterable[ev.Event]) -> dict[int, int]:
    """Step (1-based) -> the groups that committed it, from every group's windows (the groups of one
    quorum record the same number; a step recorded differently keeps the largest)."""
    out: dict[int, int] = {}
    for w in ev.of(events, ev.ReplicaSteps):
        for i, n in enumerate(w.participants):
            out[w.first + i] = max(n, out.get(w.first + i, 0))
    return out


def ranges(steps: list[int]) -> str:
    """[1, 15, 16, 17] -> "1, 15-17". Pure."""
    out: list[str] = []
    for s in steps:
        if out and int(out[-1].split("-")[-1]) == s - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{s}"
        else:
            out.append(str(s))
    return ", ".join(out)


def replica_lines(events: Iterable[ev.Event]) -> list[str]:
    """One line for the run's participants, one per group that was lost or healed after its start;
    [] for a run without replica groups."""
    events = list(events)
    per_step = participants(events)
    if not per_step:
        return []
    groups = max(per_step.values())
    short = {s: n for s, n in per_step.items() if n < groups}
    discarded = sum(w.discarded for w in ev.of(events, ev.ReplicaSteps))
    lines = [f"replica groups: {groups}; {len(per_step)} step(s) committed, {len(short)} with fewer groups"
             + (f" (steps {ranges(sorted(short))}, as few as {min(short.values())})" if short else "")
             + f"; {discarded} step attempt(s) discarded by the commit vote"]
    lost = list(ev.of(events, ev.ReplicaLost))
    healed = [h for h in ev.of(events, ev.ReplicaHealed) if h.missed_steps or any(x.group == h.group for x in lost)]
    for g in sorted({x.group for x in lost} | {h.group for h in healed}):
        parts = [(x.t, f"lost at step {x.step if x.step is not None else '?'} ({x.cause})"
                  + (f", again on {','.join(x.next_hosts)}" if x.next_hosts else ", not started again"))
                 for x in lost if x.group == g]
        parts += [(h.t, f"healed at step {h.step} in {h.heal_s:.2f} s ({h.bytes / 1e6:.1f} MB from {h.peer})"
                   + (f", missed {h.missed_steps} step(s) = {h.missed_samples} sample(s) untrained"
                      if h.missed_steps is not None else ""))
                  for h in healed if h.group == g]
        if parts:  # in the order they happened
            lines.append(f"  group {g}: " + "; ".join(text for _, text in sorted(parts, key=lambda p: p[0])))
    ends = {e.group: e for e in ev.of(events, ev.ReplicaEnd)}
    if ends:
        crcs = {e.params_crc for e in ends.values()}
        lines.append(f"  ended: {len(ends)} group(s) at step(s) {sorted({e.step for e in ends.values()})}, "
                     + ("identical parameters" if len(crcs) == 1 else f"[red]{len(crcs)} different parameter "
                        "digests[/red]"))
    return lines
