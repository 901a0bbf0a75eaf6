"""Progress of a sharded tokenization, per task: written by the tasks, read by `dslurm data info`.

Task i writes OUT/progress/shard-0000i.json (dslurm.durable, at most every PERIOD_S seconds and
once at the end): tokens and documents so far, the characters read against its pieces' bytes,
when it started and last wrote, and its host. `dslurm data info OUT` before the manifest exists
reads these with the plan and the shards on disk: done / running (share, rate, last update) /
not started, one line per task.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

from dslurm.durable import atomic_write_text

PERIOD_S = 2.0
FOLDER = "progress"


def progress_path(out: Path, shard: dict[str, Any]) -> Path:
    return out / FOLDER / (Path(shard["path"]).stem + ".json")


def piece_bytes(shard: dict[str, Any]) -> int:
    """The bytes a shard's pieces span (a range's own span, else the whole file)."""
    total = 0
    for f in shard["inputs"]:
        rng = f.get("range")
        total += rng[1] - rng[0] if rng and not str(f["path"]).endswith(".parquet") else int(f["size"])
    return total


class Reporter:
    """Counts what a task has done and writes it now and then."""

    def __init__(self, out: Path, task: int, shard: dict[str, Any]) -> None:
        self.path, self.task = progress_path(out, shard), task
        self.bytes = piece_bytes(shard)
        self.tokens = self.documents = self.chars = 0
        self.started = time.time()
        self._last = 0.0

    def add(self, tokens: int, documents: int, chars: int) -> None:
        self.tokens += tokens
        self.documents += documents
        self.chars += chars
        if time.monotonic() - self._last >= PERIOD_S:
            self.write("running")

    def write(self, state: str) -> None:
        self._last = time.monotonic()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps({
            "task": self.task, "state": state, "tokens": self.tokens, "documents": self.documents,
            "chars": self.chars, "bytes": self.bytes, "started": self.started, "updated": time.time(),
            "host": socket.gethostname()}) + "\n")


def read_progress(out: Path, shard: dict[str, Any]) -> dict[str, Any] | None:
    try:
        raw = json.loads(progress_path(out, shard).read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) else None


def format_progress(out: Path, plan: dict[str, Any], done: list[bool], now: float | None = None) -> str:
    """One line per task: done, running (share of its bytes, tokens/s, last update) or not started."""
    now = time.time() if now is None else now
    lines = [f"tokenization {out}: {sum(done)} of {len(done)} shards done (no manifest yet)"]
    for i, (shard, ok) in enumerate(zip(plan["shards"], done)):
        p = read_progress(out, shard)
        if ok:
            tokens = f"{p['tokens']:,} tokens" if p else "done"
            lines.append(f"  task {i:>5}  done     {tokens}")
        elif p is None:
            lines.append(f"  task {i:>5}  not started")
        else:
            share = min(0.99, p["chars"] / p["bytes"]) if p.get("bytes") else 0.0
            rate = p["tokens"] / max(1e-9, p["updated"] - p["started"])
            lines.append(f"  task {i:>5}  {'running' if p['state'] == 'running' else p['state']}  "
                         f"~{share:.0%}  {p['tokens']:,} tokens  {rate:,.0f} tokens/s  on {p['host']}  "
                         f"updated {now - p['updated']:.0f}s ago")
    return "\n".join(lines)
