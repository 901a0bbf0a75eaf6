"""A site's memory of its nodes: the evidence each run found against a node, kept between jobs.

The burn-in, the hang watchdog, the SDC checks, the device poll (Xid, ECC) and the straggler
checks name bad nodes inside one run (its blocklist); this store keeps that evidence for the
whole site, so the next job does not land on the same flaky node:

- one small append-only file per node, `<site storage.durable>/.dslurm-site/nodes/<node>.jsonl`,
  each line one piece of evidence (kind, run, time, what and the numbers), written with the
  ledger's own crash-safe append (`dslurm.observe.ledger.append_line`: one O_APPEND write,
  fsynced, a torn line skipped by the reader and never costing the next line);
- fed from a run's ledger by `requeue-me` at the end of each start (`record_run`); a line is
  keyed by (run, event time, kind), so feeding a ledger twice adds nothing;
- read by `dslurm site nodes --site S` (per node: evidence, age, a suggested action with the
  admin's command) and by `dslurm submit`, which leaves out a node whose recent evidence weighs
  at least `site.nodes.exclude_after` (each piece weighs 1, halved every `site.nodes.half_life_h`
  hours), says so, and lets a user take a node back (`--use-node`).

Pure but for `record`, `read` and the file names.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dslurm.observe import events as ev
from dslurm.observe.ledger import append_line, encode

SUBDIR = Path(".dslurm-site") / "nodes"
KINDS = ("burnin", "xid", "hang", "sdc", "straggler")
STRAGGLER_REPEAT = 2
"""a host named slow in this many straggler checks of one run is evidence (one check is noise)"""
_NODE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


@dataclass(frozen=True, slots=True)
class Evidence:
    node: str
    kind: str
    """burnin | xid | hang | sdc | straggler"""
    t: float
    run: str
    what: str
    numbers: dict[str, Any] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.run}|{self.t:.3f}|{self.kind}"


def store_dir(durable: str | Path) -> Path:
    return Path(durable) / SUBDIR


def from_events(events: Sequence[ev.Event], run: str) -> list[Evidence]:
    """The evidence a run's ledger holds against nodes. Pure."""
    out: list[Evidence] = []
    for e in ev.of(events, ev.Preflight):
        for node in e.bad_nodes:
            out.append(Evidence(node, "burnin", e.t, run, "; ".join(p for p in e.problems if node in p)[:300]
                                or "failed the burn-in", {"problems": len(e.problems)}))
    for h in ev.of(events, ev.Hang):
        for node in dict.fromkeys(h.suspect_hosts):
            out.append(Evidence(node, "hang", h.t, run, f"hang suspect after step {h.step}",
                                {"idle_s": h.idle_s, "step": h.step}))
    for c in ev.of(events, ev.Sdc):
        if c.named:
            for node in dict.fromkeys(c.suspect_hosts):
                out.append(Evidence(node, "sdc", c.t, run, f"silent data corruption at step {c.step}",
                                    {"step": c.step, "ranks": c.suspects}))
    for d in ev.of(events, ev.DeviceHealth):
        bad = [f for f in d.findings if "Xid" in f or "ECC" in f]
        if bad and d.host:
            out.append(Evidence(d.host, "xid", d.t, run, "; ".join(bad)[:300], {"step": d.step}))
    checks = list(ev.of(events, ev.Stragglers))
    named: dict[str, list[ev.Stragglers]] = {}
    for s in checks:
        for host in dict.fromkeys(s.hosts):
            named.setdefault(host, []).append(s)
    for host, seen in named.items():
        if len(seen) >= STRAGGLER_REPEAT:
            out.append(Evidence(host, "straggler", seen[-1].t, run, f"slow in {len(seen)} of {len(checks)} "
                                "straggler checks", {"checks": len(seen), "of": len(checks),
                                                     "factor": seen[-1].factor}))
    return [x for x in out if _NODE.fullmatch(x.node)]


def read(durable: str | Path) -> dict[str, list[Evidence]]:
    """node -> its evidence, oldest first (a torn or garbled line is skipped)."""
    out: dict[str, list[Evidence]] = {}
    d = store_dir(durable)
    for path in sorted(d.glob("*.jsonl")) if d.is_dir() else []:
        items = []
        with open(path, "rb") as fh:
            for raw in fh:
                try:
                    rec = json.loads(raw)
                    items.append(Evidence(node=str(rec["node"]), kind=str(rec["kind"]), t=float(rec["t"]),
                                          run=str(rec["run"]), what=str(rec.get("what", "")),
                                          numbers=dict(rec.get("numbers") or {})))
                except (ValueError, KeyError, TypeError):
                    continue
        if items:
            out[path.stem] = items
    return out


def record(durable: str | Path, items: Iterable[Evidence]) -> int:
    """Append each piece of evidence not yet in its node's file; returns how many were new."""
    have = {n: {x.key for x in xs} for n, xs in read(durable).items()}
    d = store_dir(durable)
    new = 0
    for x in items:
        if x.key in have.setdefault(x.node, set()):
            continue
        d.mkdir(parents=True, exist_ok=True)
        if append_line(d / f"{x.node}.jsonl", encode(asdict(x))):
            have[x.node].add(x.key)
            new += 1
    return new


def record_run(durable: str | Path, run_dir: Path) -> int:
    """Feed the store from a run's ledger (idempotent)."""
    return record(durable, from_events(ev.read(run_dir), str(run_dir)))


def weight(items: Sequence[Evidence], now: float, half_life_h: float) -> float:
    """Recent evidence counts: each piece weighs 1, halved every `half_life_h` hours. Pure. Compared
    and shown to one decimal (two pieces of the last hour weigh 2.0)."""
    return float(sum(0.5 ** (max(0.0, now - x.t) / 3600.0 / half_life_h) for x in items))


def excluded(store: dict[str, list[Evidence]], *, exclude_after: int, half_life_h: float, now: float | None = None,
             use: Iterable[str] = ()) -> dict[str, float]:
    """node -> its weight, for the nodes new jobs leave out (none when exclude_after is 0;
    `use`: nodes a user takes back). Pure."""
    if exclude_after <= 0:
        return {}
    now = time.time() if now is None else now
    keep = set(use)
    return {n: w for n, xs in sorted(store.items())
            if n not in keep and (w := round(weight(xs, now, half_life_h), 1)) >= exclude_after}


def suggestion(node: str, items: Sequence[Evidence], w: float, exclude_after: int) -> tuple[str, str | None]:
    """(what to do, the admin's command or None). Pure."""
    kinds = sorted({x.kind for x in items})
    reason = f"dslurm: {'+'.join(kinds)} x{len(items)}"
    if exclude_after and round(w, 1) >= exclude_after:
        return ("drain it and have it checked (new jobs leave it out)",
                f"scontrol update nodename={node} state=drain reason=\"{reason}\"")
    if {"xid", "sdc"} & set(kinds):
        return ("run `dslurm burnin` on it; drain it if it fails", None)
    return ("watch it (not excluded yet)", None)


def age(seconds: float) -> str:
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"
