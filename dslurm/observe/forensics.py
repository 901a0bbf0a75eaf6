"""Which rank did not enter which collective: PyTorch's Flight Recorder dumps, read. Pure, but for `read_dumps`.

Every process group records each collective it is asked for (torch's Flight Recorder, the
`TORCH_FR_BUFFER_SIZE` ring; dslurm turns it on in `dslurm.health.process_group`): its
process group, its per-group sequence number (`collective_seq_id`), the op
(`profiling_name`, e.g. `gloo:all_gather_into_tensor`), the tensor sizes, when it was
enqueued (`time_created_ns`) and whether it finished (`retired`). The torch 2.13 CPU build
records gloo's collectives too (checked: a rank blocked in an all-reduce shows it not retired
while its peer, still computing, has not enqueued it). So the FSDP2/TP/PP collectives inside
one `forward_backward` are visible one by one, in every group of the DeviceMesh.

At a hang each rank dumps its ring (dslurm/runtime/flight.py) and notes, per group, the last
collective it entered, whether it is still inside it and the op; `stalls` compares the notes:
collective #N of group G that some members wait inside while other members never entered it
names those members, with the op. A member that is itself waiting inside another collective is
held up there (a victim of that stall), not a root; one outside every collective is the root.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUBDIR = "fr"  # <start dir>/fr/rank-NNNNN: one dump per rank, the analyser's file names
VIEW = "python -m torch.distributed.flight_recorder.fr_trace {dir}"


@dataclass(frozen=True)
class GroupState:
    """One rank's view of one process group, from its Flight Recorder dump."""

    group: str
    """the process group's name (c10d's, the same on every member)"""
    desc: str
    ranks: list[int]
    """its members, as global ranks (empty: not known)"""
    entered: int
    """the last collective's sequence number this rank enqueued on the group (0: none)"""
    completed: int
    """the last one that finished here"""
    op: str
    """the op of collective #entered"""
    sizes: list[Any] = field(default_factory=list)
    """its input sizes"""
    t_ns: int = 0
    """when this rank entered it (wall clock, ns)"""
    p2p_inside: list[str] = field(default_factory=list)
    """point-to-point ops (PP's send/recv) enqueued and not finished, e.g. 'gloo:send #3'"""

    @property
    def inside(self) -> bool:
        return self.entered > self.completed


def group_states(dump: Mapping[str, Any]) -> dict[str, GroupState]:
    """A Flight Recorder dump (its pickle or JSON form: the same keys) -> the state of each of
    its process groups. `pg_config` maps a group name to its desc and ranks (`'[0, 1]'`)."""
    config = dump.get("pg_config") or {}
    by_group: dict[str, dict[str, Any]] = {}
    for e in dump.get("entries") or []:
        pg = e.get("process_group") or ["?", ""]
        name, desc = str(pg[0]), str(pg[1]) if len(pg) > 1 else ""
        g = by_group.setdefault(name, {"desc": desc, "entered": 0, "completed": 0, "op": "", "sizes": [],
                                       "t": 0, "p2p": []})
        if e.get("is_p2p"):
            if not e.get("retired"):
                g["p2p"].append(f"{e.get('profiling_name')} #{e.get('p2p_seq_id')}")
            continue
        seq = int(e.get("collective_seq_id") or 0)
        if seq >= g["entered"]:
            g.update(entered=seq, op=str(e.get("profiling_name") or "?"), sizes=list(e.get("input_sizes") or []),
                     t=int(e.get("time_created_ns") or 0))
        if e.get("retired") and seq > g["completed"]:
            g["completed"] = seq
    out = {}
    for name, g in by_group.items():
        raw = config.get(name)
        cfg: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
        out[name] = GroupState(group=name, desc=str(cfg.get("desc") or g["desc"]), ranks=_ranks(cfg.get("ranks")),
                               entered=g["entered"], completed=g["completed"], op=g["op"], sizes=g["sizes"],
                               t_ns=g["t"], p2p_inside=g["p2p"])
    for name, cfg in config.items():  # a group this rank belongs to but never used
        if name not in out and isinstance(cfg, Mapping) and name:
            out[name] = GroupState(group=str(name), desc=str(cfg.get("desc") or ""), ranks=_ranks(cfg.get("ranks")),
                                   entered=0, completed=0, op="")
    return out


def _ranks(raw: Any) -> list[int]:
    if isinstance(raw, str):
        raw = [x for x in raw.strip("[]() ").replace(",", " ").split() if x.lstrip("-").isdigit()]
    try:
        return sorted(int(x) for x in raw or [])
    except (TypeError, ValueError):
        return []


def to_note(states: Mapping[str, GroupState]) -> dict[str, dict[str, Any]]:
    """The JSON form a rank's hang note carries."""
    return {k: asdict(v) for k, v in states.items()}


def from_note(raw: Any) -> dict[str, GroupState]:
    """Back from `to_note` (tolerant: a garbled note reads as no groups)."""
    out = {}
    for k, v in (raw or {}).items() if isinstance(raw, Mapping) else ():
        try:
            out[str(k)] = GroupState(**v)
        except TypeError:
            continue
    return out


