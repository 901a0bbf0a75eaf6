"""Profiles on demand: a `torch.profiler` trace of a few steps on every rank.

Asked for by `dslurm ctl RUN_DIR profile [--steps N]` (rank 0 takes the request at a step
boundary; the count rides in the step's agreement, so every rank starts at the same step) or by
the job (`health.profile_at: K`, `health.profile_steps: N`: steps K..K+N-1 of each start that
reaches K). Every rank writes `<run_dir>/profiles/<start>/steps-K-L/rank-NNNNN.trace.json.gz`
(Chrome / Perfetto JSON, gzip: open it at https://ui.perfetto.dev or chrome://tracing), each
step inside a `dslurm step N` range; on a GPU also the CUDA caching allocator's history and
snapshot `rank-NNNNN.memory.pickle` (https://pytorch.org/memory_viz). Rank 0 writes the ledger's
`profile` event; `dslurm report` lists the files and how to view them.

Off (the common case) it costs one integer comparison per step.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dslurm.observe import events
from dslurm.observe.ledger import Ledger

if TYPE_CHECKING:
    from dslurm.config.resolve import Resolved
    from dslurm.run import RunDir

log = logging.getLogger(__name__)
VIEW = "open the .trace.json.gz at https://ui.perfetto.dev (or chrome://tracing)"
MEMORY_VIEW = "drag the .memory.pickle onto https://pytorch.org/memory_viz"
MEMORY_ENTRIES = 100_000  # allocator events kept while profiling (GPU)


def trace_name(rank: int) -> str:
    return f"rank-{rank:05d}.trace.json.gz"


class StepProfiler:
    """The loop calls `before_step(n)` and `after_step(n, requested)` around each 1-based step n."""

    def __init__(self, *, run: RunDir, start: str, rank: int, world: int, device: torch.device,
                 at: int = 0, steps: int = 3, ledger: Ledger | None = None) -> None:
        self.run, self.start, self.rank, self.world, self.device = run, start, rank, world, device
        self.default_steps, self.ledger = steps, ledger
        self.pending: list[tuple[int, int, str]] = [(at, at + steps - 1, "job (health.profile_at)")] if at > 0 else []
        """windows to profile (first, last, why), in step order; the job's, then requests"""
        self.first, self.last, self.why = 0, -1, ""  # the window being profiled
        self._prof: Any = None
        self._range: Any = None
        self._t0 = 0.0

    @property
    def active(self) -> bool:
        return self._prof is not None

    def request(self, steps: int, after: int, why: str) -> None:
        """Profile the `steps` steps after step `after`, unless that overlaps a window being
        profiled or scheduled (then it is said and dropped: one profiler per process)."""
        n = steps if steps > 0 else self.default_steps
        new = (after + 1, after + n, why)
        taken = ([(self.first, self.last, self.why)] if self.active else []) + self.pending
        clash = [w for w in taken if w[0] <= new[1] and new[0] <= w[1]]
        if clash:
            log.warning("[rank %d] profile of steps %d..%d (%s) dropped: steps %d..%d are profiled already (%s)",
                        self.rank, new[0], new[1], why, clash[0][0], clash[0][1], clash[0][2])
            return
        self.pending = sorted([*self.pending, new])

    def before_step(self, step: int) -> bool:
        """Open step `step` (1-based); True when a profile began now."""
        began = False
        if self.pending and self.pending[0][0] < step:
            self.pending = [w for w in self.pending if w[0] >= step]  # resumed past a window: not profiled
        if not self.active and self.pending and self.pending[0][0] == step:
            self.first, self.last, self.why = self.pending.pop(0)
            self._begin()
            began = True
        if self.active:
            self._range = torch.profiler.record_function(f"dslurm step {step}")
            self._range.__enter__()
        return began

    def after_step(self, step: int, requested: int = 0, why: str = "dslurm ctl profile") -> bool:
        """Close step `step`; `requested` > 0: profile that many steps from the next one (every
        rank gets the same number). True when a trace was written now (the caller restarts its
        step clock: the export is no step time)."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self.active:
            self._prof.step()
            if step >= self.last:
                self._end()
                return True
        if requested:
            self.request(requested, step, why)
        return False

    def _dir(self) -> Path:
        return self.run.profiles / self.start / f"steps-{self.first}-{self.last}"

    def _begin(self) -> None:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":  # GPU path: written, not run on this machine
            acts.append(torch.profiler.ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_ENTRIES)
        self._prof = torch.profiler.profile(activities=acts, record_shapes=True)
        self._prof.start()
        self._t0 = time.time()
        log.warning("[rank %d] profiling steps %d..%d (%s)", self.rank, self.first, self.last, self.why)

    def _end(self) -> None:
        prof, self._prof = self._prof, None
        d = self._dir()
        files = []
        try:
            prof.stop()
            d.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(d / trace_name(self.rank)))
            files.append(trace_name(self.rank))
            if self.device.type == "cuda":
                mem = d / f"rank-{self.rank:05d}.memory.pickle"
                torch.cuda.memory._dump_snapshot(str(mem))
                torch.cuda.memory._record_memory_history(enabled=None)
                files.append(mem.name)
        except Exception as exc:  # noqa: BLE001  (a profile must never end the training)
            log.error("[rank %d] profile of steps %d..%d not written: %s", self.rank, self.first, self.last, exc)
        if self.ledger is not None:
            names = [trace_name(r) for r in range(self.world)]
            if self.device.type == "cuda":
                names += [f"rank-{r:05d}.memory.pickle" for r in range(self.world)]
            self.ledger.append(events.Profile(first_step=self.first, last_step=self.last, dir=str(d), files=names,
                                              why=self.why, duration_s=round(time.time() - self._t0, 3),
                                              view=VIEW + ("; " + MEMORY_VIEW if self.device.type == "cuda" else "")))
        self.first, self.last, self.why = 0, -1, ""

    def close(self) -> None:
        """The run ends while profiling: write what was recorded."""
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if self.active:
            self.last = max(self.first, self.last)
            self._end()


def make_profiler(resolved: Resolved, run: RunDir, *, rank: int, world: int, device: torch.device,
                  ledger: Ledger | None) -> StepProfiler:
    """The loop's profiler, with the job's schedule (health.profile_at / profile_steps)."""
    from dslurm.endings.facts import start_dir

    d = start_dir(run_dir=run.path)
    spec = resolved.job.health
    return StepProfiler(run=run, start=d.name if d is not None else "local", rank=rank, world=world,
                        device=device, at=spec.profile_at, steps=spec.profile_steps, ledger=ledger)
