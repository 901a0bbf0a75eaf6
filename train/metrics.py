"""Training metrics: throughput, MFU, the step-time breakdown, stragglers, the log line.

Pure functions first (tested hard), then a small collector the loop feeds once per
step, then the one thin torch.distributed call (`gather_step_times`).

MFU (seed 000 eq. 2.5) = tokens/s x model FLOPs per token / aggregate dense peak. The
peak comes from the site (`node.peak_tflops_bf16` per GPU). CPU sites have no
meaningful peak: MFU is then None and labelled "cpu: no peak", unless the caller
measured one (`measure_cpu_peak_gflops`) and passed it in.
"""

from __future__ import annotations

import socket
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from dslurm.observe import events, slowrank
from dslurm.runtime import flight

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from dslurm.config import SiteConfig

PHASES = ("data", "compute", "optimizer", "checkpoint")
"""Named parts of a step; the rest of the wall time is reported as "other"."""


def tokens_per_s(tokens: float, seconds: float) -> float:
    """Throughput; 0 when no time has passed (nothing measured yet)."""
    return tokens / seconds if seconds > 0 else 0.0


def mfu(tokens_per_second: float, flops_per_token: float, peak_flops_per_device: float,
        n_devices: int) -> float | None:
    """Model FLOPs utilisation as a fraction, or None when the peak is unknown (<= 0).

    20,000 tokens/s x 120 GFLOP/token on 8 devices of 1 PFLOP/s -> 0.30.
    """
    total_peak = peak_flops_per_device * n_devices
    if total_peak <= 0:
        return None
    return tokens_per_second * flops_per_token / total_peak


@dataclass(frozen=True, slots=True)
class Peak:
    """Dense peak FLOP/s per device and a label saying where the number came from."""

    flops_per_device: float
    label: str


def peak_for(site: SiteConfig, *, procs_per_node: int, cpu_peak_gflops: float | None = None) -> Peak:
    """The peak used for MFU on a `dslurm.config.SiteConfig`.

    GPU site: node.peak_tflops_bf16 per device (bf16 is the precision the site states;
    an fp32 run measured against it reads low). CPU site: a measured node-wide GFLOP/s
    split over the node's processes, because they share the same cores.
    """
    if site.node.gpus > 0:
        if site.node.peak_tflops_bf16 > 0:
            return Peak(site.node.peak_tflops_bf16 * 1e12, "bf16 peak")
        return Peak(0.0, "gpu: no peak (set node.peak_tflops_bf16)")
    if cpu_peak_gflops and cpu_peak_gflops > 0:
        return Peak(cpu_peak_gflops * 1e9 / procs_per_node, "cpu: measured peak")
    return Peak(0.0, "cpu: no peak")


def measure_cpu_peak_gflops(n: int = 512, repeats: int = 5) -> float:
    """Best-of-`repeats` fp32 matmul GFLOP/s in this process with torch's threads.

    Run it once before training starts (not while other ranks compute), so it sees
    the whole node's cores.
    """
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up: first call pays allocation and thread-pool start
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n ** 3 / best / 1e9


# ----------------------------------------------------------------------- stragglers


@dataclass(frozen=True, slots=True)
class Straggler:
    rank: int
    host: str
    step_time_s: float
    ratio: float
    """step time over the median of all ranks"""


def flag_stragglers(times: list[float], hosts: list[str] | None = None, *,
                    factor: float = 1.5) -> list[Straggler]:
    """Ranks whose step time exceeds factor x the median, slowest first.

    One slow rank delays every synchronised rank, so comparing against the median (not
    the mean, which the straggler itself pulls up) names it.
    """
    if factor <= 1.0:
        raise ValueError(f"factor={factor} must be > 1")
    if hosts is not None and len(hosts) != len(times):
        raise ValueError(f"{len(hosts)} hosts for {len(times)} ranks")
    if not times:
        return []
    median = statistics.median(times)
    if median <= 0:
        return []
    slow = [Straggler(rank=r, host=hosts[r] if hosts else "?", step_time_s=t, ratio=t / median)
            for r, t in enumerate(times) if t > factor * median]
    return sorted(slow, key=lambda s: -s.ratio)


