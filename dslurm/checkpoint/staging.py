"""The host copy of a save (in-job; imports torch), made while the next step computes.

An async or two-tier save must copy the state to host memory before training changes it. Done on
the training thread, that copy is the whole stall of the save: one host copy of the state,
bounded by copy speed over storage speed (docs/checkpoint.md, bench/bench_two_tier.py). Here it
runs on a thread of its own (on a GPU: on a stream of its own into pinned buffers) while the next
step's forward and backward run. The one hard dependency is that nothing writes a tensor before
it was copied, and the first thing that writes parameters and optimizer state is the next
optimizer step: a step pre-hook on every torch optimizer (`fence`) makes it wait until the copy
is done. Tensors that a forward may write (model buffers: BatchNorm's running statistics) are
cloned on the training thread before `stage` returns; they are small. A loop that changes the
state other than through a torch optimizer calls `CheckpointManager.fence()` first.
"""

from __future__ import annotations

import copy
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from dslurm import faults


def forward_written(state: dict[str, Any]) -> set[int]:
    """Storage addresses of the model buffers reachable from a save's `state` values (an
    nn.Module, or a Stateful holding one as `.model` or a list of them as `.parts`)."""
    mods: list[nn.Module] = []
    for v in state.values():
        for m in [v, getattr(v, "model", None), *(getattr(v, "parts", None) or [])]:
            if isinstance(m, nn.Module):
                mods.append(m)
    return {_ptr(b) for m in mods for b in m.buffers()}


def _ptr(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t  # DTensor: its shard's storage
    return int(local.untyped_storage().data_ptr())


def snapshot(sd: Any, clone: set[int]) -> Any:
    """The state dict's structure as of now: containers copied, tensors by reference (those whose
    storage is in `clone` cloned), other leaves deep-copied. Nothing the training thread does
    to its own dicts afterwards reaches the copy."""
    if isinstance(sd, dict):
        return {k: snapshot(v, clone) for k, v in sd.items()}
    if isinstance(sd, (list, tuple)):
        return type(sd)(snapshot(v, clone) for v in sd)
    if isinstance(sd, torch.Tensor):
        return sd.detach().clone() if clone and _ptr(sd) in clone else sd
    return copy.deepcopy(sd)


class HostStager:
    """Copies state dicts into host buffers reused across saves (at most one copy at a time).

    overlap=False: `stage` copies on the caller's thread (training waits for all of it).
    overlap=True: `stage` returns at once; the copy runs on the stager's thread and the next
    optimizer step of any torch optimizer waits for it (`fence`; `blocked_s` adds up that wait).
    """

    def __init__(self, overlap: bool) -> None:
        from torch.distributed.checkpoint._state_dict_stager import StateDictStager
        cuda = torch.cuda.is_available()
        self.overlap = overlap
        self._stager = StateDictStager(pin_memory=cuda)  # caches one host storage per live storage
        # Made on the training thread so it is never the compute stream (torch's DefaultStager note).
        self._stream = torch.cuda.Stream() if cuda and overlap else None  # type: ignore[no-untyped-call]
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="dslurm-stage") if overlap else None
        self._pending: Future[Any] | None = None
        self._lock = threading.Lock()
        self.blocked_s = 0.0
        self._hook = register_optimizer_step_pre_hook(lambda *_: self.fence()) if overlap else None

    def stage(self, sd: Any, clone: set[int] | None = None) -> Future[Any]:
        """Start (overlap) or make the host copy of `sd`; the future gives the staged dict."""
        self.fence()  # the buffers are reused: never two copies into them at once
        snap = snapshot(sd, clone or set())
        if self._pool is None:
            done: Future[Any] = Future()
            done.set_result(self._copy(snap, None))
            return done
        ready = None
        if self._stream is not None:  # the copy must see every kernel queued so far (the last step)
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record()
        fut = self._pool.submit(self._copy, snap, ready)
        with self._lock:
            self._pending = fut
        return fut

    def _copy(self, snap: Any, ready: Any) -> Any:
        if self._pool is not None:
            faults.stage_delay()
        if self._stream is None:
            return self._stager.stage(snap, non_blocking=False)
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            out = self._stager.stage(snap, non_blocking=True)
        self._stream.synchronize()  # pinned D2H copies done: the host dict is complete
        return out

    def fence(self) -> None:
        """Wait until the copy in progress (if any) has ended."""
        with self._lock:
            fut, self._pending = self._pending, None
        if fut is None:
            return
        t = time.perf_counter()
        wait([fut])  # a failed copy fails its save (the save's thread reads it), not the step
        self.blocked_s += time.perf_counter() - t

    @property
    def busy(self) -> bool:
        """A host copy is still being made."""
        fut = self._pending
        return fut is not None and not fut.done()

    def take_blocked(self) -> float:
        """Seconds training waited at the fence since the last call."""
        out, self.blocked_s = self.blocked_s, 0.0
        return out

    def close(self) -> None:
        try:
            self.fence()
        finally:
            if self._hook is not None:
                self._hook.remove()
            if self._pool is not None:
                self._pool.shutdown(wait=True)
            self._stager.close()  # type: ignore[no-untyped-call]