@dataclass(frozen=True)
class Stall:
    """Collective #seq of a group: who waits inside it, who never entered it."""

    group: str
    desc: str
    seq: int
    op: str
    sizes: list[Any]
    waiting: list[int]
    """members that entered #seq (inside it, or failed in it)"""
    missing: list[int]
    """members that have not entered #seq (with a dump)"""
    behind: dict[str, int]
    """missing member -> the last collective of this group it entered"""
    silent: list[int]
    """members that left no dump"""
    ops_differ: list[str] = field(default_factory=list)
    """the ops the waiting members are in, when they are not the same (a mismatch)"""
    t_ns: int = 0
    """the first waiting member's entry (wall clock)"""
    live: bool = True
    """some member is still inside it (a hang); False: the dumps were taken after it failed"""

    def sentence(self) -> str:
        grp = f"group {self.group}" + (f" ({self.desc})" if self.desc and self.desc != self.group else "")
        what = f"collective #{self.seq} ({self.op}" + (f" {self.sizes}" if self.sizes else "") + f") of {grp}"
        if self.ops_differ:
            what += f" (the waiting ranks are in different ops: {', '.join(self.ops_differ)})"
        parts = []
        if self.missing:
            behind = ", ".join(f"rank {r} at #{n}" for r, n in sorted(self.behind.items(), key=lambda x: int(x[0])))
            parts.append(f"rank(s) {self.missing} did not enter {what} ({behind})")
        if self.silent:
            parts.append(f"rank(s) {self.silent} left no flight-recorder dump")
        if not parts:
            parts.append(f"every member is inside {what}")
        if self.live:
            return "; ".join(parts) + f" while rank(s) {self.waiting} wait inside it"
        return "; ".join(parts) + f"; rank(s) {self.waiting} entered it and it failed there"

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "sentence": self.sentence()}


def stalls(states: Mapping[int, Mapping[str, GroupState]], world: int) -> list[Stall]:
    """The collectives some members wait inside, one per group, earliest first. `states`: rank
    -> its groups (ranks that left no dump are absent)."""
    members: dict[str, set[int]] = {}
    for r, groups in states.items():
        for name, g in groups.items():
            members.setdefault(name, set()).update(g.ranks or ([r] if name else []))
            members[name].add(r)
    out = []
    for name, ranks in members.items():
        seen = {r: states[r].get(name) for r in sorted(ranks) if r in states}
        entered = {r: (g.entered if g is not None else 0) for r, g in seen.items()}
        top = max(entered.values(), default=0)
        waiting = sorted(r for r, g in seen.items() if g is not None and g.entered == top)
        missing = sorted(r for r, n in entered.items() if n < top)
        inside = [st for r in waiting if (st := seen[r]) is not None]
        # Live (a hang): some member still waits inside #top. After the error (an own script's
        # ranks dump as their collective fails, which retires it): a member that never entered
        # #top still shows it -- a collective cannot complete without every member.
        live = any(st.inside for st in inside)
        if not live:  # a member with no entry of the group may only have had it evicted from its ring
            missing = [r for r in missing if entered[r] > 0]
        if not top or not (live or missing):
            continue
        first = min(inside, key=lambda st: st.t_ns)
        ops = sorted({st.op for st in inside})
        silent = sorted(r for r in ranks if r not in states and r < world)
        out.append(Stall(group=name, desc=first.desc, seq=top, op=first.op, sizes=first.sizes, waiting=waiting,
                         missing=missing, behind={str(r): entered[r] for r in missing}, silent=silent,
                         ops_differ=ops if len(ops) > 1 else [], t_ns=first.t_ns,
                         live=live))
    return sorted(out, key=lambda s: (not (s.missing or s.silent), s.t_ns))


def verdict(states: Mapping[int, Mapping[str, GroupState]], world: int) -> tuple[list[int], str, list[Stall]]:
    """(suspects, why, stalls) from the dumps; no suspects when the dumps name nobody (no
    dumps, or every member inside the same collective). Roots first: a missing rank that is
    not itself inside any collective; else (each waits on another: collectives entered in a
    different order) every missing rank."""
    found = stalls(states, world)
    blocked = [s for s in found if s.missing or s.silent]
    if not blocked:
        return [], "", found
    inside_any = {r for r, groups in states.items() if any(g.inside or g.p2p_inside for g in groups.values())}
    missing = {r for s in blocked for r in s.missing}
    roots = sorted(missing - inside_any)
    silent = sorted({r for s in blocked for r in s.silent})
    if roots or silent:
        who = sorted(set(roots) | set(silent))
        main = [s for s in blocked if set(s.missing) & set(roots) or s.silent]
    else:
        who, main = sorted(missing), blocked
    why = "; ".join(s.sentence() for s in main[:3])
    if not roots and not silent:
        why += " (each of them waits inside another collective: the ranks entered collectives in a different order)"
    return who, why, found


def summary_lines(stall_dicts: Sequence[Mapping[str, Any]], limit: int = 3) -> list[str]:
    """The hang event's `flight` entries as text (report, doctor)."""
    return [str(s.get("sentence") or "") for s in stall_dicts[:limit] if isinstance(s, Mapping)]


class _Plain(pickle.Unpickler):
    """A dump holds plain values only (dicts, lists, strings, numbers); a class in one is refused
    unrun, like every pickle dslurm reads from a run directory (dslurm/checkpoint/unpickle.py, which
    this package sits below)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"a Flight Recorder dump names {module}.{name}; refused unrun")


def _plain_loads(data: bytes) -> Any:
    import io
    return _Plain(io.BytesIO(data)).load()


def read_dumps(start_dir: Path) -> dict[int, dict[str, GroupState]]:
    """Every rank's dump in `<start dir>/fr` -> rank -> its group states (doctor; own scripts,
    whose ranks dump when a collective fails). Unreadable dumps are skipped."""
    d = start_dir / SUBDIR
    out = {}
    for f in sorted(d.glob("rank-*")) if d.is_dir() else []:
        try:
            out[int(f.name.split("-")[1])] = group_states(_plain_loads(f.read_bytes()))
        except (OSError, ValueError, IndexError, pickle.UnpicklingError, EOFError, AttributeError, TypeError):
            continue
    return out
