"""The report's lines for issue 37's events: the collective a hang stopped in, slow parts of the
step, out-of-memory errors and profiles (with their files and how to view them). One start's
events in, text out (it only looks whether each profile file exists); dslurm/observe/report.py
prints them under the health lines."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from dslurm.observe import events as ev
from dslurm.observe import forensics, slowrank


def lines(index: int, events: Sequence[ev.Event]) -> list[str]:
    out = []
    for h in ev.of(events, ev.Hang):
        out += [f"  collective: {line}" for line in forensics.summary_lines(h.flight, limit=1)]
        if h.flight_dir:
            out.append(f"  flight-recorder dumps: {h.flight_dir} ({forensics.VIEW.format(dir=h.flight_dir)})")
    checks = list(ev.of(events, ev.Stragglers))
    named = Counter((str(c.get("rank")), str(c.get("host")), str(c.get("part")))
                    for e in checks for c in e.causes if isinstance(c, dict))
    for (rank, host, part), n in sorted(named.items(), key=lambda x: -x[1]):
        last = next(c for e in reversed(checks) for c in e.causes
                    if isinstance(c, dict) and (str(c.get("rank")), str(c.get("part"))) == (rank, part))
        out.append(f"slow rank in start {index}: {slowrank.sentence(last)} ({n} of {len(checks)} straggler checks)")
    for o in ev.of(events, ev.Oom):
        out.append(f"out of memory in start {index}: rank {o.rank} at step {o.step} in {o.phase}: {o.error}"
                   + (f"; allocator snapshot {o.snapshot}" if o.snapshot else ""))
    for p in ev.of(events, ev.Profile):
        d = Path(p.dir) if p.dir else None
        have = [f for f in p.files if d is not None and (d / f).is_file()]
        out.append(f"profile of steps {p.first_step}..{p.last_step} in start {index} ({p.why}): {len(have)} of "
                   f"{len(p.files)} file(s) in {p.dir}: {', '.join(have) or 'none written'}; view: {p.view}")
    return out
