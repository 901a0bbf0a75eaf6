"""Doctor's checks for why a run hangs or crawls: the collective each rank is in, a slow rank's
cause, memory at an OOM (issue 37). Pure; dslurm/observe/doctor.py turns each
(symptom, evidence, cause, action) into a Finding and prints them with the others.

The rows they map to are seed 000's symptom table (table 2.3) and its straggler timeline
diagnosis ("ranks 0-6 finish input loading in 45 ms, rank 7 takes 130 ms ... the unequal
pre-collective gap identifies input or host work on rank 7"):

- a slow rank in `data`: "GPU utilization high, power low -- data-loader time, collective wait
  -- input path or synchronization";
- a slow rank in `compute`: "throughput stops scaling" on one rank only: a slow device or host
  (throttling, a noisy neighbour) -- the device-health poll and the burn-in look at it;
- a slow rank in `optimizer`: host work on that rank (CPU offload, a Python-side hook).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from dslurm.observe import events as E
from dslurm.observe import forensics
from dslurm.observe.report import Start
from dslurm.run import JOB, SITE, RunDir

Row = tuple[str, list[str], str, str]
MAX_EVIDENCE = 6
REPEATS = 2  # a rank named slow in the same part this many times is a pattern, not a GC pause

_SLOW_HELP = {
    "data": ("input path (seed table 2.3: 'GPU utilization high, power low' -- data-loader time, collective wait): "
             "the rank's batches arrive late and every other rank waits for it in the next collective",
             "look at that host's input: its file system reads, loader workers (data.workers), tokenization on "
             "the fly, CPU contention from another process; `dslurm report` shows the data wait per step"),
    "compute": ("a slow device or host (seed: 'a straggler slows every synchronized rank'): its forward/backward "
                "takes longer than the others' for the same work -- throttling, a weak GPU, a noisy neighbour",
                "check the device-health findings for that host (throttling, Xid), run `dslurm burnin` on it; if "
                "it repeats, blocklist the node"),
    "optimizer": ("host work on that rank's optimizer step (CPU offload, a Python hook, memory pressure)",
                  "profile a few steps (`dslurm ctl RUN_DIR profile`) and compare that rank's optimizer range"),
}


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(t))


def hang_evidence(e: E.Hang) -> list[str]:
    """The collective-level lines of a hang: the stall sentences, each rank's c10d position,
    where the dumps are and the command that reads them."""
    out = [f"collective record: {line}" for line in forensics.summary_lines(e.flight) if line not in e.why]
    for r, c in list(e.collectives.items())[:MAX_EVIDENCE]:
        pos = [f"#{x.get('seq')} {x.get('op')} of group {x.get('group')} ({'inside' if x.get('inside') else 'done'})"
               for x in (c.get("c10d") or []) if isinstance(x, dict)] if isinstance(c, dict) else []
        if pos:
            out.append(f"rank {r} c10d: " + "; ".join(pos))
    if e.flight_dir:
        out.append(f"flight-recorder dumps: {e.flight_dir} (read with `{forensics.VIEW.format(dir=e.flight_dir)}`)")
    return out


def slow_parts(starts: Sequence[Start]) -> list[Row]:
    """A rank named slow in the same part of the step in REPEATS or more straggler checks."""
    seen: dict[tuple[str, str], list[str]] = {}
    for s in starts:
        for e in s.all(E.Stragglers):
            for c in e.causes:
                if isinstance(c, dict) and c.get("part") in _SLOW_HELP:
                    key = (str(c.get("host")), str(c.get("part")))
                    split = e.parts.get(str(c.get("rank")))
                    seen.setdefault(key, []).append(
                        f"{_when(e.t)} step {e.step}: rank {c.get('rank')} {c.get('behind_s')} s behind the others "
                        f"in {c.get('part')} (relative score {c.get('score')}; split {split})")
    out = []
    for (host, part), ev in sorted(seen.items()):
        if len(ev) >= REPEATS:
            cause, fix = _SLOW_HELP[part]
            out.append((f"slow rank on {host}: its {part} in {len(ev)} checks", ev[:MAX_EVIDENCE], cause,
                        fix.replace("that host", host)))
    return out


def ooms(starts: Sequence[Start]) -> list[Row]:
    """Out-of-memory errors (train/oom.py) with where they happened and the decision's fix."""
    out = []
    for s in starts:
        hits = s.all(E.Oom)
        if not hits:
            continue
        ev = [f"{_when(o.t)} rank {o.rank} at step {o.step} in {o.phase}"
              + (f" (last collective {o.collective})" if o.collective else "") + f": {o.error}" for o in hits]
        ev += [f"allocator on rank {o.rank}: {_mem(o.memory)}" for o in hits if o.memory]
        ev += [f"allocator snapshot: {o.snapshot} (drag it onto https://pytorch.org/memory_viz)"
               for o in hits if o.snapshot]
        ev += [f"rank {o.rank}: {o.note}" for o in hits if o.note]
        fix = [r.reason for r in s.all(E.Requeue) if r.ending == "oom"]
        out.append((f"out of memory in start {s.index} at step {hits[0].step} ({hits[0].phase})", ev[:MAX_EVIDENCE],
                    "the step's peak memory exceeds the device: the same layout and batch reach it again, so the "
                    "start was not retried",
                    fix[-1] if fix else f"`dslurm plan --site RUN/{SITE} --job RUN/{JOB}` for a layout that "
                    "fits; or train.activation_checkpoint: full, a smaller micro-batch (raise train.grad_accum)"))
    return out


def _mem(m: dict[str, Any]) -> str:
    return ", ".join(f"{k.removesuffix('_gib')} {v:.2f} GiB" if k.endswith("_gib") else f"{k} {v:g}"
                     for k, v in m.items() if isinstance(v, (int, float)))


def dump_rows(run_dir: Path, events: Iterable[E.Event]) -> list[Row]:
    """Flight Recorder dumps in a start's facts dir that no hang event read (a `dslurm.runtime`
    script's ranks dump when a collective fails): the ranks that did not enter the collective
    the others waited in. Reads the dumps (the one check here that is not pure)."""
    shown = {h.flight_dir for h in E.of(events, E.Hang)}
    out = []
    starts = RunDir(run_dir).starts
    for d in sorted(starts.glob("*/")) if starts.is_dir() else []:
        if not (d / forensics.SUBDIR).is_dir() or str(d / forensics.SUBDIR) in shown:
            continue
        states = forensics.read_dumps(d)
        if not states:
            continue
        world = 1 + max([*states, *(r for g in states.values() for st in g.values() for r in st.ranks)])
        who, why, found = forensics.verdict(states, world)
        if not found:
            continue
        ev = [f"collective record: {s.sentence()}" for s in found[:3]]
        ev.append(f"dumps of rank(s) {sorted(states)} in {d / forensics.SUBDIR} "
                  f"(`{forensics.VIEW.format(dir=d / forensics.SUBDIR)}`)")
        out.append((f"collective stall in start {d.name}: suspect rank(s) {who or 'none'}", ev,
                    "synchronization: " + (why or "every member was inside the same collective: the transport"),
                    "read the suspects' logs and stacks (their last collective is named); if the fabric hangs, "
                    "run `dslurm burnin` on the nodes"))
    return out


def checks(starts: Sequence[Start]) -> Iterable[Row]:
    """Every row of this module's checks."""
    return [*slow_parts(starts), *ooms(starts)]
