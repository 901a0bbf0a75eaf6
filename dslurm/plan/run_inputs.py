"""The failure simulator's cost inputs, measured from a real run's ledger (`plan simulate --from-run`).

Reads only typed ledger events (`dslurm.observe.events`) and the report's reading of them
(`dslurm.observe.report.summarize`: starts, queue waits, recoveries; `observe.phases`: the
start-up phase tables), so a number here is the number `dslurm report` prints for the run.
Each input is the median over the run's occurrences (a run has few; the median keeps one
slow first save or start from setting the value) and says where it came from.

Warm and cold starts are kept apart (`recovery.warm`, docs/recovery.md: a warm start's workers
are forked by a node's preloaded pool, its job_start says mode "warm"). A requeue always starts
cold, so `restart_s` (the requeue's restore + restart) is measured on cold restarts only. The
in-allocation costs `relaunch_s` / `swap_s` are measured on the recoveries whose next start was
warm when the run has any (a run with warm restarts recovers warm), else on the cold ones; a warm
measurement of them wins over a cold one from an earlier run (`from_runs`).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from dslurm.observe import events as ev
from dslurm.observe.replica_spans import group_lanes

if TYPE_CHECKING:
    from dslurm.observe.report import Recovered

REQUEUED = ("requeued by dslurm", "requeued by Slurm")  # report.outcome's words for a queue round trip


@dataclass(frozen=True, slots=True)
class Measured:
    """One simulator input taken from a run: its value and how it was measured."""

    value: float
    count: int
    how: str
    warm: bool = False
    """measured on warm starts (workers forked by a preloaded pool)"""

    def source(self, run_dir: str) -> str:
        return f"{run_dir}: median of {self.count} {self.how}"


def _median(values: Iterable[float | None], how: str) -> Measured | None:
    vals = [float(v) for v in values if v is not None]
    return Measured(round(statistics.median(vals), 4), len(vals), how) if vals else None


def _in_allocation(rec: list[Recovered], modes: tuple[str, ...], what: str,
                   warm_startup_s: float | None) -> Measured | None:
    """Failure -> first step of the recoveries of `modes`: the warm ones when there are any."""
    warm = _median([r.resumed_s for r in rec if r.mode in modes and r.startup == "warm"],
                   f"warm {what} (report: failure -> first step of a start forked by a warm pool"
                   + (f"; of it, the warm starts' own start-up, job start -> first step, median {warm_startup_s:g} s)"
                      if warm_startup_s is not None else ")"))
    if warm is not None:
        return replace(warm, warm=True)
    return _median([r.resumed_s for r in rec if r.mode in modes and r.startup != "warm"],
                   f"cold {what} (report: failure -> first step)")


def measure(events: list[ev.Event]) -> dict[str, Measured]:
    """SimConfig field -> its measured value, for the inputs the run's events give (pure)."""
    from dslurm.observe import phases, report

    summary = report.summarize(events)
    starts = summary.starts
    resumed = [t for t in phases.tables(events) if not t.cold]
    restart = _median([t.startup_s() for t in resumed if not t.warm],
                      "cold restarts' start-up (start_phases: job start -> first step done)")
    if restart is None:  # older ledgers: no start_phases; the report's begin -> train_start
        restart = _median([s.overhead_s for s in starts if s.resumed_from and s.startup == "cold"],
                          "cold resumed starts' overhead (report: start -> train_start)")
    warm_startup = _median([t.startup_s() for t in resumed if t.warm], "")
    queue = [s.queue_wait_s for prev, s in zip(starts, starts[1:]) if prev.outcome in REQUEUED]
    rec = summary.recoveries
    warm_s = warm_startup.value if warm_startup else None
    saves = list(ev.of(events, ev.CkptSave))
    durable = [e for e in saves if e.tier == "durable"]
    two = [e for e in saves if e.tier == "two_tier"]
    found = {
        "restart_s": restart,
        "requeue_s": _median(queue, "queue waits after a requeue (report: previous start's end -> start)"),
        "relaunch_s": _in_allocation(rec, ("same_nodes",), "same-node recoveries", warm_s),
        "swap_s": (_in_allocation(rec, ("spare",), "spare swaps", warm_s)
                   or _in_allocation(rec, ("shrink",), "shrinks", warm_s)),
        "save_s": _median([e.total_s for e in durable], "durable saves' total_s (ckpt_save)"),
        # A sync save stalls for all of it; a save that stalled less was an async one.
        "async_stall_s": _median([e.stall_s for e in durable if e.stall_s < e.total_s],
                                 "async saves' stall_s (ckpt_save)"),
        "local_stall_s": _median([e.stall_s for e in two], "two-tier saves' stall_s (ckpt_save)"),
        "durable_lag_s": _median([e.lag_s for e in two], "two-tier saves' lag_s (ckpt_save: durable - local commit)"),
        "partner_lag_s": _median([e.partner_s for e in ev.of(events, ev.CkptPartnerCommit) if e.ok],
                                 "partner commits' partner_s (ckpt_partner_commit)"),
        "durable_restore_s": _restore_gap(list(ev.of(events, ev.CkptRestore))),
        **replica_costs(events),
    }
    return {k: v for k, v in found.items() if v is not None}


