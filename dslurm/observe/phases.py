"""A run's starts, phase by phase, and what a restart costs next to the cold start. Pure.

The trainer's rank 0 writes one `StartPhases` event per start right after its first step
(train/startup.py measures it); the launcher on node 0 writes `job_start` before any worker
exists. This module pairs them: spawn = job_start -> the worker's birth (`t0`), then the
worker's own phases in `PHASES` order. `restart_overhead` divides each start's start-up by
the cold start's, on the same basis (with spawn only when both starts have it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from dslurm.observe import events as ev

# The phases of one start, in the order they happen. "spawn" is the reader's (it needs the
# launcher's job_start); the rest are measured in the worker (train/startup.py marks them).
PHASES = ("interpreter", "config", "imports", "rendezvous", "burnin", "build", "data",
          "checkpoint_setup", "restore", "first_step")
ORDER = ("spawn", *PHASES)
SPAWN_SLACK_S = 1.0  # job_start is stamped when written; a worker born just before it still pairs


@dataclass(frozen=True, slots=True)
class StartTable:
    """One start: (phase, seconds) rows in ORDER, unknown phase names after them."""

    job_id: str | None
    restart: int | None
    step: int
    """the step it resumed from"""
    generation: str | None
    """what it restored (None: cold, nothing loaded)"""
    rows: list[tuple[str, float]] = field(default_factory=list)
    warm: bool = False
    """its workers were forked by a warm pool (the launcher's job_start says mode "warm")"""

    @property
    def cold(self) -> bool:
        return self.generation is None

    def seconds(self, phase: str) -> float | None:
        return next((s for n, s in self.rows if n == phase), None)

    def startup_s(self, *, spawn: bool = True) -> float:
        """Seconds from job start (or the worker's birth, without spawn) to the first step done."""
        return round(sum(s for n, s in self.rows if spawn or n != "spawn"), 4)


def _number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0


def _launch(e: ev.StartPhases, launches: list[ev.JobStart]) -> ev.JobStart | None:
    """The last launch of the same start before this worker's birth."""
    same = [j for j in launches if (j.job_id, j.restart) == (e.job_id, e.restart)
            and j.t <= e.t0 + SPAWN_SLACK_S]
    return same[-1] if same and e.t0 else None


def _spawn(e: ev.StartPhases, launches: list[ev.JobStart]) -> float | None:
    """job_start -> this worker's birth."""
    j = _launch(e, launches)
    return None if j is None else round(max(0.0, e.t0 - j.t), 4)


def table(e: ev.StartPhases, launches: Iterable[ev.JobStart] = ()) -> StartTable:
    """The phase table of one start (garbled phase values are left out)."""
    phases = {k: float(v) for k, v in e.phases.items() if _number(v)}
    rows = [(n, round(phases[n], 4)) for n in PHASES if n in phases]
    rows += [(n, round(s, 4)) for n, s in phases.items() if n not in PHASES]
    launches = list(launches)
    spawn, j = _spawn(e, launches), _launch(e, launches)
    if spawn is not None:
        rows.insert(0, ("spawn", spawn))
    return StartTable(job_id=e.job_id, restart=e.restart, step=e.step, generation=e.generation, rows=rows,
                      warm=j is not None and j.mode == "warm")


def tables(run_events: Iterable[ev.Event]) -> list[StartTable]:
    """Every start of a run, in ledger order."""
    evs = list(run_events)
    launches = list(ev.of(evs, ev.JobStart))
    return [table(e, launches) for e in ev.of(evs, ev.StartPhases)]


def restart_overhead(starts: list[StartTable]) -> list[tuple[StartTable, float | None]]:
    """Each start with its start-up divided by the (first) cold start's; None without a cold
    start or for a cold start of zero seconds. Spawn counts only when both starts have it."""
    cold = next((s for s in starts if s.cold), None)
    out: list[tuple[StartTable, float | None]] = []
    for s in starts:
        ratio = None
        if cold is not None:
            both = s.seconds("spawn") is not None and cold.seconds("spawn") is not None
            base = cold.startup_s(spawn=both)
            ratio = round(s.startup_s(spawn=both) / base, 3) if base > 0 else None
        out.append((s, ratio))
    return out


def format_table(starts: list[StartTable]) -> str:
    """Plain text: one column per start, one row per phase, the total and the ratio to cold."""
    if not starts:
        return "no start_phases events"
    names = [n for n in ORDER if any(s.seconds(n) is not None for s in starts)]
    names += [n for s in starts for n, _ in s.rows if n not in names and n not in ORDER]
    heads = [f"start {s.restart if s.restart is not None else '?'}{' (cold)' if s.cold else ''}"
             f"{' (warm)' if s.warm else ''}" for s in starts]
    lines = [f"{'phase':<17}" + "".join(f"{h:>16}" for h in heads)]
    for n in names:
        cells = [s.seconds(n) for s in starts]
        lines.append(f"{n:<17}" + "".join(f"{'-' if c is None else f'{c:.3f}':>16}" for c in cells))
    lines.append(f"{'total s':<17}" + "".join(f"{s.startup_s():>16.3f}" for s in starts))
    ratios = [r for _, r in restart_overhead(starts)]
    lines.append(f"{'x cold start':<17}" + "".join(f"{'-' if r is None else f'{r:.2f}':>16}" for r in ratios))
    return "\n".join(lines)
