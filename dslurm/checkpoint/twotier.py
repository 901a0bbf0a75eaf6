"""Two-tier checkpoints, the in-job half (imports torch): a save is written to node-local scratch and
locally committed, then copied to the durable run directory by a background copier, where the
manager's own commit (manifest -> verify -> restore test -> pointer) runs unchanged. A restore on
the same nodes and layout loads the newest locally committed generation, checked as it loads.

Why a planner of our own: DCP writes a replicated item (a plain tensor, a scheduler's bytes) once
for the whole job, into whichever rank's file it picks, and every other rank reads it from there.
With node-local files that read would cross nodes. NodeDedupPlanner deduplicates per node instead,
so every node holds each item its ranks load, and each node's `.metadata` (NodeWriter) points at
its own copies. The durable `.metadata` is node 0's: a valid map of the whole generation. The cost
is (nodes - 1) extra copies of the replicated items on durable storage: small under FSDP/TP,
the whole model under pure data parallelism (dp_replicate).
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from dslurm import checkpoint as ck
from dslurm import faults
from dslurm.checkpoint import partner, replica, tiers
from dslurm.checkpoint.compat import writer_streams
from dslurm.checkpoint.core import Comm, Job, SaveOutcome, reason, to_state_dict, write_reason
from dslurm.checkpoint.generation import prepare_generation
from dslurm.checkpoint.io import CrcFileSystem
from dslurm.checkpoint.local_restore import LocalRestore
from dslurm.checkpoint.tier import Context, LocalPick, thread_outcome
from dslurm.observe import events

log = logging.getLogger(__name__)


class NodeDedupPlanner(DefaultSavePlanner):
    """DCP's planner, deduplicating replicated items within each node instead of job-wide."""

    def __init__(self, groups: list[list[int]]) -> None:
        super().__init__()
        self.groups = groups

    def _create_global_plan(self, all_plans: list[Any]) -> tuple[list[Any], Any]:
        # The metadata (one entry per item, index hints rewritten) comes from DCP's job-wide plan;
        # the items each rank writes come from a per-node dedup. Storage records are keyed by
        # MetadataIndex, whose hint does not take part in comparisons, so extra copies map too.
        global_plan, metadata = super()._create_global_plan(all_plans)
        rewritten = {it.index: it for plan in global_plan for it in plan.items}
        per_node = list(all_plans)
        for group in self.groups:
            for rank, plan in zip(group, dedup_save_plans([all_plans[r] for r in group])):
                per_node[rank] = plan
        out = [dataclasses.replace(g, items=[rewritten.get(it.index, it) for it in n.items])
               for g, n in zip(global_plan, per_node)]
        return out, metadata


class NodeWriter(dcp.FileSystemWriter):
    """Streams crc32s (io.CrcFileSystem) and, on the coordinator, makes one `.metadata` per node:
    node k's points every item at a copy on node k when it has one. Node 0's is the one written."""

    def __init__(self, path: Path, groups: list[list[int]], io_threads: int) -> None:
        super().__init__(path, sync_files=True, thread_count=io_threads)
        if writer_streams(self):  # write_data/finish go through self.fs (torch 2.13-2.14; compat)
            self.fs = CrcFileSystem()
        self.groups = groups
        self.node_md: list[bytes] = []

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        def own_last(group: list[int]) -> list[list[Any]]:  # later results win in DCP's finish
            return [wr for r, wr in enumerate(results) if r not in group] + [results[r] for r in group]

        super().finish(metadata, own_last(self.groups[0]))
        self.node_md = [b""]
        for group in self.groups[1:]:
            storage = {w.index: w.storage_data for wrs in own_last(group) for w in wrs}
            self.node_md.append(pickle.dumps(dataclasses.replace(metadata, storage_data=storage)))


@dataclass
class _Flight:
    """One background save: local write and commit, then (maybe) the durable copy."""

    job: Job
    comm: Comm
    thread: threading.Thread | None = None
    local_done: threading.Event = field(default_factory=threading.Event)  # staging buffer free
    outcome: SaveOutcome | None = None


