"""DCP file I/O for the checkpoint protocol: crc32 computed while DCP writes and while it reads,
the host stager, and the bounded restore test. Imported by dslurm.checkpoint.dcp (in-job code; imports torch).

Why checksum while writing: re-reading every shard after `dcp.save` cost as much as a third of
a sync save (docs/checkpoint.md, bench). That re-read came from the page cache the write had
just filled, so it checked the same bytes in memory that a checksum of the write stream sees;
it never proved what the medium holds either. What the manifest records is therefore the crc32
and byte count of exactly what was handed to the file, and the file is fsync'd before the
manifest exists. A torn or short file (a write that did not land whole) is caught at commit by
the size check against the manifest (`verify_generation(full=False)`); altered bytes on the
medium (bit rot, a lost write) are caught at restore, where the crc32 is computed over the bytes
DCP reads anyway (`CrcReader`, `dslurm.checkpoint.coverage`), and by `dslurm ckpt verify`.
"""

from __future__ import annotations

import dataclasses
import io
import os
import threading
import time
import zlib
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

from dslurm.checkpoint.coverage import RangeSums


class _CrcStream(io.RawIOBase):
    """Write-through wrapper: running crc32 and byte count of everything written. `tell()` is
    the count, which equals the file offset because DCP opens each file fresh with "wb" and
    only appends (it uses tell() to record where each tensor starts)."""

    def __init__(self, raw: io.BufferedWriter) -> None:
        super().__init__()
        self.raw, self.crc, self.size = raw, 0, 0

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = self.raw.write(view)
        if n != len(view):  # BufferedWriter writes all or raises; anything else is a torn write
            raise OSError(f"short write to {self.raw.name}: {n} of {len(view)} bytes")
        self.crc = zlib.crc32(view, self.crc)  # zlib releases the GIL on large buffers
        self.size += n
        return n

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        if not self.raw.closed:  # DCP closes the stream itself before create_stream's exit
            self.raw.flush()

    def fileno(self) -> int:  # DCP fsyncs through this (sync_files=True); without it: os.sync()
        return self.raw.fileno()

    def close(self) -> None:
        super().close()  # IOBase.close flushes first
        self.raw.close()


