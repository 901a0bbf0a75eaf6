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

Both sums ride on the I/O: a large write or read is summed on a helper thread while the kernel
copies it (zlib releases the GIL), and a restore reads each stored tensor's bytes straight into
the tensor being restored (`CrcReader`), so a save and a restore cost about what the disk costs
(docs/checkpoint.md, "Benchmark").
"""

from __future__ import annotations

import ctypes
import io
import os
import pickle
import threading
import time
import zlib
from collections.abc import Generator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, cast

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import LoadItemType

from dslurm.checkpoint.compat import narrow_tensor_by_index, reader_fast, writer_streams
from dslurm.checkpoint.coverage import RangeSums
from dslurm.checkpoint.unpickle import load_file, refused_by_torch

_BIG = 1 << 20  # writes and items at least this large are summed on a helper thread (items: read
#                 straight into the tensor, not via bytes)
_PIECE = 8 << 20  # read size of a large item's pieces, each summed while the next is read
_POOL: list[ThreadPoolExecutor] = []


def _crc_pool() -> ThreadPoolExecutor:
    if not _POOL:  # helper threads for crc32, made on first use (saves and restores)
        _POOL.append(ThreadPoolExecutor(2, thread_name_prefix="dslurm-crc32"))
    return _POOL[0]


def _libc_sync_file_range() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):  # not Linux/glibc: no write-ahead, the fsync does it all
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2  # linux/fs.h: start writeback of the range's dirty pages, do not wait


def write_ahead(fd: int, offset: int, length: int) -> None:
    """Start the disk's writeback of [offset, offset + length) of fd now, without waiting for it
    (Linux sync_file_range(SYNC_FILE_RANGE_WRITE); ctypes releases the GIL). Only a head start
    for the fsync that follows, never a substitute: a failure or a system without it changes
    nothing but the speed."""
    if _SYNC_FILE_RANGE is not None and length > 0:
        _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


@contextmanager
def _no_zip_crc32() -> Generator[None, None, None]:
    """torch.save computes a crc32 of every zip record it writes, a second pass over the same bytes
    (torch.save of a 67 MB tensor here: 0.044 s with it, 0.030 s without). The manifest's crc32
    already covers every byte of the file and torch.load never checks the zip's, so dslurm's write
    streams turn it off while they are open.
    torch keeps the setting per thread (torch 2.13 `_config_module`: ContextVar), and DCP opens
    each stream on the thread that writes it, so nothing else in the process is affected."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(before)


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
        # A tensor's bytes (one large write) are summed on a helper thread while the kernel copies
        # them into the file: zlib and the write both release the GIL, so the sum costs no time
        # on the save's path. The buffer is the caller's: the sum is done before returning.
        summing = _crc_pool().submit(zlib.crc32, view, self.crc) if len(view) >= _BIG else None
        try:
            n = self._write_ahead(view) if summing is not None else self.raw.write(view)
        finally:
            crc = summing.result() if summing is not None else zlib.crc32(view, self.crc)
        if n != len(view):  # BufferedWriter writes all or raises; anything else is a torn write
            raise OSError(f"short write to {self.raw.name}: {n} of {len(view)} bytes")
        self.crc = crc
        self.size += n
        return n

    def _write_ahead(self, view: memoryview) -> int:
        """A large write in pieces, the disk's writeback of each piece started (write_ahead) as
        soon as it is in the page cache, while the next piece is copied: the fsync at the end
        then waits only for the last pieces, where one large write leaves the whole file dirty
        for it (a save: the page-cache copy and the disk's write overlap instead of following
        each other; docs/checkpoint.md, "Benchmark"). Durability is still the fsync's."""
        self.raw.flush()  # the small records before it: on the file, so the offsets below are its
        done = 0
        while done < len(view):
            piece = view[done:done + _PIECE]
            n = self.raw.write(piece)
            if n != len(piece):
                return done + n
            write_ahead(self.raw.fileno(), self.size + done, n)
            done += n
        return done

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
            with _no_zip_crc32():
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
    """A FileSystemWriter (fsync'd files) that checksums while writing, and its sums. On a torch
    whose writer has no replaceable `fs` (dslurm.checkpoint.compat), a plain writer and no sums:
    the manager then checksums the files it wrote by reading them back."""
    writer = dcp.FileSystemWriter(gen, sync_files=True, thread_count=io_threads)
    if not writer_streams(writer):
        return writer, {}
    fs = CrcFileSystem()
    writer.fs = fs  # write_data/finish go through self.fs (torch 2.13-2.14 filesystem.py)
    return writer, fs.sums


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


