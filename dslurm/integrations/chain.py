"""What every library adapter shares: one run of a library's trainer on the chain (in-job).

`Chain` joins the job through `dslurm.runtime` (process group adopted when the library made it,
stop handlers, burn-in gate, ledger, `dslurm ctl`), owns the one `dslurm.runtime.Checkpoint` and
the incoming folder the library writes its own checkpoint into, agrees on stops at step
boundaries and ends the process the runtime's way (exit 75/143 after a stop's save, 0 when done).

The generation a library save becomes holds a small DCP part (which library, the step) and the
library's folder under `files/`; its manifest lists every file with its crc32, so a folder half
written when the process died is never resumed: it was still under `.incoming`, outside any
generation, and the pointer names the previous one.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dslurm.runtime as dr
from dslurm import checkpoint as ck
from dslurm.errors import UserError
from dslurm.integrations.rules import library_folder, world_change_error
from dslurm.run import RunDir

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Resume:
    """Where a start resumes: completed steps (0: fresh) and the library's restored folder."""

    step: int
    folder: Path | None


class Chain:
    """One run of `library`'s trainer on the chain. Collective methods say so."""

    def __init__(self, library: str, **position: int) -> None:
        self.library = library
        self.rt = dr.init()
        if self.rt.run_dir is None:
            raise UserError(f"dslurm.integrations ({library}) needs a run directory: submit the script with "
                            "`dslurm submit` (entry: [script.py, ...]), which sets DSLURM_RUN_DIR")
        spec = self.rt.job.checkpoint if self.rt.job is not None else None
        if spec is not None and spec.tiers != "durable":
            raise UserError(f"{RunDir(self.rt.run_dir).job_yaml}: checkpoint.tiers: {spec.tiers}: {library}'s own "
                            "checkpoint folder is committed straight into the run directory. Fix: set "
                            "checkpoint.tiers: durable for this job")
        self.incoming = ck.generations_dir(self.rt.run_dir) / ck.INCOMING
        # One small state for the job beside the library's folder (DCP loads only the keys it is
        # given, so every key is here from the start): the library, the step, the adapter's own
        # position numbers (Lightning: the batches of the epoch already trained).
        self.marker: dict[str, Any] = {"library": library, "step": 0, **position}
        self.ckpt = dr.Checkpoint(integration=dr.shared(self.marker))

    @property
    def rank(self) -> int:
        return int(self.rt.rank)

    @property
    def interval(self) -> int:
        """The job's checkpoint.interval (periodic saves when the script sets none of its own)."""
        return self.ckpt.interval

    def restore(self, why_world: str) -> Resume:
        """Collective: clear what a killed save left under `.incoming`, then load the pointer's
        generation (or a verified fallback). A resume by another number of processes is refused
        (`why_world`: what the library would get wrong)."""
        if self.rank == 0:
            shutil.rmtree(self.incoming, ignore_errors=True)
        self.barrier()
        step = self.ckpt.restore()
        res = self.ckpt.restored
        if res is None:
            return Resume(0, None)
        if res.saved_world_size != self.rt.world_size:
            raise world_change_error(self.library, res.saved_world_size, self.rt.world_size, res.path, why_world)
        return Resume(step, library_folder(res.path, self.library))

    def stop_requested(self, step: int) -> bool:
        """Collective, at the step boundary after `step` completed steps (dslurm.runtime)."""
        return bool(self.rt.stop_requested(step))

    def save_asked(self, step: int) -> bool:
        """Did the last `stop_requested(step)` agree on a `dslurm ctl save` for this step?"""
        return bool(self.rt.save_asked == step)

    def commit(self, step: int, name: str, *, final: bool) -> bool:
        """Collective, after the library wrote `.incoming/<name>` (every rank its part): rank 0
        moves the folder into a new generation, which commits like any other. `final`: a stop's
        or the last save (blocking; it must commit, else exit 74)."""
        self.barrier()  # every rank's files (HF: rng_state_<rank>.pth) are in before rank 0 moves them
        folder = self.incoming / name
        if not self.agreed(folder.is_dir() if self.rank == 0 else False):  # refused on every rank, or none
            raise UserError(f"{folder}: {self.library} wrote no checkpoint folder there (a subclass that saves "
                            "elsewhere?). Fix: leave the library's own checkpoint saving as it is")
        files = folder if self.rank == 0 else None
        self.marker["step"] = step
        ok = self.ckpt.save(step, final=final, files=files)
        if not ok and files is not None and folder.exists():  # a skipped save never moved it in: no stale folder
            shutil.rmtree(folder, ignore_errors=True)  # (an async save's thread moves it in later: left alone)
        return ok

    def log(self, step: int, values: dict[str, float]) -> None:
        """The window of steps up to `step` (completed steps) as one ledger `steps` event."""
        if step > 0:
            self.rt.log_metrics(step - 1, **values)

    def end(self, step: int, stopped: bool) -> None:
        """After the library's training returned: exit 75/143 after an agreed stop (does not
        return), else the run is complete (exit event, rank report; the process group is left to
        the script, which may save the final model with the library after `run`)."""
        if stopped:
            dr.exit_for_requeue(step)
        self.rt.finish(step, keep_group=True)

    def agreed(self, rank0_says: bool) -> bool:
        """Rank 0's answer on every rank (one broadcast)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return rank0_says
        box = [rank0_says]
        dist.broadcast_object_list(box, src=0)
        return bool(box[0])

    def barrier(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.barrier()
