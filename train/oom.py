"""Memory at an out-of-memory error: what was allocated, where in the step, and the ending `oom`.

The loop catches `torch.OutOfMemoryError` around a step (train/loop.py) and calls `record`
before the error goes on up: on a GPU the caching allocator's snapshot (segments and blocks,
with the allocation history when it is being recorded, e.g. during a profile) goes to
`<start dir>/oom-rank-NNNNN.pickle` (`torch.cuda.memory._dump_snapshot`: drag it onto
https://pytorch.org/memory_viz), the allocator's numbers and the step/phase to
`oom-rank-NNNNN.json`, and the ledger gets an `oom` event from this rank. The rank then reports
the kind `oom` (dslurm/endings/worker_exit.py reads the exception's type), the start ends as `oom`
(dslurm/endings/__init__.py) and requeue-me stops with the planner's fix instead of retrying
the same layout and batch (dslurm/requeue/oom.py).

On a CPU (this machine) the same path runs with DSLURM_FAULT_OOM raising the error; there is no
allocator snapshot then and the event says so.
"""

from __future__ import annotations

import json
import logging
import socket
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dslurm.durable import atomic_write_text
from dslurm.observe import events
from dslurm.observe.ledger import Ledger

if TYPE_CHECKING:
    from dslurm.run import RunDir
    from train.metrics import StepMetrics
    from train.watchdog import Watch

log = logging.getLogger(__name__)
GIB = 1024 ** 3


def _gpu_state(device: torch.device, start_dir: Path | None, rank: int) -> tuple[dict[str, float], str | None]:
    """The allocator's numbers and its snapshot file (GPU only; written, not run here)."""
    if device.type != "cuda":
        return {}, None
    stats = torch.cuda.memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    nums = {"allocated_gib": stats.get("allocated_bytes.all.current", 0) / GIB,
            "peak_allocated_gib": stats.get("allocated_bytes.all.peak", 0) / GIB,
            "reserved_gib": stats.get("reserved_bytes.all.current", 0) / GIB,
            "free_gib": free / GIB, "total_gib": total / GIB, "num_ooms": float(stats.get("num_ooms", 0))}
    path = None
    if start_dir is not None:
        try:
            p = start_dir / f"oom-rank-{rank:05d}.pickle"
            torch.cuda.memory._dump_snapshot(str(p))
            path = str(p)
        except Exception as exc:  # noqa: BLE001  (the OOM itself must still be reported)
            log.error("[rank %d] allocator snapshot not written: %s", rank, exc)
    return {k: round(v, 3) for k, v in nums.items()}, path


def record(exc: BaseException, *, rank: int, step: int, phase: str, collective: str, device: torch.device,
           start_dir: Path | None, run: RunDir) -> events.Oom:
    """Leave the snapshot, the note and the ledger event of this rank's OOM; returns the event."""
    memory, snap = _gpu_state(device, start_dir, rank)
    ev = events.Oom(rank=rank, step=step, phase=phase, collective=collective, error=str(exc).splitlines()[0][:300],
                    device=str(device), memory=memory, snapshot=snap,
                    note=None if snap else f"no allocator snapshot on {device.type} (only a CUDA device has one)")
    log.error("[rank %d] OUT OF MEMORY at step %d in %s (%s): %s", rank, step, phase, collective or "-", ev.error)
    if start_dir is not None:
        try:
            start_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(start_dir / f"oom-rank-{rank:05d}.json",
                              json.dumps({**ev.fields(), "host": socket.gethostname()}) + "\n")
        except OSError as err:
            log.error("[rank %d] OOM note not written: %s", rank, err)
    return Ledger(run.path).append(ev)  # type: ignore[return-value]


def phase_of(metrics: StepMetrics, watch: Watch) -> tuple[str, str]:
    """Where in the step this rank was: the metrics phase (left set by the error) and the last
    trainer collective it entered (its `with` has already been left by the error)."""
    return (getattr(metrics, "current", "") or "other"), str(getattr(watch, "coll_name", "") or "")