class SizedRaw(io.RawIOBase):
    """A read-only raw file of `size()` bytes with a position: what torch.load needs of a file
    besides `readinto` (each subclass's own: a shard's item checksummed as it is read, a pulled
    file held in memory, dslurm.checkpoint.landing.HeldFile)."""

    pos = 0

    def size(self) -> int:
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self.pos, 2: self.size()}[whence]
        self.pos = max(0, base + offset)
        return self.pos


class _CrcView(SizedRaw):
    """One stored item [start, end) of a shard as a read-only file for torch.load. Its large
    reads (the tensor's data record) go straight into torch's buffer, the new storage, and are
    checksummed there: no copy, no buffer of our own. The small parts in between (zip records,
    which torch reads out of order and partly twice) are read once more, in file order, to keep
    the running crc32 going; a few kB per item. Any other read pattern makes `finish` read the
    whole item again: slower, never unchecked."""

    def __init__(self, f: Any, name: str, start: int, length: int, sums: RangeSums, pace: Pace,
                 summing: bool = True) -> None:
        super().__init__()
        self.f, self.name, self.start, self.end, self.sums = f, name, start, start + length, sums
        self.pace, self.summing = pace, summing
        self.pos = 0
        self.done, self.crc = start, sums.prior(name, start)  # summed in order up to `done`
        self.redo = False

    def size(self) -> int:
        return self.end - self.start

    def readinto(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = max(0, min(len(view), self.end - self.start - self.pos))
        a = self.start + self.pos
        if not self.summing:
            self._read(view[:n], a)
        elif n >= _BIG and a >= self.done:
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
        if not self.summing:
            return
        if self.redo:
            self.done, self.crc = self.start, self.sums.prior(self.name, self.start)
        self._sum_upto(self.end)
        self.sums.record(self.name, self.start, self.end, self.crc)


class SafeReader(dcp.FileSystemReader):
    """DCP's FileSystemReader whose `.metadata` goes through dslurm.checkpoint.unpickle (only the
    classes DCP's metadata holds; anything else is refused before it is called). DCP's own
    `read_metadata` is a bare `pickle.load` (torch 2.13 filesystem.py); its tensor items are
    read with `torch.load(weights_only=True)` already."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        rank = kwargs.get("rank")
        md = load_file(Path(self.path) / (".metadata" if rank is None else f"__{rank}.metadata"))
        if getattr(md, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that a saved non-tensor value (a BYTE_IO item: a
    scheduler's state, a step counter) is read by `torch.load(weights_only=True)`, not by DCP's
    `weights_only=False` (torch 2.13 default_planner.py `load_bytes`): a class outside torch's
    safe set is refused unrun (dslurm.checkpoint.unpickle)."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise refused_by_torch(exc, f"the checkpoint's saved value {fqn!r}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


class CrcReader(SafeReader):
    """A FileSystemReader that checksums what it reads, into `sums` (per file, runs of
    contiguous items; dslurm.checkpoint.coverage), and reads each stored tensor's bytes straight
    into the tensor being restored. Items are read in file order, so a rank that reads a whole
    file ends with one run whose crc32 is the file's. Small items are read whole into memory
    (one read, summed, served from there); large ones through _CrcView. Which files and items
    get read stays DCP's decision (its load plan); the manager rebuilds whole-file crc32s from
    every rank's runs and reads only what nobody read.

    Why its own `read_data`: DCP's (torch 2.13 filesystem.py) unpickles every item into a new
    storage and copies that into the model, so each restored byte was faulted into fresh memory,
    then copied: CPU-bound at a fraction of the disk's speed (docs/checkpoint.md). Here a large
    item's zip records are parsed first (`torch.load(map_location="meta")`: shape, dtype and the
    data's offset, no data) and, when the request takes the whole stored tensor into a contiguous
    CPU tensor of the same dtype, its bytes are read into that tensor's memory and summed there;
    anything else (another layout's slice, a GPU or other-dtype destination, a torch version
    without the offset) goes the way DCP goes, through the same checksummed view. Were a torch
    version to stop calling `read_data`, nothing would be recorded, every shard would be a gap,
    and the manager would read it once more: slower, never unchecked
    (tests/integration/test_checkpoint_local.py `test_restore_reads_each_shard_file_once`)."""

    def __init__(self, path: str | os.PathLike[str], mbps: float = 0.0, summing: bool = True) -> None:
        super().__init__(path)
        self.sums = RangeSums()
        self.pace = Pace(mbps)
        self.summing = summing  # False: files whose crc32 was just computed (a partner pull): read only

    def read_data(self, plan: Any, planner: Any) -> torch.futures.Future[None]:
        if not reader_fast(self):  # a torch whose reader differs (compat): DCP's own read, nothing summed
            return super().read_data(plan, planner)
        # Sorted by file, then offset: each file's reads are sequential (DCP's own "TODO sort by
        # offset") and its crc32 runs on from one item to the next.
        where = self.storage_data
        per_file: dict[str, list[Any]] = {}
        for req in sorted(plan.items, key=lambda it: (where[it.storage_index].relative_path,
                                                      where[it.storage_index].offset)):
            per_file.setdefault(where[req.storage_index].relative_path, []).append(req)
        for name, reqs in per_file.items():
            with self.open_file(name) as f:
                for req in reqs:
                    _prefetch_records(f, where[req.storage_index].offset, where[req.storage_index].length)
                for req in reqs:
                    self._read_item(f, req, planner)
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    def open_file(self, name: str) -> Any:
        """The file `name` of the generation, for reading (a pull held in memory:
        dslurm.checkpoint.landing.StreamedReader)."""
        return open(self.fs.concat_path(self.path, name), "rb")  # noqa: SIM115 - the caller's `with`

    def before_read(self, name: str, end: int) -> None:
        """Called before an item's bytes [.., end) of file `name` are read: a file still arriving
        (dslurm.checkpoint.partner.StreamedReader) waits here. Nothing by default."""

    def _read_item(self, f: Any, req: Any, planner: Any) -> None:
        """One request: checksummed; finished (the rest of its bytes summed) only when it was
        read without error, else its bytes stay a gap that the manager reads again."""
        sinfo = self.storage_data[req.storage_index]
        name, start, length = sinfo.relative_path, sinfo.offset, sinfo.length
        self.before_read(name, start + length)
        if self.sums.covered(name, start, start + length) or length < _BIG:
            self._serve(self._small(f, name, start, length), req, planner, sinfo)
            return
        view = _CrcView(f, name, start, length, self.sums, self.pace, self.summing)
        plain = not sinfo.transform_descriptors and req.type != LoadItemType.BYTE_IO
        if not (plain and _read_direct(view, req, planner)):
            view.seek(0)
            self._serve(view, req, planner, sinfo)
        view.finish()

    def _small(self, f: Any, name: str, start: int, length: int) -> io.BytesIO:
        f.seek(start)
        data = f.read(length)
        self.pace.took(len(data))
        if len(data) != length:
            raise OSError(f"{f.name}: {len(data)} bytes at {start}, expected {length} (truncated?)")
        if self.summing:
            self.sums.add(name, start, data)
        return io.BytesIO(data)

    def _serve(self, stream: Any, req: Any, planner: Any, sinfo: Any) -> None:
        """DCP's own handling of one item (FileSystemReader.read_data, torch 2.13)."""
        stream = self.transforms.transform_load_stream(req, sinfo.transform_descriptors or (), stream)
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(stream.read(-1)))
            return
        if not stream.seekable():
            stream = io.BytesIO(stream.read(-1))
        tensor = narrow_tensor_by_index(torch.load(stream, map_location="cpu", weights_only=True),
                                        req.storage_offsets, req.lengths)
        target = planner.resolve_tensor(req).detach()
        if target.size() != tensor.size():
            raise AssertionError(f"req {req.storage_index} mismatch sizes {target.size()} vs {tensor.size()}")
        target.copy_(tensor)
        planner.commit_tensor(req, target)


