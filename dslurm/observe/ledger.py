"""The run's event ledger: append-only JSON lines in `<run_dir>/ledger.jsonl`.

Every link writes what happened (start, preflight, steps, saves, signals, exits) and
`dslurm report` / `dslurm doctor` read it back. One line per event, written with a
single `write` on an O_APPEND descriptor and fsynced, so lines from several processes
never interleave and a kill -9 loses at most the line being written; a torn last line
is skipped by the reader. A write a full disk cuts short is taken back (the file cut to
where the line began, unless another writer appended after it): the event is lost, logged,
and no garbled line stays.

The file is strict JSON lines: non-finite floats (a NaN loss) are written as the strings
"NaN", "Infinity", "-Infinity" and read back as floats. Every append starts on a fresh line,
even after a torn one, so a kill -9 never costs the next writer its event.

The events themselves, their fields and who writes them, are typed in
dslurm/observe/events/: producers construct one and call `Ledger.append(event)`;
readers use `events.read(run_dir)`. This module only stores and reads the lines.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from dslurm.observe.events import Event
from dslurm.run import LEDGER

FILENAME = LEDGER  # the run directory's names live in dslurm/run.py
log = logging.getLogger(__name__)
_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def finite_json(obj: Any) -> Any:
    """JSON has no NaN/Infinity: encode them as strings (decoded again by read_events)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return "NaN" if math.isnan(obj) else ("Infinity" if obj > 0 else "-Infinity")
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


def _decode_value(v: Any) -> Any:
    if isinstance(v, str):
        return _NONFINITE.get(v, v)
    return [_decode_value(x) for x in v] if isinstance(v, list) else v


def _decode(obj: dict[str, Any]) -> dict[str, Any]:
    """json object_hook: the strings finite_json wrote back into floats (dicts nest by themselves)."""
    return {k: _decode_value(v) for k, v in obj.items()}


def encode(record: dict[str, Any]) -> bytes:
    """One strict-JSON line. Pure."""
    return (json.dumps(finite_json(record), default=str, separators=(",", ":"), allow_nan=False) + "\n").encode()


def _ends_torn(fd: int, size: int) -> bool:
    """True when the file's last byte is not a newline (a writer was killed mid-line)."""
    return size > 0 and os.pread(fd, 1, size - 1) != b"\n"


def _unwrite(fd: int, size: int, written: int) -> None:
    """Take back the head of a line a full disk cut short (it would stay a garbled line: `dslurm
    selftest chaos` seed 4444 found 3): the file is cut back to its size before the write, but
    only when nothing was appended after it (else the next appender finishes the torn line and
    the readers skip it). A cut that fails leaves it so too."""
    try:
        if os.fstat(fd).st_size == size + written:
            os.ftruncate(fd, size)
    except OSError as exc:
        log.error("ledger: could not take back a torn line: %s", exc)


def _context() -> dict[str, Any]:
    return {
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        "host": socket.gethostname(),
    }


def append_line(path: Path, line: bytes, what: str = "a line") -> bool:
    """Append one line to `path` crash-safely: one write on an O_APPEND descriptor, fsynced; a
    torn last line (a writer killed mid-line) is finished first so this line starts on its own;
    a write a full disk cut short is taken back. False (logged) when it could not be written.
    The ledger's appends and the site's node store (dslurm/observe/nodes.py) use it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as exc:
        log.error("%s: could not record %s: %s", path, what, exc)
        return False
    size = written = 0
    try:
        size = os.fstat(fd).st_size
        if _ends_torn(fd, size):  # finish the torn line so this one starts on a line of its own
            line = b"\n" + line
        written = os.write(fd, line)  # one write on O_APPEND: atomic w.r.t. other appenders
        if written != len(line):
            raise OSError(errno.ENOSPC, f"short write, {written} of {len(line)} bytes (disk full?)")
        os.fsync(fd)
        return True
    except OSError as exc:  # a full disk must not turn into a crash of the writer
        log.error("%s: could not record %s: %s", path, what, exc)
        if 0 < written < len(line):
            _unwrite(fd, size, written)
        return False
    finally:
        os.close(fd)


class Ledger:
    """Appends events for one run directory."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / FILENAME
        self.listeners: list[Callable[[Event], None]] = []
        """called with each event after it was appended (rank 0's experiment trackers,
        dslurm/trackers/: they get the ledger's own numbers); a listener that raises is logged
        and never fails the writer"""

    def append(self, ev: Event) -> Event:
        """Write one event (its envelope filled from this process where the event leaves it
        unset); returns it as written."""
        envelope = {k: v for k, v in (("job_id", ev.job_id), ("restart", ev.restart), ("host", ev.host))
                    if v is not None}
        ev = dataclasses.replace(ev, t=round(time.time(), 3), **{**_context(), **envelope})
        event = ev.NAME
        record = {"event": event, "t": ev.t, "job_id": ev.job_id, "restart": ev.restart, "host": ev.host,
                  **ev.fields()}
        append_line(self.path, encode(record), what=event)
        self._tell(ev)
        return ev

    def _tell(self, ev: Event) -> None:
        for listener in self.listeners:
            try:
                listener(ev)
            except Exception as exc:  # a tracker bug must never cost the run its ledger or its step
                log.error("ledger %s: listener %r failed on %s: %s", self.path, listener, ev.NAME, exc)


def read_events(run_dir: str | Path) -> Iterator[dict[str, Any]]:
    """Events in file order; a torn or garbled line (kill -9 mid-write) is skipped."""
    path = Path(run_dir) / FILENAME
    try:
        fh = open(path, "rb")
    except FileNotFoundError:
        return
    with fh:
        for raw in fh:
            try:
                rec = json.loads(raw, object_hook=_decode)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(rec, dict) and "event" in rec:
                yield rec
