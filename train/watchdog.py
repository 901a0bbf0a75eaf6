"""The hang watchdog of one training process (the rules: dslurm/health/__init__.py).

The loop calls `beat(step)` after every step and wraps its own collectives in
`collective(name)`; both are a few attribute writes. A daemon thread looks every
`health.poll_s` seconds: no beat within `hang_bound(recent step times)` means a hang. Then it

1. dumps every thread's Python stack (faulthandler) to `<start dir>/hang-rank-NNNNN.txt`,
2. dumps its Flight Recorder (every c10d collective of every process group: FSDP's, TP's, PP's,
   the trainer's own; dslurm/runtime/flight.py) to `<start dir>/fr/rank-NNNNN` and writes its note
   (step, last trainer collective entered, still inside, each group's last c10d collective) next to it,
3. waits briefly for the other ranks' notes (they stopped together, so they fire together),
   names the suspects -- first from the c10d record (`forensics.verdict`: who did not enter
   collective #N of group G while the others wait inside it), else from the trainer's notes -- and
   the lowest rank that fired writes the ledger's `hang` event,
4. ends the process through `on_hang` (train/__main__.py: the rank's own report -- `crash` for a
   suspect, `peer_lost` for a rank that waited on it -- then exit 80), so the step ends as a crash
   and requeue-me (or the in-allocation restart) takes over.

The thread needs the interpreter: a rank stuck in native code holding the GIL cannot fire, so it
leaves no note, and the others name it as the suspect for exactly that.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import logging
import socket
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dslurm import health
from dslurm.durable import atomic_write_text
from dslurm.observe import events, forensics
from dslurm.observe.ledger import Ledger
from dslurm.runtime import flight

if TYPE_CHECKING:
    from dslurm.config import HealthSpec
    from dslurm.run import RunDir

log = logging.getLogger(__name__)
WINDOW = 64  # recent step times the median is taken over


@dataclass(frozen=True)
class HangVerdict:
    """What a rank whose watchdog fired says about itself."""

    rank: int
    step: int
    kind: str  # crash (a suspect, or no suspect could be named) | peer_lost (waited on a suspect)
    error: str
    t: float  # when progress stopped (the last beat), the time of the failure itself


class _Collective:
    """`with watchdog.collective(name):` -- the note of the last collective this rank entered."""

    __slots__ = ("wd", "name")

    def __init__(self, wd: Watchdog, name: str) -> None:
        self.wd, self.name = wd, name

    def __enter__(self) -> None:
        wd = self.wd
        wd.seq += 1
        wd.coll_name, wd.inside = self.name, True

    def __exit__(self, *exc: object) -> None:
        self.wd.inside = False


class Watchdog:
    def __init__(self, spec: HealthSpec, *, rank: int, world: int, start_dir: Path | None, run: RunDir,
                 on_hang: Callable[[HangVerdict], None]) -> None:
        self.spec, self.rank, self.world = spec, rank, world
        self.dir, self.run, self.on_hang = start_dir, run, on_hang
        self.seq, self.coll_name, self.inside = 0, "", False
        self.step = 0
        self.times: deque[float] = deque(maxlen=WINDOW)
        self._last = time.monotonic()
        self._last_wall = time.time()
        self._record_next = False  # the first interval (warm-up) and one holding a save are not steps
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._fired = False  # under _lock: close() and the thread agree on whether it fired
        self._lock = threading.Lock()

    # ------------------------------------------------------------ the loop's side (hot path)

    def collective(self, name: str) -> _Collective:
        return _Collective(self, name)

    def beat(self, step: int) -> None:
        now = time.monotonic()
        if self._record_next:
            self.times.append(now - self._last)
        self._record_next, self._long = True, False
        self._last, self._last_wall, self.step = now, time.time(), step

    def expect_long(self) -> None:
        """The next interval holds a save: the ceiling applies and it is not a step time."""
        self._record_next = False
        self._long = True

    _long = True  # until the first beat: the ceiling

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """A wait that is neither a step nor a hang (a test's DSLURM_FAULT_AWAIT): the ceiling
        applies during it; afterwards the clock restarts where it was, in the state it had (the
        next interval is recorded as a step time only if it would have been)."""
        record, long_ = self._record_next, self._long
        self._long = True
        try:
            yield
        finally:
            self._last, self._last_wall = time.monotonic(), time.time()
            self._record_next, self._long = record, long_

    def bound(self) -> float:
        if self._long:
            return float(self.spec.hang_ceiling_s)
        return health.hang_bound(list(self.times), k=self.spec.hang_k, floor_s=self.spec.hang_floor_s,
                                 ceiling_s=self.spec.hang_ceiling_s)

    # ------------------------------------------------------------ the thread

    def start(self) -> Watchdog:
        self._last, self._last_wall = time.monotonic(), time.time()
        self._thread = threading.Thread(target=self._watch, name="dslurm-watchdog", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop watching. If it has already fired, wait for the verdict to finish: a peer's exit
        can break this process's collective while its watchdog is still gathering notes, and this
        rank may be the one that writes the ledger's hang event (the lowest that fired); leaving
        now would lose the event (seen under load). The verdict then ends the process (on_hang)."""
        with self._lock:
            self._stop.set()
            fired = self._fired
        t = self._thread
        if fired and t is not None and t is not threading.current_thread():
            t.join(timeout=health.gather_s(float(self.spec.hang_ceiling_s)) + 10.0)

    def _watch(self) -> None:
        interval = health.poll_s(self.spec.hang_floor_s)
        while not self._stop.wait(interval):
            idle, bound = time.monotonic() - self._last, self.bound()
            if idle > bound:
                with self._lock:
                    if self._stop.is_set():
                        return
                    self._fired = True
                self._fire(idle, bound)
                return

    def _note_path(self, rank: int) -> Path:
        assert self.dir is not None
        return self.dir / f"hang-rank-{rank:05d}.json"

    def _fire(self, idle: float, bound: float) -> None:
        step, host = self.step, socket.gethostname()
        groups = flight.dump(self.dir, self.rank)  # every c10d collective of every group (FSDP, TP, PP)
        note = health.RankNote(rank=self.rank, host=host, step=step, seq=self.seq, inside=self.inside,
                               collective=self.coll_name, groups=groups)
        log.error("[rank %d] HANG: no step progress for %.1f s (bound %.1f s) after step %d; last collective "
                  "%s #%d (%s)", self.rank, idle, bound, step, note.collective or "-", note.seq,
                  "inside" if note.inside else "left")
        notes = {self.rank: note}
        if self.dir is not None:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                with open(self.dir / f"hang-rank-{self.rank:05d}.txt", "w") as fh:
                    fh.write(f"rank {self.rank} on {host}: no step progress for {idle:.1f} s (bound {bound:.1f} s) "
                             f"after step {step}; last collective {note.collective or '-'} #{note.seq} "
                             f"({'inside' if note.inside else 'left'})\n\n")
                    fh.flush()
                    faulthandler.dump_traceback(fh, all_threads=True)
                atomic_write_text(self._note_path(self.rank), json.dumps(asdict(note)) + "\n")
            except OSError as exc:  # a full disk must not stop the process from ending
                log.error("[rank %d] hang notes not written: %s", self.rank, exc)
            notes = self._gather(health.gather_s(bound), notes)
        who, why = health.suspects(notes, self.world)
        states = {r: forensics.from_note(n.groups) for r, n in notes.items() if n.groups}
        fr_who, fr_why, found = forensics.verdict(states, self.world) if states else ([], "", [])
        if fr_who:  # the collective-level record names the rank(s) the others wait for, with the op
            who, why = fr_who, fr_why
        if self.rank == min(notes):
            self._event(notes, who, why, step=step, idle=idle, bound=bound, stalls=found)
        suspect_noted = any(r in notes for r in who)
        kind = "crash" if self.rank in who or not suspect_noted else "peer_lost"
        self.on_hang(HangVerdict(self.rank, step, kind, f"hang: no step progress for {idle:.1f} s (bound "
                                 f"{bound:.1f} s) after step {step}; suspect rank(s) {who or 'none'}: {why}",
                                 self._last_wall))

    def _gather(self, wait_s: float, notes: dict[int, health.RankNote]) -> dict[int, health.RankNote]:
        deadline = time.monotonic() + wait_s
        while True:
            for r in range(self.world):
                if r not in notes:
                    try:
                        notes[r] = health.RankNote(**json.loads(self._note_path(r).read_text()))
                    except (OSError, ValueError, TypeError):
                        pass
            if len(notes) == self.world or time.monotonic() > deadline:
                return notes
            time.sleep(0.1)

    def _event(self, notes: dict[int, health.RankNote], who: list[int], why: str, *, step: int,
               idle: float, bound: float, stalls: list[forensics.Stall]) -> None:
        times = list(self.times)
        med = statistics.median(times) if times else None
        Ledger(self.run.path).append(events.Hang(
            step=step, idle_s=round(idle, 3), bound_s=round(bound, 3),
            median_step_s=round(med, 4) if med is not None else None, suspects=who,
            suspect_hosts=sorted({notes[r].host for r in who if r in notes}), why=why,
            collectives={str(r): {"name": n.collective, "seq": n.seq, "inside": n.inside, "step": n.step,
                                  "host": n.host, "c10d": _c10d(n.groups)} for r, n in sorted(notes.items())},
            stacks_dir=str(self.dir) if self.dir is not None else None,
            flight=[s.as_dict() for s in stalls],
            flight_dir=str(self.dir / forensics.SUBDIR) if self.dir is not None and any(
                n.groups for n in notes.values()) else None))


def _c10d(groups: dict[str, Any]) -> list[dict[str, Any]]:
    """A rank's last c10d collective in each group, for the hang event: group, #, op, inside."""
    return [{"group": g.group, "desc": g.desc, "seq": g.entered, "op": g.op, "inside": g.inside,
             **({"p2p_inside": g.p2p_inside} if g.p2p_inside else {})}
            for g in forensics.from_note(groups).values() if g.entered or g.p2p_inside]


class _NoWatchdog:
    """The watchdog's interface doing nothing (health.watchdog: false, or a trainer built in a test)."""

    _null = contextlib.nullcontext()

    def collective(self, name: str) -> contextlib.nullcontext[None]:
        return self._null

    def beat(self, step: int) -> None:
        pass

    def expect_long(self) -> None:
        pass

    def paused(self) -> contextlib.nullcontext[None]:
        return self._null

    def start(self) -> _NoWatchdog:
        return self

    def close(self) -> None:
        pass


NO_WATCHDOG = _NoWatchdog()
Watch = Watchdog | _NoWatchdog
"""what the trainer holds: the watchdog, or NO_WATCHDOG"""
