"""Where a restore's pulled files land while its load reads them (in-job; imports torch): how far
each has come, the shards held in memory until the load has read them, and the reader that waits
for its bytes (dslurm.checkpoint.partner.Pull runs the transfer; docs/checkpoint.md, "Partner
copies").

A streamed pull keeps the pulled rank's shards in the messages they arrived in: the load copies
them straight into the tensors, and they are written to the local tier only after the restore
(`spill`, from partner.Pulled.keep). Written first and read back, a 67 MB pull spent most of its
time in the receiver's writes on a disk other jobs were writing to (docs/checkpoint.md, "Partner
benchmark"). The small files (.metadata, meta.json, ranks/) are written as they come: the load,
the fingerprint and the manager read them by path.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from dslurm.checkpoint.compat import reader_fast
from dslurm.checkpoint.io import CrcReader, SizedRaw


class Landed:
    """How far each file of a pull has landed (written and flushed, or held: `held`) in the receiver:
    the load reads a byte range only once it is there; `close` (the transfer over, or broken) wakes
    every waiter, and a range that never came is an OSError for the load."""

    def __init__(self, sizes: dict[str, int], held: set[str] | None = None) -> None:
        self.sizes, self._at = sizes, dict.fromkeys(sizes, 0)
        self._held: dict[str, list[tuple[int, memoryview]]] = {n: [] for n in held or ()}
        self._cond, self._closed = threading.Condition(), False

    def holds(self, name: str) -> bool:
        return name in self._held

    def put(self, name: str, off: int, data: memoryview) -> None:
        """A piece of a held file, in order (the view keeps its message alive)."""
        with self._cond:
            self._held[name].append((off, data))
            self._at[name] += len(data)
            self._cond.notify_all()

    def held_size(self, name: str) -> int:
        return sum(len(d) for _, d in self._held.get(name, []))

    def advance(self, name: str, n: int) -> None:
        with self._cond:
            self._at[name] += n
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def wait(self, name: str, end: int | None = None) -> None:
        """Until [0, end) of `name` (all of it by default) has landed. A file this pull does not
        bring (the rank's node holds it, or a node peer pulled it and the walk waited for every
        pull first: LocalRestore._streams) is there already."""
        if name not in self.sizes:
            return
        end = self.sizes[name] if end is None else end
        with self._cond:
            while self._at.get(name, 0) < end:
                if self._closed:
                    raise OSError(f"{name}: the pull ended at {self._at.get(name, 0)} of {end} bytes")
                self._cond.wait()

    def read_into(self, name: str, pos: int, out: memoryview) -> int:
        """Copy held bytes [pos, pos + len(out)) of `name` into `out` (they have landed)."""
        done = 0
        for off, data in self._held[name]:
            if done == len(out):
                break
            lo, hi = max(pos + done, off), min(pos + len(out), off + len(data))
            if lo < hi:
                out[lo - pos:hi - pos] = data[lo - off:hi - off]
                done = hi - pos
        return done

    def spill(self, root: Path) -> None:
        """Write the held files under `root` (their pulled copy, the local tier) and let them go."""
        for name, pieces in list(self._held.items()):
            with open(root / name, "wb") as f:
                for _, data in pieces:
                    f.write(data)
            del self._held[name]


class HeldFile(SizedRaw):
    """A held file, read as a file (seek, readinto) by the reader; each read waits for its bytes."""

    def __init__(self, landed: Landed, name: str, path: str) -> None:
        super().__init__()
        self.landed, self.key, self.name, self.pos = landed, name, path, 0

    def size(self) -> int:
        return self.landed.sizes[self.key]

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = max(0, min(len(view), self.landed.sizes[self.key] - self.pos))
        self.landed.wait(self.key, self.pos + n)
        got = self.landed.read_into(self.key, self.pos, view[:n])
        self.pos += got
        return got


class StreamedReader(CrcReader):
    """A pulled rank's reader: its files are still arriving (partner.Pull, on a thread of its own);
    each read waits until its bytes have landed, held shards are read from memory, the rest from
    the page cache, none summed again (the pull computed each file's crc32 from the received bytes;
    Pull.join says)."""

    def __init__(self, path: Path, landed: Landed) -> None:
        super().__init__(path, summing=False)
        self.landed = landed

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        self.landed.wait(".metadata" if kwargs.get("rank") is None else f"__{kwargs['rank']}.metadata")
        return super().read_metadata(*args, **kwargs)

    def before_read(self, name: str, end: int) -> None:
        self.landed.wait(name, end)

    def open_file(self, name: str) -> Any:
        if self.landed.holds(name):
            return HeldFile(self.landed, name, str(self.fs.concat_path(self.path, name)))
        return super().open_file(name)

    def read_data(self, plan: Any, planner: Any) -> Any:
        if not reader_fast(self):  # DCP's own read (another torch): every file whole, on disk, first
            for name in self.landed.sizes:
                self.landed.wait(name)
            self.landed.spill(Path(self.path))
        return super().read_data(plan, planner)