def _prefetch_records(f: Any, start: int, length: int) -> None:
    """Ask for a large item's first and last 64 kB (its zip records: torch.load reads the central
    directory at the end first) before anything is read, for every item of a file at once. Read
    cold as they come, each jump to an item's end and back cost a device round trip and a
    readahead window at the far end (~10 ms per item of a 0.08 s cold restore here); asked for
    up front, they arrive while the data streams."""
    edge = 64 << 10
    if length < _BIG:
        return
    try:
        os.posix_fadvise(f.fileno(), start + max(0, length - edge), min(edge, length), os.POSIX_FADV_WILLNEED)
        os.posix_fadvise(f.fileno(), start, min(edge, length), os.POSIX_FADV_WILLNEED)
    except (AttributeError, OSError):  # no fadvise here: the reads go as they come
        pass


def _read_direct(view: _CrcView, req: Any, planner: Any) -> bool:
    """Read a stored tensor's data record straight into its destination (summed on the way).
    False, having read only zip records, when the request is not the whole stored tensor in
    storage order or torch does not say where the data lies."""
    try:
        stored = torch.load(cast(IO[bytes], view), map_location="meta", weights_only=True)
        offset = getattr(stored.untyped_storage(), "_checkpoint_offset", None)
    except Exception:  # a torch that cannot, or bytes that do not parse: DCP's way decides
        return False
    wanted = narrow_tensor_by_index(stored, req.storage_offsets, req.lengths)
    target = planner.resolve_tensor(req).detach()
    whole = (wanted.is_contiguous() and wanted.storage_offset() == 0
             and wanted.nbytes == stored.untyped_storage().nbytes())
    if offset is None or not whole or target.size() != wanted.size():
        return False
    dest = target if target.dtype == stored.dtype else None
    into = _writable_bytes(dest) if dest is not None else None
    if into is None:  # a GPU, strided or other-dtype destination: a host tensor in between
        dest = torch.empty(wanted.size(), dtype=stored.dtype)
        into = _writable_bytes(dest)
        assert into is not None  # a new contiguous CPU tensor
    view.seek(int(offset))
    if view.readinto(into) != len(into):
        raise OSError(f"{view.f.name}: item at {view.start} ends before its data ({len(into)} bytes)")
    if dest is not target:
        target.copy_(dest)
    planner.commit_tensor(req, target)
    return True