class CrcFileSystem(FileSystem):
    """DCP's local FileSystem whose write streams checksum as they go; `sums` maps each file
    name written in full to {"size", "crc32"}, the manifest's entry format."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()  # io_threads > 1: one thread per file, one shared dict

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        stream = _CrcStream(path.open("wb"))
        try:
            yield stream
        finally:
            stream.close()
        # Recorded only after the body finished without raising: a file whose write failed
        # part-way has no entry, so it can never be described as complete.
        with self._lock:
            self.sums[path.name] = {"size": stream.size, "crc32": f"{stream.crc:08x}"}

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        super().rename(path, new_path)  # .metadata.tmp -> .metadata: the entry follows the name
        with self._lock:
            if (entry := self.sums.pop(Path(path).name, None)) is not None:
                self.sums[Path(new_path).name] = entry


def crc_writer(gen: Path, io_threads: int) -> tuple[dcp.FileSystemWriter, dict[str, dict[str, Any]]]:
    """A FileSystemWriter (fsync'd files) that checksums while writing, and its sums."""
    writer = dcp.FileSystemWriter(gen, sync_files=True, thread_count=io_threads)
    fs = CrcFileSystem()
    writer.fs = fs  # write_data/finish go through self.fs (torch 2.13 filesystem.py)
    return writer, fs.sums


_BIG = 1 << 20  # items at least this large are read straight into the tensor, not via bytes
_PIECE = 4 << 20  # read size of a large item's pieces, each summed while the next is read
_POOL: list[ThreadPoolExecutor] = []


def _crc_pool() -> ThreadPoolExecutor:
    if not _POOL:  # one helper thread per process, made on first use (restore only)
        _POOL.append(ThreadPoolExecutor(1, thread_name_prefix="dslurm-crc32"))
    return _POOL[0]


class Pace:
    """Caps a reader at `mbps` MB/s (0: no cap). Only the fault knob DSLURM_FAULT_DURABLE_MBPS sets
    it (dslurm/faults.py): a loaded shared file system, for restores from the durable tier."""

    def __init__(self, mbps: float = 0.0) -> None:
        self.mbps, self.done, self.t0 = mbps, 0, time.monotonic()

    def took(self, n: int) -> None:
        if self.mbps > 0:
            self.done += n
            ahead = self.done / (self.mbps * 1e6) - (time.monotonic() - self.t0)
            if ahead > 0:
                time.sleep(ahead)


class _CrcView(io.RawIOBase):
    """One stored item [start, end) of a shard as a read-only file for torch.load. Its large
    reads (the tensor's data record) go straight into torch's buffer, the new storage, and are
    checksummed there: no copy, no buffer of our own. The small parts in between (zip records,
    which torch reads out of order and partly twice) are read once more, in file order, to keep
    the running crc32 going; a few kB per item. Any other read pattern makes `finish` read the
    whole item again: slower, never unchecked."""

    def __init__(self, f: Any, name: str, start: int, length: int, sums: RangeSums, pace: Pace) -> None:
        super().__init__()
        self.f, self.name, self.start, self.end, self.sums = f, name, start, start + length, sums
        self.pace = pace
        self.pos = 0
        self.done, self.crc = start, sums.prior(name, start)  # summed in order up to `done`
        self.redo = False

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.end - self.start}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = max(0, min(len(view), self.end - self.start - self.pos))
        a = self.start + self.pos
        if n >= _BIG and a >= self.done:
            self._sum_upto(a)
            self.crc, self.done = self._read_summing(view[:n], a), a + n
        else:
            self.redo |= n >= _BIG and a + n > self.done  # across bytes already summed: redo at the end
            self._read(view[:n], a)
        self.pos += n
        return n

    def _read(self, view: memoryview, at: int) -> None:
        self.f.seek(at)
        got = self.f.readinto(view) if len(view) else 0
        self.pace.took(got)
        if got != len(view):
            raise OSError(f"{self.f.name}: {got} bytes at {at}, expected {len(view)} (truncated?)")

    def _read_summing(self, view: memoryview, at: int) -> int:
        """Read into view in pieces, each piece's crc32 computed on a helper thread while the
        next piece is read (zlib releases the GIL): the sum rides on the I/O instead of after it.
        Every piece is summed before returning: the buffer is torch's, not ours to keep."""
        crc, fut, pos = self.crc, None, 0
        try:
            while pos < len(view):
                piece = view[pos:pos + _PIECE]
                self._read(piece, at + pos)
                if fut is not None:
                    crc = fut.result()
                fut = _crc_pool().submit(zlib.crc32, piece, crc)
                pos += len(piece)
        finally:
            if fut is not None:
                crc = fut.result()
        return crc

    def _sum_upto(self, upto: int) -> None:
        self.f.seek(self.done)
        while self.done < upto:
            data = self.f.read(min(8 << 20, upto - self.done))
            self.pace.took(len(data))
            if not data:
                raise OSError(f"{self.f.name}: ends at {self.done}, expected {upto} (truncated?)")
            self.crc, self.done = zlib.crc32(data, self.crc), self.done + len(data)

    def finish(self) -> None:
        """After DCP is done with the item (the file still open): sum the rest, record it."""
        if self.redo:
            self.done, self.crc = self.start, self.sums.prior(self.name, self.start)
        self._sum_upto(self.end)
        self.sums.record(self.name, self.start, self.end, self.crc)


class _FinishingFS(FileSystem):
    """DCP's local FileSystem whose read streams, before closing, let the reader finish the
    last item read from them (its crc32 needs the bytes after torch's last read)."""

    def __init__(self, reader: CrcReader) -> None:
        super().__init__()
        self.reader = reader

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Generator[io.IOBase, None, None]:
        with super().create_stream(path, mode) as stream:
            yield stream
            self.reader.finish_pending()  # not reached when the body raised: a gap, read later