def straggler_event(step: int, times: list[float], hosts: list[str], *, factor: float = 1.5,
                    steps: list[slowrank.RankStep] | None = None) -> events.Stragglers:
    """The ledger's `stragglers` event; with every rank's last step (`gather_rank_steps`), each
    rank's split into data, compute, optimizer and collective wait, and the slow parts."""
    slow = flag_stragglers(times, hosts, factor=factor)
    parts, scores, causes = slowrank.causes(steps) if steps else ({}, {}, [])
    return events.Stragglers(step=step, step_times_s=[round(t, 6) for t in times], hosts=hosts, factor=factor,
                             slow=[{"rank": s.rank, "host": s.host, "step_time_s": round(s.step_time_s, 6),
                                    "ratio": round(s.ratio, 3)} for s in slow],
                             parts={str(r): {k: round(v, 6) for k, v in p.items()} for r, p in parts.items()},
                             scores={str(r): v for r, v in scores.items()}, causes=causes)


def gather_rank_steps(m: StepMetrics, rank: int) -> tuple[list[float], list[str], list[slowrank.RankStep]]:
    """Every rank's last step: its time, host, phases and the collectives it entered during it
    (the Flight Recorder's arrivals, dslurm/runtime/flight.py), indexed by rank; one all-gather."""
    import torch.distributed as dist

    a, b = m.last_window_ns
    mine = slowrank.RankStep(rank=rank, host=socket.gethostname(), step_s=float(m.last_step_time_s),
                             spans=list(m.last_spans), arrivals=flight.arrivals(a, b))
    got: list[object] = [mine]
    if dist.is_available() and dist.is_initialized():
        got = [None] * dist.get_world_size()
        dist.all_gather_object(got, mine)
    steps = [s for s in got if isinstance(s, slowrank.RankStep)]
    return [s.step_s for s in steps], [s.host for s in steps], steps


def gather_step_times(local_time: float, group: ProcessGroup | None = None) -> tuple[list[float], list[str]]:
    """All ranks' (step time, host), indexed by rank; works without a process group."""
    import torch.distributed as dist

    mine = (float(local_time), socket.gethostname())
    if not (dist.is_available() and dist.is_initialized()):
        pairs = [mine]
    else:
        got: list[object] = [None] * dist.get_world_size(group)
        dist.all_gather_object(got, mine, group=group)
        pairs = cast(list[tuple[float, str]], got)  # each filled with a rank's `mine`
    return [p[0] for p in pairs], [p[1] for p in pairs]


# ------------------------------------------------------------------------ collector


@dataclass(slots=True)
class Window:
    """Summary of the steps since the last summary (what one log line reports)."""

    first: int
    last: int
    loss: float
    tokens_per_s: float
    mfu: float | None
    mfu_label: str
    step_time_s: float
    breakdown: dict[str, float]
    """mean seconds per step in each phase, plus "other" (the unattributed rest)"""
    duration_s: float

    def event(self, grad_norm: float | None = None, lr: float | None = None) -> events.Steps:
        """The ledger's `steps` event for this window."""
        return events.Steps(first=self.first, last=self.last, loss=self.loss,
                            tokens_per_s=round(self.tokens_per_s, 3),
                            mfu=None if self.mfu is None else round(self.mfu, 6),
                            mfu_label=self.mfu_label, step_time_s=round(self.step_time_s, 6),
                            breakdown={k: round(v, 6) for k, v in self.breakdown.items()},
                            duration_s=round(self.duration_s, 6), grad_norm=grad_norm, lr=lr)