def _writable_bytes(t: torch.Tensor) -> memoryview | None:
    """The bytes of a contiguous CPU tensor, writable in place; None for anything else."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.is_conj() or t.is_neg() or not t.numel():
        return None
    try:
        return t.reshape(-1).view(torch.uint8).numpy().data
    except (RuntimeError, TypeError, ValueError):  # a dtype numpy cannot view
        return None


def restore_test(gen: Path, files: dict[str, Any], reason: Any) -> list[str]:
    """Read .metadata back, check that every storage record lies inside a file the manifest lists,
    and load the smallest tensor through DCP's own read path into scratch. Bounded cost: it does
    not re-read the shards (restore checks them as it loads; `dslurm ckpt verify` reads them)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    try:
        md = SafeReader(gen).read_metadata()
        for index, info in (md.storage_data or {}).items():
            have = files.get(info.relative_path)
            if have is None or info.offset + info.length > have["size"]:
                return [f"{gen / info.relative_path}: holds {index.fqn} at {info.offset}+{info.length}, "
                        f"but the file is {'absent' if have is None else have['size']} bytes"]
        tensors = [(k, v) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)]
        if tensors:
            key, tmd = min(tensors, key=lambda kv: kv[1].size.numel())
            scratch = {key: torch.empty(tmd.size, dtype=tmd.properties.dtype)}
            dcp.load(scratch, storage_reader=SafeReader(gen), planner=SafeLoadPlanner(), no_dist=True)
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
