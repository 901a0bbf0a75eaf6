"""A two-tier restore from node-local copies (in-job; imports torch): each rank's own local copy,
else its partner copy pulled over the network into its own local tier, checked as it loads --
sizes, crc32s from the bytes read, then the state's fingerprint -- before the first step
(docs/checkpoint.md, "Two tiers" and "Partner copies"; docs/recovery.md).

A copy that fails is withdrawn (its record removed, so no later start tries it again: no crash
loop), a `restore_rejected` event names it, and the restore plans again: the rank's partner copy
next, then an older generation; when none is left, the manager goes on with the durable tier.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dslurm import checkpoint as ck
from dslurm.checkpoint import fingerprint, landing, partner, replica, tiers
from dslurm.checkpoint.core import Comm, reason, to_state_dict
from dslurm.checkpoint.coverage import is_shard, plan_gaps, read_crc, whole_crcs
from dslurm.checkpoint.io import CrcReader, SafeLoadPlanner, SafeReader
from dslurm.checkpoint.tier import Context, LocalPick
from dslurm.observe import events

log = logging.getLogger(__name__)


class LocalRestore:
    """One restore's walk over the node-local copies (every method collective)."""

    def __init__(self, ctx: Context, local_dir: Path, nodes: list[str], groups: list[list[int]],
                 side: Comm) -> None:
        """`side`: a gloo group of the restore's own for the pulls (they run beside the load)."""
        self.ctx, self.local_dir, self.nodes, self.groups, self.side = ctx, local_dir, nodes, groups, side
        self._pull_t = 0.0
        self.lgdir = ck.generations_dir(local_dir)
        self.keeping: threading.Thread | None = None  # this rank's pulled copy, made its own (_keep)

    def run(self, state: dict[str, Any], pointer: ck.Pointer | None, phases: dict[str, float]) -> LocalPick:
        ctx = self.ctx
        rejected: list[tuple[str, list[str]]] = []
        while True:  # every failed try withdraws at least one record: this ends
            held = ctx.comm.gather(tiers.held_generations(self.local_dir, ctx.rank, ctx.world, ctx.settings.layout))
            copies = ctx.comm.gather(replica.held_copies(self.local_dir, ctx.world, ctx.settings.layout,
                                                         self.groups))
            cands, why = replica.restore_candidates(held, copies, self.nodes, pointer)
            if not cands:
                break
            c = cands[0]
            problems, pull = self._start_pull(c, self._streams(c)) if c.pulls else ({}, None)
            if pull is not None and not self._streams(c):
                problems = self._pulled_first(pull)
            if not problems:
                problems = self._load(c.name, state, phases, pull)
            pulled = self._joined(pull, c, phases) if pull is not None else None
            if not problems:
                if pulled is not None:
                    self._keep(pulled)
                used: dict[str, list[int]] = {"local": [r for r in range(ctx.world) if r not in c.pulls]}
                for r, (_, kind) in sorted(c.pulls.items()):
                    used.setdefault("partner" if kind == "partner" else "other_node", []).append(r)
                tier = "partner" if "partner" in used else "local"
                return LocalPick(c.name, self.lgdir, why, rejected, {k: v for k, v in used.items() if v}, tier)
            self._reject(c, problems)
            rejected.append((c.name, sorted(p for ps in problems.values() for p in ps)))
        if rejected:
            why = f"local {rejected[0][0]} failed verification ({rejected[0][1][0]}); {why}"
        return LocalPick(None, None, why, rejected)

    def _start_pull(self, c: replica.Candidate, stream: bool) -> tuple[dict[int, list[str]], partner.Pull | None]:
        """The candidate's pulls, started on the side group (partner.Pull): the load reads them as
        they land. -> (rank -> problems when a holder lost its record since it said it held it, the pull)."""
        ctx = self.ctx
        mine = {dst: tiers.read_record(ck.generations_dir(replica.copy_root(self.local_dir, kind)) / c.name, dst)
                for dst, (h, kind) in c.pulls.items() if h == ctx.rank}
        records: dict[int, dict[str, Any]] = {}
        for part in ctx.comm.gather({d: rec.to_json() for d, rec in mine.items() if rec is not None}):
            records.update(part)
        if set(records) != set(c.pulls):
            return {r: [f"{kind} copy of rank {r} on {self.nodes[h]}: record gone"]
                    for r, (h, kind) in c.pulls.items() if r not in records}, None
        self._pull_t = time.perf_counter()
        return {}, partner.Pull(self.side, c, self.local_dir, records, stream)

    def _streams(self, c: replica.Candidate) -> bool:
        """May the load read the pulled files as they land? Only where each pulling rank is alone on
        its node: a node's ranks read each other's files (its replicated items are written once per
        node, by one of them: NodeDedupPlanner), and a rank knows only its own pull's progress."""
        return all(len(next(g for g in self.groups if r in g)) == 1 for r in c.pulls)

    def _pulled_first(self, pull: partner.Pull) -> dict[int, list[str]]:
        """Every pull done and checked (sizes, crc32s) before any rank loads. -> rank -> problems."""
        every = self.ctx.comm.gather(pull.join()[0])
        return {r: ps for r, ps in enumerate(every) if ps}

    def _joined(self, pull: partner.Pull, c: replica.Candidate, phases: dict[str, float]) -> partner.Pulled | None:
        """Wait for this rank's part of the pull (every rank: a holder's sends too)."""
        problems, xfer, pulled = pull.join()
        dt = time.perf_counter() - self._pull_t
        phases["partner_pull"] = phases.get("partner_pull", 0.0) + dt  # overlaps the load
        got = sum(pull.landed.sizes.values()) if pull.landed is not None else 0
        if xfer.sent or got:
            log.info("[rank %d] partner copies of %s: sent %.1f MB, pulled %.1f MB in %.2f s%s", self.ctx.rank,
                     c.name, xfer.sent / 1e6, got / 1e6, dt, f": {problems[0]}" if problems else "")
        return pulled

    def _keep(self, pulled: partner.Pulled) -> None:
        """A pulled copy that loaded and verified becomes this node's own (fsync'd, then its record)
        on a thread of its own: the restore is over once the state is loaded and checked. The
        two-tier strategy joins it before its next save (whose retention would take a copy without
        a record for a partial one) and at wait(); a kill before the record leaves a partial copy,
        never used. A pull that failed or did not verify is never kept (retention deletes it)."""
        def keep() -> None:
            if err := pulled.keep(self.ctx.rank):
                log.warning("[rank %d] pulled copy of %s not kept in the local tier (a later start pulls "
                            "it again): %s", self.ctx.rank, pulled.gen.name, err)
        self.keeping = threading.Thread(target=keep, name="dslurm-partner-keep", daemon=True)
        self.keeping.start()

    def _reject(self, c: replica.Candidate, problems: dict[int, list[str]]) -> None:
        """Withdraw the copies that failed (own local record; a partner copy's record on its holder)
        and say so, loudly, once per copy."""
        ctx = self.ctx
        for r, ps in problems.items():
            if r == ctx.rank:
                tiers.drop_local(self.local_dir, c.name, r)
            holder, kind = c.pulls.get(r, (r, "local"))
            if holder == ctx.rank and r in c.pulls:
                replica.drop_copy(self.local_dir, kind, c.name, r)
            node = self.nodes[holder]
            if r == ctx.rank:
                log.error("[rank %d] %s COPY OF %s REJECTED (on %s): %s", r, kind.upper(), c.name, node,
                          "; ".join(ps[:5]))
            tensor = next((fingerprint.tensor_of(p) for p in ps if fingerprint.tensor_of(p)), "")
            ctx.event(events.RestoreRejected(run_dir=str(ctx.run_dir), generation=c.name, copy=kind, node=node,
                                             ranks=[r], tensor=tensor, reason="; ".join(ps[:3])[:1000]))

    def _load(self, name: str, state: dict[str, Any], phases: dict[str, float],
              pull: partner.Pull | None) -> dict[int, list[str]]:
        """Like the manager's checked load (CheckpointManager._load_checked), per node: each rank
        checks the files it committed (sizes, small files' crc32s), loads through CrcReader, checks
        its own shards' crc32s from what it read plus what it did not (read once more), then the
        state's fingerprint. A rank whose files are being pulled (`pull`) loads them as they land
        (landing.StreamedReader), without a second crc32: the pull computes each file's from the
        received bytes and checks size and crc32 against the record before the fingerprint.
        -> rank -> problems."""
        ctx, gen = self.ctx, self.lgdir / name
        t = time.perf_counter()
        landed = pull.landed if pull is not None else None
        if landed is None:
            rec = tiers.read_record(gen, ctx.rank)
            mine = rec.files if rec is not None else {}
            local = [] if rec is not None else [f"{tiers.record_path(gen, ctx.rank)}: missing"]
            local += ck.file_problems(gen, {n: e for n, e in mine.items() if is_shard(n)}, full=False)
            local += ck.file_problems(gen, {n: e for n, e in mine.items() if not is_shard(n)},
                                      full=ctx.settings.verify_on_restore == "full")
        else:  # the small files land first (partner.Stream); sizes and crc32s: pull.join below
            local = _landed_problems(landed)
        local += ck.metadata_problems(gen) if not local else []
        every = ctx.comm.gather(local)
        phases["precheck"] = phases.get("precheck", 0.0) + time.perf_counter() - t
        if any(every):
            return {r: ps for r, ps in enumerate(every) if ps}
        ctx.check_compat(json.loads((gen / ck.META).read_text()), state, gen)
        full = ctx.settings.verify_on_restore == "full"
        reader = CrcReader(gen) if landed is None else landing.StreamedReader(gen, landed)
        t, err = time.perf_counter(), None
        try:
            dcp.load(state, storage_reader=reader if full or landed else SafeReader(gen), planner=SafeLoadPlanner(),
                     process_group=ctx.comm.group, no_dist=ctx.comm.group is None)
        except (Exception, CheckpointException) as exc:
            err = reason(exc)
        phases["load"] = phases.get("load", 0.0) + time.perf_counter() - t
        t = time.perf_counter()
        if landed is not None:
            assert pull is not None
            local = pull.join()[0]  # the pulled files' sizes and crc32s against their record
        else:
            local = own_crc_problems(gen, mine, reader) if full else []
        phases["verify"] = phases.get("verify", 0.0) + time.perf_counter() - t
        t = time.perf_counter()
        if not local and err is None:  # the same ranks, the same layout: each holds what it saved
            local = fingerprint.check(gen / ck.RANKS / f"rank-{ctx.rank:05d}.json", to_state_dict(state))
        phases["fingerprint"] = phases.get("fingerprint", 0.0) + time.perf_counter() - t
        every = ctx.comm.gather(local)
        errors = ctx.comm.gather(err)
        if not any(every) and not any(errors) and (bad := ctx.replay_problems(gen, phases)):
            return {r: bad for r in range(ctx.world)}  # the assembled state is wrong: no one copy to blame
        if any(every) or not any(errors):
            return {r: ps for r, ps in enumerate(every) if ps}
        # The files match their records and the load still failed: this copy is refused like a bad
        # one (the walk goes on to the next copy, then durable), never raised -- a raise here was a
        # crash loop, every requeue meeting the same copy.
        return {r: [f"{gen}: dcp.load failed although its files match the local commit: {e}"]
                for r, e in enumerate(errors) if e}


def _landed_problems(landed: landing.Landed) -> list[str]:
    try:
        for n in landed.sizes:
            if not is_shard(n):
                landed.wait(n)
    except OSError as exc:
        return [reason(exc)]
    return []


def own_crc_problems(gen: Path, mine: dict[str, Any], reader: CrcReader) -> list[str]:
    sizes = {n: int(e["size"]) for n, e in mine.items() if is_shard(n)}
    gathered = [reader.sums.export()]  # only this rank's reads: its files are on its node
    problems, gaps = [], {}
    for fname, s, e in plan_gaps(sizes, gathered):
        try:
            gaps[(fname, s, e)] = read_crc(gen / fname, s, e)
        except OSError as exc:
            problems.append(f"{gen / fname}: unreadable at {s}..{e} ({exc})")
    if problems:
        return problems
    for fname, crc in whole_crcs(sizes, gathered, gaps).items():
        if f"{crc:08x}" != mine[fname]["crc32"]:
            problems.append(f"{gen / fname}: crc32 {crc:08x} != {mine[fname]['crc32']} "
                            "in the local commit (altered)")
    return problems
