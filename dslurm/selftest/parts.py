"""The self-check's parts that need no trainer: NVML health and GEMM through the burn-in's own
checks (dslurm/preflight), and DCP save/restore throughput of a given training state through
the checkpoint manager (dslurm/checkpoint). In-job: torch is imported inside the functions.
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dslurm.preflight.thresholds import Thresholds


def chip_name(device: Any) -> str:
    """The name every number is reported with: CUDA's device name, or the CPU's model."""
    import torch

    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return "cpu: " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu: " + (platform.processor() or platform.machine())


def env_info(device: Any) -> dict[str, Any]:
    import torch

    return {"host": socket.gethostname(), "torch": torch.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(),
            "device_memory_bytes": (torch.cuda.get_device_properties(device).total_memory
                                    if device.type == "cuda" else None)}


def nvml_part(th: Thresholds) -> dict[str, Any]:
    """Every NVML check of the burn-in on this node (dslurm/preflight/nvml.py)."""
    from dslurm.preflight.nvml import check_node

    health = check_node(socket.gethostname(), th).to_dict()
    if health["nvml"] == "error" or health["severity"] == "fail":
        problems = [f["reason"] for f in health["findings"] if f["severity"] == "fail"]
        problems += [f"gpu{g['index']} {f['reason']}" for g in health["gpus"] for f in g["findings"]
                     if f["severity"] == "fail"]
        raise RuntimeError("NVML health failed: " + "; ".join(problems))
    return {"health": health, "gpu_names": [g["name"] for g in health["gpus"]]}


def gemm_part(device: Any, th: Thresholds, *, size: int | None = None, iters: int | None = None) -> dict[str, Any]:
    """The burn-in's GEMM (bf16 on GPU, fp32 on CPU) against the site's peak."""
    from dslurm.preflight.gemm import fraction_of_peak, measure_gemm

    r = measure_gemm(device, size=size, iters=iters)
    return {"dtype": r.dtype, "m": r.m, "n": r.n, "k": r.k, "seconds": r.seconds, "tflops": r.tflops,
            "peak_tflops": th.gpu_peak_tflops, "fraction_of_peak": fraction_of_peak(r.tflops, th.gpu_peak_tflops)}


def _settle() -> None:
    """Flush the previous measurement's dirty pages, so its writeback is not billed to the next."""
    os.sync()
    time.sleep(0.3)


def _gbps(nbytes: float, seconds: float) -> float | None:
    return nbytes / seconds / 1e9 if seconds > 0 else None


def checkpoint_part(state: dict[str, Any], probe: Callable[[], Any], work: Path) -> dict[str, Any]:
    """Sync DCP save of `state` (the manager's whole protocol) vs an fsync'd raw write of as many
    bytes to the same directory; a restore, checked with `probe()` (one live tensor of the state:
    changed in place before the restore, which must bring the saved values back); the async
    save's stall, steady state (second save).
    Each generation is deleted before the next write, so the disk holds one state at a time."""
    import torch

    from dslurm.checkpoint.dcp import CheckpointManager
    from dslurm.checkpoint.io import raw_write

    work.mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {"dir": str(work), "free_disk_bytes": shutil.disk_usage(work).free}
    _settle()
    with CheckpointManager(work / "sync") as mgr:
        if not mgr.save(1, state):
            raise RuntimeError(f"sync save failed: {mgr.last_outcome.reason if mgr.last_outcome else '?'}")
        sync = mgr.last_outcome
    assert sync is not None  # set by every save
    nbytes = sync.bytes
    _settle()
    raw_s = raw_write(work / "raw.bin", nbytes)
    before = probe().detach().clone()
    with torch.no_grad():
        probe().add_(1.0)
    if torch.equal(probe().detach(), before):
        raise RuntimeError("the probe tensor is a copy, not the live parameter: the restore check would prove nothing")
    _settle()
    with CheckpointManager(work / "sync") as mgr:
        res = mgr.restore(state)
    if res is None:
        raise RuntimeError(f"restore found nothing in {work / 'sync'}")
    matches = bool(torch.equal(probe().detach(), before))
    shutil.rmtree(work / "sync")
    _settle()
    with CheckpointManager(work / "async", async_mode=True) as mgr:
        stalls, totals = [], []
        for step in (1, 2):  # the first save allocates the host buffers; the second is training's steady state
            mgr.save(step, state)
            mgr.wait()
            last = mgr.last_outcome
            if last is None or not last.ok:
                raise RuntimeError(f"async save {step} failed: {last.reason if last else '?'}")
            stalls.append(last.stall_s)
            totals.append(last.total_s)
    shutil.rmtree(work / "async")
    restore_s = res.phases["total"]
    out.update(bytes=nbytes, raw_write_s=raw_s, raw_gbytes_per_s=_gbps(nbytes, raw_s),
               sync_save_s=sync.total_s, sync_dcp_write_s=sync.phases.get("dcp"),
               sync_gbytes_per_s=_gbps(nbytes, sync.total_s), sync_vs_raw=raw_s / sync.total_s,
               restore_s=restore_s, restore_gbytes_per_s=_gbps(nbytes, restore_s), restore_matches=matches,
               async_first_stall_s=stalls[0], async_stall_s=stalls[1], async_total_s=totals[1],
               async_stall_vs_sync=stalls[1] / sync.total_s)
    if not matches:
        raise RuntimeError(f"restore did not bring the saved values back: {out}")
    return out
