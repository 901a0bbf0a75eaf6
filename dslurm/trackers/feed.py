"""Ledger events -> tracker points and annotations. Pure: no tracker package, no I/O.

The trackers get the ledger's own numbers (one fact, one home): rank 0 appends an event, the
ledger hands it to its listeners, and this module says what each tracker writes for it.

The step axis is *completed optimizer steps*, as `eval`, `ckpt_save`, `train_start` and `exit`
count them; a `steps` window (0-based first..last) is plotted at `last + 1`. So a start that
resumed after `k` completed steps writes points at `k + 1` and later, and `purge_from(k)` is
where the replaced points of an earlier start begin (TensorBoard's purge_step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dslurm.observe import events


@dataclass(frozen=True, slots=True)
class Feed:
    """What one ledger event becomes in a tracker: scalars at `step`, and/or one annotation."""
    step: int
    values: dict[str, float] = field(default_factory=dict)
    note: str | None = None
    opens: bool = False
    """a start's first event: trackers open here (resumed after `step` completed steps)"""
    closes: bool = False
    """the start's last word (exit): trackers finish their run here"""


def purge_from(resumed: int) -> int:
    """The first tracker step a start resumed after `resumed` completed steps writes again."""
    return resumed + 1


def _finite(**kv: float | None) -> dict[str, float]:
    return {k: float(v) for k, v in kv.items() if v is not None and math.isfinite(float(v))}


def feed(ev: events.Event) -> Feed | None:
    """The tracker view of one ledger event; None for events trackers do not show."""
    if isinstance(ev, events.Steps) and ev.last is not None:
        vals = _finite(**{"train/loss": ev.loss, "train/grad_norm": ev.grad_norm, "train/lr": ev.lr,
                          "perf/tokens_per_s": ev.tokens_per_s, "perf/mfu": ev.mfu,
                          "perf/step_time_s": ev.step_time_s})
        vals.update(_finite(**{f"train/{k}": v for k, v in ev.values.items()
                               if isinstance(v, (int, float)) and not isinstance(v, bool)}))
        return Feed(step=ev.last + 1, values=vals, opens=True)
    if isinstance(ev, events.Eval) and ev.step is not None:
        return Feed(step=ev.step, values=_finite(**{"eval/loss": ev.loss, "eval/ppl": ev.ppl}))
    if isinstance(ev, events.CkptSave) and ev.step is not None:
        return Feed(step=ev.step, values=_finite(**{"ckpt/stall_s": ev.stall_s, "ckpt/total_s": ev.total_s}))
    if isinstance(ev, events.TrainStart):
        how = f"resumed after step {ev.step} ({ev.generation})" if ev.step else "fresh start"
        return Feed(step=ev.step, note=f"start: {how}", opens=True)
    if isinstance(ev, events.Signal):
        return Feed(step=ev.step or 0, note=f"signal: {ev.signal} at step {ev.step}")
    if isinstance(ev, events.NonFinite):
        return Feed(step=(ev.step or 0) + 1, note=f"non-finite loss at step {ev.step}: {ev.action}")
    if isinstance(ev, events.Exit):
        return Feed(step=ev.step or 0, note=f"exit: {ev.reason} at step {ev.step} (code {ev.code})", closes=True)
    return None


def resumed_step(ev: events.Event) -> int:
    """The completed steps the start that writes `ev` (its first fed event) resumed after."""
    if isinstance(ev, events.Steps) and ev.first is not None:
        return ev.first
    return getattr(ev, "step", None) or 0
