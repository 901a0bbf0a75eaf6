"""The run's event ledger: append-only JSON lines in `<run_dir>/ledger.jsonl`.

Every link writes what happened (start, preflight, steps, saves, signals, exits) and
`dslurm report` / `dslurm doctor` read it back. One line per event, written with a
single `write` on an O_APPEND descriptor and fsynced, so lines from several processes
never interleave and a kill -9 loses at most the line being written; a torn last line
is skipped by the reader.

Event names (the field `event`), each with `t` (unix time), `job_id`, `restart`, `host`:
  job_start     nodes, world_size, layout, restart count, node list
  preflight     passed, bad_nodes, report path, duration_s
  train_start   step (resumed from), generation, fell_back, startup_s (process start -> first step)
  steps         first, last, loss, tokens_per_s, mfu, step_time_s, breakdown, duration_s
  stragglers    step, per_rank step times, slow ranks
  save          step, generation, duration_s, stall_s, bytes, mode (sync|async), ok, reason
  signal        signal name, step at which ranks agreed
  exit          reason (completed|requeue|preempted|timeout|failed|no_progress|budget), step, code
  requeue       decision, restart, reason
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any, Iterator

FILENAME = "ledger.jsonl"


def _context() -> dict[str, Any]:
    return {
        "job_id": os.environ.get("SLURM_JOB_ID"),
        "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
        "host": socket.gethostname(),
    }


class Ledger:
    """Appends events for one run directory."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / FILENAME

    def append(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"event": event, "t": round(time.time(), 3), **_context(), **fields}
        line = (json.dumps(record, default=str, separators=(",", ":")) + "\n").encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)  # one write on O_APPEND: atomic w.r.t. other appenders
            os.fsync(fd)
        finally:
            os.close(fd)
        return record


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
                rec = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                continue
            if isinstance(rec, dict) and "event" in rec:
                yield rec