@dataclass(slots=True)
class StepMetrics:
    """Per-step timing for one rank: `with m.phase("data"): ...`, then `m.end_step(...)`.

    A step's wall time runs from the previous `end_step` (or `start`) to this one.
    `sync` (e.g. torch.cuda.synchronize) is called at each phase boundary: without it,
    asynchronous GPU kernels would be billed to whichever phase next waits on them.
    """

    tokens_per_step: int
    flops_per_token: float
    peak: Peak
    n_devices: int
    clock: Callable[[], float] = time.perf_counter
    sync: Callable[[], None] | None = None
    _t0: float | None = None
    _phases: dict[str, float] = field(default_factory=dict)
    _steps: list[tuple[int, float, float]] = field(default_factory=list)  # (step, time, loss)
    _spans: list[tuple[str, int, int]] = field(default_factory=list)  # this step's phases, wall ns
    last_spans: list[tuple[str, int, int]] = field(default_factory=list)
    """the last step's phases (name, start, end; wall clock ns): the straggler split's input"""
    last_window_ns: tuple[int, int] = (0, 0)
    """the last step's start and end (wall clock ns)"""
    _t0_ns: int = 0
    last_step_time_s: float = 0.0
    current: str = ""
    """the phase being run now (left set when an error leaves it: where an OOM happened)"""

    def start(self) -> None:
        """Mark the start of the first step of a window (after setup, compile, restore)."""
        self._t0 = self._now()
        self._t0_ns, self._spans = time.time_ns(), []

    def _now(self) -> float:
        if self.sync is not None:
            self.sync()
        return self.clock()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name not in PHASES:
            raise ValueError(f"phase {name!r} is not one of {', '.join(PHASES)}")
        t, outer = self._now(), self.current
        t_ns = time.time_ns()
        self.current = name
        try:
            yield
        finally:
            self._phases[name] = self._phases.get(name, 0.0) + self._now() - t
            self._spans.append((name, t_ns, time.time_ns()))
        self.current = outer  # not on an error: `current` then says where it happened

    def end_step(self, step: int, loss: float) -> float:
        """Close the step; returns its wall time (the value to gather for stragglers)."""
        now = self._now()
        t0 = self._t0 if self._t0 is not None else now
        self.last_step_time_s = now - t0
        self._steps.append((step, self.last_step_time_s, float(loss)))
        self._t0 = now
        now_ns = time.time_ns()
        self.last_spans, self._spans = self._spans, []
        self.last_window_ns, self._t0_ns = (self._t0_ns or now_ns, now_ns), now_ns
        return self.last_step_time_s

    def summary(self) -> Window | None:
        """Summarise and reset the window; None when no step was recorded."""
        if not self._steps:
            return None
        n, total = len(self._steps), sum(t for _, t, _ in self._steps)
        breakdown = {p: self._phases.get(p, 0.0) / n for p in PHASES}
        breakdown["other"] = max(0.0, total / n - sum(breakdown.values()))
        tps = tokens_per_s(self.tokens_per_step * n, total)
        win = Window(first=self._steps[0][0], last=self._steps[-1][0], loss=self._steps[-1][2],
                     tokens_per_s=tps,
                     mfu=mfu(tps, self.flops_per_token, self.peak.flops_per_device, self.n_devices),
                     mfu_label=self.peak.label, step_time_s=total / n, breakdown=breakdown,
                     duration_s=total)
        self._steps.clear()
        self._phases.clear()
        return win


def _si(x: float) -> str:
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.1f}{suffix}"
    return f"{x:.0f}"


def format_log_line(win: Window, *, total_steps: int, lr: float) -> str:
    """The short human line, e.g.
    ``step 40/100 loss 3.2140 lr 2.91e-03 | 12.3k tok/s mfu 31.2% | 84ms/step
    (data 2 compute 70 opt 10 ckpt 0 other 2 ms)``; steps are shown 1-based."""
    mfu_txt = f"mfu {win.mfu * 100:.1f}%" if win.mfu is not None else f"mfu n/a ({win.mfu_label})"
    b = {k: v * 1e3 for k, v in win.breakdown.items()}
    return (f"step {win.last + 1}/{total_steps} loss {win.loss:.4f} lr {lr:.2e} | "
            f"{_si(win.tokens_per_s)} tok/s {mfu_txt} | {win.step_time_s * 1e3:.0f}ms/step "
            f"(data {b['data']:.0f} compute {b['compute']:.0f} opt {b['optimizer']:.0f} "
            f"ckpt {b['checkpoint']:.0f} other {b['other']:.0f} ms)")