def replica_costs(events: list[ev.Event]) -> dict[str, Measured | None]:
    """The replica mode's inputs (`recovery.replicas`) from the replica events (pure): per lost group
    that healed, the heal (`heal_s`), its failure -> back in the quorum less the heal
    (`group_restart_s`), and the survivors' lost time (`quorum_s`); the step (`step_s`) from the windows."""
    pace = _median([w.step_time_s for w in ev.of(events, ev.Steps)], "steps windows' step_time_s (steps)")
    healed = [(lane.group, o) for lane in group_lanes(events) for o in lane.outs if o.losses and o.healed_step]
    lost = [p for g, o in healed if (p := _survivors_lost(events, g, o.t0, o.step, pace)) is not None]
    return {
        "step_s": pace,
        "heal_s": _median([o.heal_s for _, o in healed], "heals after a loss' heal_s (replica_healed)"),
        "group_restart_s": _median([o.t1 - o.t0 - (o.heal_s or 0.0) for _, o in healed if o.losses == 1],
                                   "lost groups' failure -> healed less the heal (replica_lost failed_t -> "
                                   "replica_healed)"),
        "quorum_s": _median(lost, "survivors' lost time per loss: failure -> their first step without the group "
                            "done, less one step and the discarded attempts (replica_steps)"),
    }


def _survivors_lost(events: list[ev.Event], group: int, failed_t: float, step: int | None,
                    pace: Measured | None) -> float | None:
    """The seconds a loss cost the survivors: from the failure to the end of the first step they
    committed without the group, less that step and the attempts the vote discarded in its window.
    From the lowest surviving group's `replica_steps` windows; None without them or a pace."""
    by: dict[int, list[ev.ReplicaSteps]] = {}
    for w in ev.of(events, ev.ReplicaSteps):
        if w.group != group:
            by.setdefault(w.group, []).append(w)
    if not by or pace is None:
        return None
    windows = sorted(by[min(by)], key=lambda w: w.first)
    most = max(n for w in windows for n in w.participants)
    for w in windows:
        for i, n in enumerate(w.participants):
            if n < most and w.first + i >= (step or 0) and w.t > failed_t:
                end = w.t - (len(w.participants) - 1 - i) * pace.value  # the step's end inside its window
                return round(max(0.0, end - failed_t - pace.value * (1 + w.discarded)), 4)
    return None


def _restore_gap(restores: list[ev.CkptRestore]) -> Measured | None:
    """Median restore_s from the durable tier minus the median from node-local copies (pure)."""
    durable = _median([e.restore_s for e in restores if e.tier == "durable" and e.restore_s is not None], "")
    local = _median([e.restore_s for e in restores if e.tier != "durable" and e.restore_s is not None], "")
    if durable is None or local is None:
        return None
    return Measured(round(max(0.0, durable.value - local.value), 4), durable.count + local.count,
                    f"restores' restore_s (ckpt_restore): the median from durable ({durable.count}) minus the "
                    f"median from node-local copies ({local.count})")


def from_runs(run_dirs: list[str]) -> dict[str, tuple[float, str]]:
    """Field -> (value, source) from the runs; an input comes from the first run that has it,
    except that a warm measurement (relaunch_s, swap_s of warm recoveries) wins over a cold one
    of an earlier run. A run dir without a readable ledger is a UserError naming it (report.load's)."""
    from dslurm.observe.report import load

    got: dict[str, tuple[Measured, str]] = {}
    for run_dir in run_dirs:
        events, _ = load(Path(run_dir))
        for name, m in measure(events).items():
            if name not in got or (m.warm and not got[name][0].warm):
                got[name] = (m, run_dir)
    return {name: (m.value, m.source(run_dir)) for name, (m, run_dir) in got.items()}