class CrcReader(dcp.FileSystemReader):
    """A FileSystemReader that checksums what it reads, into `sums` (per file, runs of
    contiguous items; dslurm.checkpoint.coverage). Items are read in file order, so a rank that
    reads a whole file ends with one run whose crc32 is the file's. Small items are read whole
    into memory (one read, summed, served from there); large ones through _CrcView, straight
    into the tensor. Which files and items get read stays DCP's decision (its load plan); the
    manager rebuilds whole-file crc32s from every rank's runs and reads only what nobody read.

    Hooks torch 2.13's `FileSystemReader._slice_file` and `.fs` (filesystem.py). Were a torch
    version to stop calling them, nothing would be recorded, every shard would be a gap, and the
    manager would read it once more: slower, never unchecked (tests/integration/
    test_checkpoint_local.py `test_restore_reads_each_shard_file_once` would fail)."""

    def __init__(self, path: str | os.PathLike[str], mbps: float = 0.0) -> None:
        super().__init__(path)
        self.sums = RangeSums()
        self.pace = Pace(mbps)
        self.fs = _FinishingFS(self)
        self._pending: _CrcView | None = None

    def read_data(self, plan: Any, planner: Any) -> Any:
        # DCP groups a plan's items by file, in plan order; sorting by offset makes each file's
        # reads sequential (its own "TODO sort by offset") and lets the crc32 run on.
        where = self.storage_data
        items = sorted(plan.items, key=lambda it: (where[it.storage_index].relative_path,
                                                   where[it.storage_index].offset))
        return super().read_data(dataclasses.replace(plan, items=items), planner)

    def finish_pending(self) -> None:
        view, self._pending = self._pending, None
        if view is not None:
            view.finish()

    def _slice_file(self, file: Any, sinfo: Any) -> Any:
        self.finish_pending()  # the previous item of this file: torch is done with it
        name, start, length = sinfo.relative_path, sinfo.offset, sinfo.length
        if self.sums.covered(name, start, start + length) or length < _BIG:
            file.seek(start)
            data = file.read(length)
            self.pace.took(len(data))
            if len(data) != length:
                raise OSError(f"{file.name}: {len(data)} bytes at {start}, expected {length} (truncated?)")
            self.sums.add(name, start, data)
            return io.BytesIO(data)
        self._pending = _CrcView(file, name, start, length, self.sums, self.pace)
        return self._pending


def restore_test(gen: Path, files: dict[str, Any], reason: Any) -> list[str]:
    """Read .metadata back, check that every storage record lies inside a file the manifest lists,
    and load the smallest tensor through DCP's own read path into scratch. Bounded cost: it does
    not re-read the shards (restore checks them as it loads; `dslurm ckpt verify` reads them)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    try:
        md = dcp.FileSystemReader(gen).read_metadata()
        for index, info in (md.storage_data or {}).items():
            have = files.get(info.relative_path)
            if have is None or info.offset + info.length > have["size"]:
                return [f"{gen / info.relative_path}: holds {index.fqn} at {info.offset}+{info.length}, "
                        f"but the file is {'absent' if have is None else have['size']} bytes"]
        tensors = [(k, v) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]
        if tensors:
            key, tmd = min(tensors, key=lambda kv: kv[1].size.numel())
            scratch = {key: torch.empty(tmd.size, dtype=tmd.properties.dtype)}
            dcp.load(scratch, storage_reader=dcp.FileSystemReader(gen), no_dist=True)
    except Exception as exc:
        return [f"{gen}: restore test failed: {reason(exc)}"]
    return []


def raw_write(path: Path, size: int) -> float:
    """Seconds to write `size` incompressible bytes to `path` in 8 MiB chunks and fsync them: the
    baseline a save's throughput is compared with (bench/bench_checkpoint.py, dslurm selftest).
    The file is removed afterwards."""
    chunk = torch.randn(8 << 18).numpy().tobytes()  # 8 MiB of incompressible bytes
    t = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        left = size
        while left > 0:
            left -= f.write(chunk[: min(len(chunk), left)])
        os.fsync(f.fileno())
    dt = time.perf_counter() - t
    path.unlink()
    return dt
