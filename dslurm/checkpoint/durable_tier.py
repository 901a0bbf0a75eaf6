"""The durable-only tier (in-job; imports torch): every save written straight into the run
directory as a new generation with DCP, its crc32s streamed, then committed by rank 0
(dslurm.checkpoint.generation). Sync, or async: the host copy while training goes on, then the
write, verify and pointer on a thread of their own, on a gloo group of their own (the background
thread's collectives must never interleave with training's; ARCHITECTURE.md traps).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from dslurm import faults
from dslurm.checkpoint.core import Comm, Job, SaveOutcome, to_state_dict, write_reason
from dslurm.checkpoint.generation import own_sums, prepare_generation
from dslurm.checkpoint.io import crc_writer
from dslurm.checkpoint.tier import Context, LocalPick, thread_outcome

log = logging.getLogger(__name__)


class DurableTier:
    kind = "durable"

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self._bg = Comm.new(ctx.comm.group is not None and ctx.settings.async_mode)
        self._thread: threading.Thread | None = None
        self._outcome: SaveOutcome | None = None

    def save(self, step: int, state: dict[str, Any], extra: dict[str, Any], blocking: bool) -> bool:
        ctx = self.ctx
        if self._thread is not None:
            busy = any(ctx.comm.gather(self._thread.is_alive()))  # one decision for all ranks
            if busy and not blocking and ctx.settings.on_inflight == "skip":
                return ctx.skipped(step, "in_flight", "previous save still in flight (on_inflight=skip)")
            if busy:
                log.info("[rank %d] step %d: waiting for the in-flight save (on_inflight=%s)",
                         ctx.rank, step, "wait" if not blocking else "blocking save")
            self.wait()
        job = ctx.new_job(step, extra)
        sd = to_state_dict(state)
        if ctx.settings.async_mode and not blocking:
            staged = ctx.stage(sd, state)
            stall = job.since()
            self._thread = threading.Thread(target=self._background, args=(job, staged, stall),
                                            name="dslurm-ckpt", daemon=True)
            self._thread.start()
            return True
        out = self.write(job, sd, ctx.comm)
        out.stall_s = out.total_s
        ctx.finish(out)
        return out.ok

    def wait(self) -> None:
        """Block until the in-flight save (if any) is committed or failed; apply on_error."""
        if self._thread is None:
            return
        self._thread.join()
        self._thread, out = None, self._outcome
        assert out is not None  # _background always sets it
        out.stall_s += self.ctx.take_blocked()
        self.ctx.finish(out)

    def restore_first(self, state: dict[str, Any], pointer: Any, phases: dict[str, float]) -> LocalPick | None:
        return None  # nothing faster than the durable pointer

    def _background(self, job: Job, staged: Future[dict[str, Any]], stall: float) -> None:
        def run() -> SaveOutcome:
            host = staged.result()  # the host copy, made while training goes on
            faults.save_sleep()
            return self.write(job, host, self._bg)

        out = thread_outcome(job, run)
        out.stall_s = stall
        self._outcome = out

    def write(self, job: Job, sd: dict[str, Any], comm: Comm) -> SaveOutcome:
        ctx = self.ctx
        gen, r = ctx.gdir / job.name, comm.rank
        # local preparation; gathered before DCP so that no rank waits in a collective alone
        err, rest = prepare_generation(gen, job, sd, r, comm.world, leader=r == 0)
        sums: dict[str, Any] = {}
        job.phases["prep"] = job.since()
        if not any(comm.gather(err)):
            try:  # dcp.save is collective and raises on every rank if any rank's write failed
                writer, streamed = crc_writer(gen, ctx.settings.io_threads)  # crc32 while writing
                dcp.save(sd, storage_writer=writer, process_group=comm.group,
                         no_dist=comm.group is None)
                job.phases["dcp"] = job.since()
                err = rest.result()
                if err is None:
                    faults.ckpt_kill("after_write", r, job.nth)
                    sums = own_sums(gen, r, streamed)
                    job.phases["crc32"] = job.since()
            except (Exception, CheckpointException) as exc:  # the latter is a BaseException
                err = write_reason(exc, gen)
        err = err or rest.result()
        results = comm.gather((err, sums))
        verdict = ctx.commit(gen, job, results) if r == 0 else None
        ok, reason, nbytes = comm.bcast(verdict)
        return SaveOutcome(job.name, job.step, ok, reason, nbytes, 0.0, job.since(), dict(job.phases))