class TwoTier:
    """The two-tier strategy of a CheckpointManager (dslurm.checkpoint.tier; every method
    collective, like the manager's)."""

    kind = "two_tier"

    def __init__(self, ctx: Context, scratch: str, keep_local: int, on_lag: str, partner: bool = False,
                 partner_mbps: float = 0.0) -> None:
        if on_lag not in tiers.LAG_POLICIES:
            raise ck.CheckpointError(f"CheckpointManager on_lag={on_lag!r}: use one of {tiers.LAG_POLICIES}")
        if keep_local < 1:
            raise ck.CheckpointError(f"CheckpointManager keep_local={keep_local}: keep at least 1 local generation")
        self.ctx, self.keep_local, self.on_lag = ctx, keep_local, on_lag
        self.local_dir = tiers.local_run_dir(tiers.expand_scratch(scratch, tiers.node_name()), ctx.run_dir)
        self.lgdir = ck.generations_dir(self.local_dir)
        self.groups = tiers.node_groups(ctx.comm.gather(str(self.local_dir)))
        self.node = next(i for i, g in enumerate(self.groups) if ctx.rank in g)
        self.leader = ctx.rank == self.groups[self.node][0]
        self.nodes = ctx.comm.gather(tiers.node_name())
        self.pdir = replica.partner_root(self.local_dir)
        self.partnered, self.partner_mbps = partner and len(self.groups) > 1, partner_mbps
        if partner and not self.partnered and ctx.rank == 0:
            log.warning("checkpoint.partner: a job on one node has no partner node; local and durable copies only")
        if self.leader:  # local retention deletes in place, but a kill mid-delete leaves trash
            ctx.reap(self.local_dir)
            ctx.reap(self.pdir)
        self._comms = [Comm.new(ctx.comm.group is not None) for _ in range(2)]
        self._flights: list[_Flight] = []
        self._keeping: threading.Thread | None = None

    # ------------------------------------------------------------ save

    def save(self, step: int, state: dict[str, Any], extra: dict[str, Any], blocking: bool) -> bool:
        ctx = self.ctx
        self._kept()  # before any retention of this save's can see the pulled copy without its record
        writing, copying = self._status()
        if not blocking and writing and ctx.settings.on_inflight == "skip":
            return self._skip(step, "in_flight", "previous save still writing its local copy (on_inflight=skip)")
        if not blocking and copying and not writing and self.on_lag == "skip_local":
            return self._skip(step, "lag", "durable copier behind (on_lag=skip_local)")
        if blocking:
            self.wait()
        elif writing:  # on_inflight=wait: the staging buffer is free once the local commit is done
            for fl in self._flights:
                fl.local_done.wait()
            writing, copying = self._status()
        waited = 0.0
        if copying and self.on_lag == "wait":
            log.info("[rank %d] step %d: waiting for the durable copier (on_lag=wait)", ctx.rank, step)
            t = time.perf_counter()
            self.wait()
            waited = time.perf_counter() - t
        job = ctx.new_job(step, extra)
        job.lag_wait_s = waited
        sd = to_state_dict(state)
        if blocking:  # a stop's or the final save: local and durable before returning
            out = self._run(job, sd, ctx.comm, None)
            out.stall_s = out.total_s
            self._report(out, background=False)
            return out.ok
        staged = ctx.stage(sd, state)  # host copy, made while the next step computes
        stall = time.perf_counter() - job.t0 + waited  # the lag policy's wait blocked training too
        busy = [f.comm for f in self._flights]
        comm = next(c for c in self._comms if all(c is not b for b in busy))
        fl = _Flight(job, comm)
        prev = self._flights[-1] if self._flights else None
        fl.thread = threading.Thread(target=self._background, args=(fl, staged, stall, prev),
                                     name="dslurm-ckpt-2tier", daemon=True)
        self._flights.append(fl)
        fl.thread.start()
        return True

    def wait(self) -> None:
        """Join every flight in order and report it (on_error applies)."""
        self._kept()
        while self._flights:
            fl = self._flights.pop(0)
            assert fl.thread is not None
            fl.thread.join()
            self._report(fl.outcome)

    def _status(self) -> tuple[bool, bool]:
        """(some save still writing its local copy, some durable copy running), agreed by all
        ranks; flights finished on every rank are reported and dropped."""
        mine = [(f.thread is not None and f.thread.is_alive(), f.local_done.is_set()) for f in self._flights]
        every = self.ctx.comm.gather(mine)
        alive = [any(r[i][0] for r in every) for i in range(len(mine))]
        done = [all(r[i][1] for r in every) for i in range(len(mine))]
        for fl, a in zip(list(self._flights), alive):
            if not a:
                assert fl.thread is not None
                fl.thread.join()
                self._flights.remove(fl)
                self._report(fl.outcome)
        live = [(a, d) for a, d in zip(alive, done) if a]
        return any(not d for _, d in live), any(d for _, d in live)

    def _skip(self, step: int, why: str, text: str) -> bool:
        return self.ctx.skipped(step, why, text)

    def _report(self, out: SaveOutcome | None, background: bool = True) -> None:
        assert out is not None  # _background always sets it
        if background:  # training also waited for its host copy at the optimizer step's fence
            out.stall_s += self.ctx.take_blocked()
        if out.ok and not out.durable:
            log.warning("[rank %d] checkpoint step %d: %s", self.ctx.rank, out.step, out.reason)
            self.ctx.event(events.CkptDurableSkipped(run_dir=str(self.ctx.run_dir), step=out.step,
                                                      generation=out.generation, reason=out.reason))
            return
        self.ctx.finish(out)

    def _background(self, fl: _Flight, staged: Future[dict[str, Any]], stall: float,
                    prev: _Flight | None) -> None:
        def run() -> SaveOutcome:
            host = staged.result()  # the host copy, made while training goes on
            faults.save_sleep()
            return self._run(fl.job, host, fl.comm, fl, prev)

        try:
            out = thread_outcome(fl.job, run, tier="two_tier")
        finally:
            fl.local_done.set()
        out.stall_s = stall
        fl.outcome = out

    def _run(self, job: Job, sd: dict[str, Any], comm: Comm, fl: _Flight | None,
             prev: _Flight | None = None) -> SaveOutcome:
        """Local write + local commit, then the durable copy unless on_lag=skip_durable finds
        the previous copy still running."""
        rec, err = self._write_local(job, sd, comm)
        if fl is not None:
            fl.local_done.set()
        if rec is None:
            if self.leader and (self.lgdir / job.name).exists():  # every rank is past its writes
                ck.remove_generation(self.local_dir, job.name)
            return SaveOutcome(job.name, job.step, False, f"local tier ({self.local_dir}): {err}",
                               total_s=time.perf_counter() - job.t0, tier="two_tier")
        local_s, local_t = time.perf_counter() - job.t0, time.time()
        job.phases["local_commit"] = local_s
        if comm.rank == 0:
            nbytes = sum(int(e["size"]) for e in rec.files.values())
            self.ctx.event(events.CkptLocalCommit(run_dir=str(self.ctx.run_dir), step=job.step,
                                                   generation=job.name, bytes=nbytes, local_s=round(local_s, 4),
                                                   lag_wait_s=round(job.lag_wait_s, 4)))
        faults.ckpt_kill("after_local_commit", comm.rank, job.nth)
        if self.partnered:
            self._push(job, rec, comm, local_t)
        if prev is not None and any(comm.gather(prev.thread is not None and prev.thread.is_alive())):
            out = SaveOutcome(job.name, job.step, True, "durable copy skipped: the copier is still busy "
                              f"with {prev.job.name} (on_lag=skip_durable); local only",
                              total_s=time.perf_counter() - job.t0, tier="two_tier", durable=False)
        else:
            out = self._copy(job, rec, comm)
            out.lag_s = round(time.time() - local_t, 4) if out.ok else None
        out.local_s, out.local_commit_t = round(local_s, 4), round(local_t, 3)
        self._gc_local(job.name)
        return out

    def _push(self, job: Job, rec: tiers.LocalRecord, comm: Comm, local_t: float) -> None:
        """The partner copy of this generation (partner.push); a failure costs the copy, not the save."""
        pgen = ck.generations_dir(self.pdir) / job.name
        err, xfer = partner.push(comm, self.groups, self.lgdir / job.name, pgen, rec,
                                 mbps=self.partner_mbps, nth=job.nth)
        rates = comm.gather((xfer.sent, xfer.seconds))
        if err:
            log.warning("[rank %d] partner copy of %s failed: %s", comm.rank, job.name, err)
        if comm.rank == 0:
            nbytes = sum(b for b, _ in rates)
            slowest = min((b / s / 1e6 for b, s in rates if s > 0), default=0.0)
            self.ctx.event(events.CkptPartnerCommit(
                run_dir=str(self.ctx.run_dir), step=job.step, generation=job.name, ok=not err, bytes=nbytes,
                partner_s=round(time.time() - local_t, 4), mb_per_s=round(slowest, 1), reason=err[:500]))
        job.phases["partner"] = time.perf_counter() - job.t0
        if self.leader:
            busy = [f.job.name for f in list(self._flights)] + [job.name]
            try:
                replica.collect_partner_garbage(self.local_dir, self.keep_local, busy)
            except OSError as exc:
                log.warning("partner copy gc in %s failed: %s", self.pdir, exc)

    def _write_local(self, job: Job, sd: dict[str, Any], comm: Comm) -> tuple[tiers.LocalRecord | None, str]:
        """Every rank writes its shard to its node's scratch; the record of each rank is written
        only once every rank reported its write complete with crc32s. -> (record, error)."""
        gen, r, ctx = self.lgdir / job.name, comm.rank, self.ctx
        writer = None
        now, rest = prepare_generation(gen, job, sd, r, comm.world, leader=self.leader)
        err = now or ""
        if not any(comm.gather(err)):
            try:
                writer = NodeWriter(gen, self.groups, ctx.settings.io_threads)
                dcp.save(sd, storage_writer=writer, planner=NodeDedupPlanner(self.groups),
                         process_group=comm.group, no_dist=comm.group is None)
                job.phases["dcp"] = time.perf_counter() - job.t0
                err = rest.result() or ""
                if not err:
                    faults.ckpt_kill("after_write", r, job.nth)
            except (Exception, CheckpointException) as exc:
                err = write_reason(exc, gen)
        err = err or rest.result() or ""  # the side work is over before anything is decided
        errors = [e for e in comm.gather(err) if e]
        if errors:
            return None, errors[0]
        mds = comm.bcast(writer.node_md if r == 0 and writer is not None else None)
        rec = None
        try:
            if self.leader and self.node > 0:
                ck.atomic_write_bytes(gen / ".metadata", mds[self.node])
            assert writer is not None
            streamed: dict[str, Any] = getattr(writer.fs, "sums", {})  # none: checksummed below
            own = [p.name for p in gen.iterdir() if p.name.startswith(f"__{r}_")]
            small = [f"{ck.RANKS}/rank-{r:05d}.json"] + ([".metadata", ck.META] if self.leader else [])
            files = {n: streamed[n] for n in own if n in streamed}
            files.update(ck.checksum_files(gen, [n for n in own + small if n not in files]))
            rec = tiers.LocalRecord(job.name, job.step, r, comm.world, ctx.settings.layout, files, time.time(),
                                     self.groups)
        except Exception as exc:
            err = reason(exc)
        errors = [e for e in comm.gather(err) if e]
        if not errors and rec is not None:
            try:
                tiers.write_record(gen, rec)
            except Exception as exc:
                err = write_reason(exc, gen)
            errors = [e for e in comm.gather(err) if e]  # committed once every record is written
        if errors:
            tiers.drop_local(self.local_dir, job.name, r)
            return None, errors[0]
        return rec, ""

    def _copy(self, job: Job, rec: tiers.LocalRecord, comm: Comm) -> SaveOutcome:
        """Each rank copies what it locally committed (crc32 re-checked on the way); rank 0 then
        runs the unchanged durable commit. Only rank 0's `.metadata` and meta.json go."""
        ctx, r = self.ctx, comm.rank
        dgen, src = ctx.gdir / job.name, self.lgdir / job.name
        err, sums = "", {}
        try:
            (dgen / ck.RANKS).mkdir(parents=True, exist_ok=True)
            mbps = faults.durable_mbps()
            names = sorted(n for n in rec.files if r == 0 or n not in (".metadata", ck.META))
            for i, name in enumerate(names):
                sums[name] = tiers.copy_file(src / name, dgen / name, want=rec.files[name], mbps=mbps)
                if i == 0:
                    faults.ckpt_kill("mid_copy", r, job.nth)
        except Exception as exc:
            err = write_reason(exc, dgen)
        results = comm.gather((err, sums))
        verdict = ctx.commit(dgen, job, results) if r == 0 else None
        ok, reason, nbytes = comm.bcast(verdict)
        if not ok:
            reason = f"durable copy: {reason}"
        return SaveOutcome(job.name, job.step, ok, reason, nbytes, 0.0, time.perf_counter() - job.t0,
                           dict(job.phases), tier="two_tier")

    def _gc_local(self, current: str) -> None:
        """Node leaders: local retention. Never a generation in flight (being written or copied);
        never one newer than `current` (a save started after this one's snapshot)."""
        if not self.leader:
            return
        busy = {f.job.name for f in list(self._flights)} | {current}
        newer = {g.name for g in ck.list_generations(self.local_dir)
                 if (ck.parse_step(g.name) or -1, g.name) > (ck.parse_step(current) or -1, current)}
        try:
            doomed = tiers.collect_local_garbage(self.local_dir, self.groups[self.node], self.keep_local,
                                                 busy | newer)
            if doomed:
                log.info("[rank %d] local checkpoint gc in %s: removed %s", self.ctx.rank, self.local_dir,
                         ", ".join(doomed))
        except OSError as exc:  # pruning must never turn a committed save into a failure
            log.warning("local checkpoint gc in %s failed: %s", self.local_dir, exc)

    # ------------------------------------------------------------ restore

    def restore_first(self, state: dict[str, Any], pointer: ck.Pointer | None,
                      phases: dict[str, float]) -> LocalPick:
        """The newest generation every rank has a node-local copy of, its own or (pulled) its
        partner's, not older than the durable pointer, that verifies as it loads
        (dslurm.checkpoint.local_restore)."""
        walk = LocalRestore(self.ctx, self.local_dir, self.nodes, self.groups, self._comms[0])  # no flight: wait()ed
        pick = walk.run(state, pointer, phases)
        self._keeping = walk.keeping
        return pick

    def _kept(self) -> None:
        """Wait for the restore's pulled copy to become this node's own (LocalRestore._keep)."""
        if self._keeping is not None:
            self._keeping.join()
            self._keeping = None
