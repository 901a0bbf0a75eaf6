"""Two-tier checkpoints in the report: durable lag, recovery point on process restart vs node loss,
and what the lag policy cost. Pure: reads a run's ledger events, start by start.

When a generation became restorable, from the ledger (dslurm/checkpoint/twotier.py writes it):
- on the same nodes (process restart, requeue onto them): its `ckpt_local_commit` (event time);
- after a node loss: its partner commit (`ckpt_partner_commit`, ok: a lost node's shards are
  on its partner) or its durable commit, `local_commit_t + lag_s` of its `ckpt_save` (a
  durable-only save: the `ckpt_save` time, which for an async save is when it was reported, a
  little late), whichever came first. A durable-only save serves a process restart from then on too.
Durable lag: `lag_s` of each two-tier `ckpt_save` (pointer move minus local commit).
RPO (recovery point objective, in seconds of training): what a failure at the worst moment would
throw away. Within a start, training begins at `train_start` from a restored (or fresh) state;
each restorable point ends a gap; the last gap runs to the start's last event. A failure just
before the end of a gap loses all of it. Reported: median and max of the gaps, per failure kind.
Lag policy cost: on_lag=wait, the seconds training waited for the copier (`lag_wait_s` of
`ckpt_local_commit`); skip_local, the saves not taken (`ckpt_save_skipped`, reason lag);
skip_durable, the generations left local only (`ckpt_durable_skipped`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from dslurm.observe import events as ev
from dslurm.observe.events import Event


@dataclass(slots=True)
class Durability:
    """The two-tier section of `dslurm report` (None in the summary for a durable-only run)."""

    local_commits: int
    durable_commits: int
    """two-tier generations whose durable copy committed (the pointer moved to them)"""
    lag_median_s: float | None
    lag_max_s: float | None
    rpo_restart_median_s: float | None
    rpo_restart_max_s: float | None
    rpo_node_loss_median_s: float | None
    rpo_node_loss_max_s: float | None
    lag_waits: int = 0
    """saves that waited for the copier (on_lag=wait) ..."""
    lag_wait_s: float = 0.0
    """... and the seconds they waited, in all"""
    skipped_local: list[int] = field(default_factory=list)
    """steps whose save was skipped because the copier was behind (on_lag=skip_local)"""
    skipped_durable: list[int] = field(default_factory=list)
    """steps whose generation stayed local only (on_lag=skip_durable)"""
    partner_commits: int = 0
    """generations copied to the partner nodes (checkpoint.partner): a node loss restores them"""


def _durable_t(e: ev.CkptSave) -> float:
    if e.local_commit_t is not None and e.lag_s is not None:
        return e.local_commit_t + e.lag_s
    return e.t


def _gaps(begin: float, end: float, points: list[float]) -> list[float]:
    """Lengths of the stretches between restorable points (begin and end included)."""
    marks = [begin] + sorted(p for p in points if begin < p < end) + [end]
    return [b - a for a, b in zip(marks, marks[1:])]


def _stats(xs: list[float]) -> tuple[float | None, float | None]:
    return (round(statistics.median(xs), 3), round(max(xs), 3)) if xs else (None, None)


def durability(starts: list[list[Event]]) -> Durability | None:
    """The section from the events of each start (report.split_starts); None without two tiers."""
    every = [e for s in starts for e in s]
    local = list(ev.of(every, ev.CkptLocalCommit))
    two = [e for e in ev.of(every, ev.CkptSave) if e.tier == "two_tier"]
    if not local and not two:
        return None
    restart_gaps: list[float] = []
    node_gaps: list[float] = []
    for evs in starts:
        ts = next(ev.of(evs, ev.TrainStart), None)
        if ts is None:  # never trained: nothing to lose
            continue
        end = max(e.t for e in evs)
        saves, commits = list(ev.of(evs, ev.CkptSave)), list(ev.of(evs, ev.CkptLocalCommit))
        # a generation serves a process restart from its local commit on; its durable copy adds
        # a point only for a generation that had none (a durable-only save)
        had_local = {e.generation for e in commits}
        restart_gaps += _gaps(ts.t, end, [e.t for e in commits]
                              + [_durable_t(e) for e in saves if e.generation not in had_local])
        partner = [e.t for e in ev.of(evs, ev.CkptPartnerCommit) if e.ok]
        node_gaps += _gaps(ts.t, end, [_durable_t(e) for e in saves] + partner)
    waits = [e.lag_wait_s for e in local if e.lag_wait_s > 0]
    lag = _stats([e.lag_s for e in two if e.lag_s is not None])
    rr, rn = _stats(restart_gaps), _stats(node_gaps)
    return Durability(
        local_commits=len(local), durable_commits=len(two), lag_median_s=lag[0], lag_max_s=lag[1],
        rpo_restart_median_s=rr[0], rpo_restart_max_s=rr[1], rpo_node_loss_median_s=rn[0],
        rpo_node_loss_max_s=rn[1], lag_waits=len(waits), lag_wait_s=round(sum(waits), 3),
        skipped_local=[e.step for e in ev.of(every, ev.CkptSaveSkipped) if e.reason == "lag" and e.step is not None],
        skipped_durable=[e.step for e in ev.of(every, ev.CkptDurableSkipped) if e.step is not None],
        partner_commits=sum(1 for e in ev.of(every, ev.CkptPartnerCommit) if e.ok))


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}s"


def lines(d: Durability) -> list[str]:
    """The human form: three lines."""
    policy = [f"waited {d.lag_waits}x, {d.lag_wait_s:.1f}s" if d.lag_waits else "",
              f"skip_local {len(d.skipped_local)} save(s) not taken" if d.skipped_local else "",
              f"skip_durable {len(d.skipped_durable)} left local only" if d.skipped_durable else ""]
    return [
        f"two-tier checkpoints: {d.local_commits} local commit(s), "
        + (f"{d.partner_commits} on partner nodes, " if d.partner_commits else "")
        + f"{d.durable_commits} durable; durable lag "
        f"median {_s(d.lag_median_s)}, max {_s(d.lag_max_s)}",
        f"RPO (training lost at worst): process restart median {_s(d.rpo_restart_median_s)}, max "
        f"{_s(d.rpo_restart_max_s)}; node loss median {_s(d.rpo_node_loss_median_s)}, max {_s(d.rpo_node_loss_max_s)}",
        "lag policy cost (on_lag): " + ("; ".join(p for p in policy if p) or "none (the copier kept up)"),
    ]
