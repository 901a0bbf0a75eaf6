"""The report's tracker lines: per experiment tracker, what it took as it came, what it took late
(after an outage, from the ledger), and what it still lacks -- from the `tracker_delivery` events
each start's end and each `dslurm trackers sync` write (dslurm/trackers/). Pure."""

from __future__ import annotations

from collections.abc import Sequence

from dslurm.observe import events as ev


def lines(events: Sequence[ev.Event], run_dir: str = "RUN_DIR") -> list[str]:
    out = []
    deliveries = list(ev.of(events, ev.TrackerDelivery))
    for name in sorted({d.tracker for d in deliveries}):
        mine = [d for d in deliveries if d.tracker == name]
        last = mine[-1]
        delivered, late = sum(d.delivered for d in mine), sum(d.late for d in mine)
        outages = sum(d.outages for d in mine)
        fails = [f for f in ev.of(events, ev.TrackerFailed) if f.tracker == name]
        why = f" after {outages} outage(s)" if outages else ""
        text = (f"tracker {name}: {delivered} item(s) delivered, {late} late-delivered (backfilled from the "
                f"ledger{why}), {last.missing} still missing")
        if fails and not outages:
            text += f"; {len(fails)} failure(s), last: {fails[-1].error}"
        if last.missing or not last.closed:
            what = "the missing items" if last.missing else "its final status"
            text += (f"; {what}: the next start sends {'them' if last.missing else 'it'}, or "
                     f"`dslurm trackers sync {run_dir} --to {name}`")
        out.append(text)
    for d in ev.of(events, ev.TrackerDropped):  # ledgers of older versions
        out.append(f"tracker {d.tracker}: {d.items} item(s) never sent in one start ({d.why}); "
                   f"`dslurm trackers sync {run_dir} --to {d.tracker}` sends what it lacks")
    return out
