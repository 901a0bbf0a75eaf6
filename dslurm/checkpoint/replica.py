"""Partner copies of two-tier checkpoints, the torch-free half: where a node keeps the copy of its
neighbour's shards, the ring that says who sends to whom, which copies a restore takes, and what
partner retention deletes (docs/checkpoint.md, "Partner copies").

On each node, beside its own local tier (dslurm.checkpoint.tiers)::

    <local run dir>/partner/generations/step-.../
        __<rank>_<i>.distcp, .metadata, meta.json, ranks/rank-N.json
                                      the files node i-1's ranks committed locally, as they
                                      committed them (same names, same crc32s)
        local/rank-NNNNN.json         rank N's local commit record, copied last: a partner copy
                                      of rank N counts only once its record is here

The copy travels through the job's own processes (a gloo group of the checkpoint's own, rank to
rank: dslurm.checkpoint.partner), never through a path on another node. A restore takes, per rank,
its own local copy, else a partner copy held by another rank of the job (pulled over the same
network into the rank's own local tier, checked as it arrives), else the durable tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dslurm import checkpoint as ck
from dslurm.checkpoint import tiers

PARTNER = "partner"


def partner_root(local_dir: Path) -> Path:
    """The 'run dir' whose generations/ holds this node's partner copies."""
    return Path(local_dir) / PARTNER


def ring(groups: Sequence[Sequence[int]]) -> dict[int, int]:
    """Sender rank -> receiving rank: node i's ranks send to node i+1's (the last node's to node 0's),
    position p to position p mod the receiver's size, never within a node. Empty for one node.
    Pure."""
    n = len(groups)
    if n < 2:
        return {}
    out = {}
    for i, group in enumerate(groups):
        nxt = groups[(i + 1) % n]
        for p, rank in enumerate(group):
            out[rank] = nxt[p % len(nxt)]
    return out


def held_copies(local_dir: Path, world: int, layout: dict[str, Any],
                groups: Sequence[Sequence[int]]) -> dict[str, dict[int, str]]:
    """Generation -> {rank: "local" | "partner"}: the ranks whose committed copy this node holds
    in its local tier or its partner tier, of a save with the same world size, layout and ranks per
    node as now (a pulled copy is loaded as the node's own, so the nodes must group the ranks the
    same way). Every rank of a node sees the same."""
    want = [list(g) for g in groups]
    out: dict[str, dict[int, str]] = {}
    for kind, root in (("partner", partner_root(local_dir)), ("local", Path(local_dir))):
        for g in ck.list_generations(root):
            for p in sorted((g.path / tiers.LOCAL).glob("rank-*.json")):
                try:
                    r = int(p.stem.split("-")[1])
                except (IndexError, ValueError):
                    continue
                rec = tiers.read_record(g.path, r)
                if (rec is not None and rec.world_size == world and rec.layout == layout
                        and rec.generation == g.name and rec.groups == want):
                    out.setdefault(g.name, {})[r] = kind
    return out


@dataclass(frozen=True)
class Candidate:
    """One generation a restore may load from node-local copies: `pulls` maps each rank without its
    own local copy to (the rank holding a copy of its files, "partner" or "local": which tier of
    the holder's node keeps it)."""

    name: str
    pulls: dict[int, tuple[int, str]] = field(default_factory=dict)


def restore_candidates(local_held: Sequence[Sequence[str]], copies: Sequence[dict[str, dict[int, str]]],
                       nodes: Sequence[str], pointer: ck.Pointer | None) -> tuple[list[Candidate], str]:
    """Generations loadable from node-local copies, newest first, and why. Each rank takes its own
    local copy, else a copy of its files another rank's node holds -- the partner copy the ring
    made, or (ranks placed on other nodes than before) that node's own local copy -- pulled over
    the network into its own local tier. A generation qualifies when every rank has one and it is
    not older than the durable pointer's. `copies[h]` is what rank h's node holds (held_copies);
    `nodes[r]` is rank r's node. Pure."""
    world = len(local_held)
    names = {n for h in local_held for n in h} | {n for c in copies for n in c}
    floor = (ck.parse_step(pointer.generation) or 0) if pointer is not None else -1
    out: list[Candidate] = []
    for name in sorted(names, key=lambda n: (ck.parse_step(n) or -1, n), reverse=True):
        if (ck.parse_step(name) or -1) < floor:
            continue
        pulls: dict[int, tuple[int, str]] = {}
        for r in range(world):
            if name in local_held[r]:
                continue
            holders = [(h, kind) for h in range(world) if h != r and (kind := copies[h].get(name, {}).get(r))
                       and not (kind == "local" and nodes[h] == nodes[r])]  # never a file onto itself
            best = [x for x in holders if x[1] == "partner"] or holders  # the ring's copy first
            if not best:
                break
            pulls[r] = best[r % len(best)]
        else:
            out.append(Candidate(name, pulls))
    if not out:
        _, why = tiers.local_candidates(local_held, pointer)
        if any(copies):
            why += "; no copy on another node completes a newer generation"
        return [], why
    return out, describe(out[0], nodes)


def describe(c: Candidate, nodes: Sequence[str]) -> str:
    """Where each rank's copy of a candidate comes from, for the ledger and the log. Pure."""
    world = len(nodes)
    if not c.pulls:
        return f"{c.name} is locally committed on all {world} ranks"
    by_holder: dict[tuple[str, str], list[int]] = {}
    for r, (h, kind) in sorted(c.pulls.items()):
        by_holder.setdefault((kind, nodes[h]), []).append(r)
    parts = [f"ranks {_span(rs)} from the {kind} copy on {node}" for (kind, node), rs in by_holder.items()]
    local = world - len(c.pulls)
    return f"{c.name}: " + "; ".join(parts) + (f"; {local} ranks from their own local copy" if local else "")


def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)) \
        else ",".join(map(str, ranks))


def copy_root(local_dir: Path, kind: str) -> Path:
    """The 'run dir' of a node's tier: its own local copies, or the partner copies it keeps."""
    return partner_root(local_dir) if kind == "partner" else Path(local_dir)


def drop_copy(local_dir: Path, kind: str, name: str, rank: int) -> None:
    """Withdraw a node's copy of one rank's files that failed to verify: never pulled again."""
    tiers.record_path(ck.generations_dir(copy_root(local_dir, kind)) / name, rank).unlink(missing_ok=True)


def collect_partner_garbage(local_dir: Path, keep: int, in_flight: Sequence[str] = ()) -> list[str]:
    """A node leader's partner retention: partial copies (no record: a transfer cut short) not in
    flight, and committed ones beyond the newest `keep`."""
    root = partner_root(local_dir)
    gens = [(g.name, any((g.path / tiers.LOCAL).glob("rank-*.json"))) for g in ck.list_generations(root)]
    doomed = tiers.plan_local_retention(gens, keep, in_flight)
    for name in doomed:
        ck.remove_generation(root, name)
    return doomed
