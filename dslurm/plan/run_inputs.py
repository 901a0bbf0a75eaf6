"""The failure simulator's cost inputs, measured from a real run's ledger (`plan simulate --from-run`).

Reads only typed ledger events (`dslurm.observe.events`) and the report's reading of them
(`dslurm.observe.report.summarize`: starts, queue waits, recoveries; `observe.phases`: the
start-up phase tables), so a number here is the number `dslurm report` prints for the run.
Each input is the median over the run's occurrences (a run has few; the median keeps one
slow first save or start from setting the value) and says where it came from.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dslurm.observe import events as ev

REQUEUED = ("requeued by dslurm", "requeued by Slurm")  # report.outcome's words for a queue round trip


@dataclass(frozen=True, slots=True)
class Measured:
    """One simulator input taken from a run: its value and how it was measured."""

    value: float
    count: int
    how: str

    def source(self, run_dir: str) -> str:
        return f"{run_dir}: median of {self.count} {self.how}"


def _median(values: Iterable[float | None], how: str) -> Measured | None:
    vals = [float(v) for v in values if v is not None]
    return Measured(round(statistics.median(vals), 4), len(vals), how) if vals else None


def measure(events: list[ev.Event]) -> dict[str, Measured]:
    """SimConfig field -> its measured value, for the inputs the run's events give (pure)."""
    from dslurm.observe import phases, report

    summary = report.summarize(events)
    starts = summary.starts
    warm = [t.startup_s() for t in phases.tables(events) if not t.cold]
    restart = _median(warm, "warm starts' start-up (start_phases: spawn -> first step done)")
    if restart is None:  # older ledgers: no start_phases; the report's begin -> train_start
        restart = _median([s.overhead_s for s in starts if s.resumed_from],
                          "resumed starts' overhead (report: start -> train_start)")
    queue = [s.queue_wait_s for prev, s in zip(starts, starts[1:]) if prev.outcome in REQUEUED]
    rec = summary.recoveries
    saves = list(ev.of(events, ev.CkptSave))
    durable = [e for e in saves if e.tier == "durable"]
    two = [e for e in saves if e.tier == "two_tier"]
    found = {
        "restart_s": restart,
        "requeue_s": _median(queue, "queue waits after a requeue (report: previous start's end -> start)"),
        "relaunch_s": _median([r.resumed_s for r in rec if r.mode == "same_nodes"],
                              "same-node recoveries (report: failure -> first step)"),
        "swap_s": (_median([r.resumed_s for r in rec if r.mode == "spare"],
                           "spare swaps (report: failure -> first step)")
                   or _median([r.resumed_s for r in rec if r.mode == "shrink"],
                              "shrinks (report: failure -> first step)")),
        "save_s": _median([e.total_s for e in durable], "durable saves' total_s (ckpt_save)"),
        # A sync save stalls for all of it; a save that stalled less was an async one.
        "async_stall_s": _median([e.stall_s for e in durable if e.stall_s < e.total_s],
                                 "async saves' stall_s (ckpt_save)"),
        "local_stall_s": _median([e.stall_s for e in two], "two-tier saves' stall_s (ckpt_save)"),
        "durable_lag_s": _median([e.lag_s for e in two], "two-tier saves' lag_s (ckpt_save: durable - local commit)"),
    }
    return {k: v for k, v in found.items() if v is not None}


def from_runs(run_dirs: list[str]) -> dict[str, tuple[float, str]]:
    """Field -> (value, source) from the runs; an input comes from the first run that has it.
    A run dir without a readable ledger is a UserError naming it (report.load's)."""
    from dslurm.observe.report import load

    out: dict[str, tuple[float, str]] = {}
    for run_dir in run_dirs:
        events, _ = load(Path(run_dir))
        for name, m in measure(events).items():
            out.setdefault(name, (m.value, m.source(run_dir)))
    return out
