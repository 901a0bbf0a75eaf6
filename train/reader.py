"""A step's windows off the disk: reads worked out for many batches at once, a background prefetch.

`plan_reads` works out the reads of a group of windows in numpy (no Python per window): each
window's stream start, its shard, and the byte offset of its span in the file (one chunk, or
two chunks adjacent on disk: every window but a rare straddle), and which windows run on into
the next in the same file. `read_planned` then reads a batch's rows: one `os.preadv` per window
straight into its row, whatever shard it is in, the GIL released during each, or one per run
of adjacent windows (a `data.shuffle_block` block: the per-call cost, not the copy, is what a
window read pays beyond a sequential read), or with `data.read: mmap` a slice copied per window
from the file's read-only memory map (no call; docs/data.md measures both ways);
`read_into` reads the rest (filtered datasets, unallocated chunks,
a window across two shards). Every field is read over the same (source, range) as
the tokens: a per-token array stored beside the tokens (a dataset of that name in the same
HDF5 file) comes back with the same [n, seq_len+1] shape, row for row. `read_windows` is
both in one call.

`Prefetcher` is the rank's background reader: a thread that runs a copy of the sampler ahead
of the step and keeps up to `depth` whole batches ready in a bounded queue. It is speculative
and the sampler of the step stays the only truth: the step advances its own sampler, then
takes the queue's head only if the head was read for that stream position and those ids.
Heads for earlier positions (batches the loop skipped) are dropped; any other mismatch (a
restored state) restarts the reader from the step's sampler. So the saved data state is the
step's, as without prefetch: a batch read ahead but not trained on when a job is requeued is
read again after the restore, and none is skipped or trained on twice.
"""

from __future__ import annotations

import atexit
import bisect
import functools
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from dslurm.data.tokenize import DATASET, TokenFile

Alloc = Callable[[str, tuple[int, ...], np.dtype], np.ndarray]


def _empty(name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    return np.empty(shape, dtype=dtype)


class Gatherer(Protocol):
    """A token file as the planned reads use it (dslurm.data.tokenize.TokenFile)."""

    def extents(self, start: np.ndarray, length: int, name: str = ...) -> np.ndarray: ...

    def fileno(self) -> int: ...

    def dtype_of(self, name: str = ...) -> np.dtype: ...


@dataclass(slots=True)
class Planned:
    """The reads of a group of windows, worked out at once (numpy over the whole group): for
    each field, the descriptor and byte offset of each window's span, for one `os.preadv`, or a
    window read through its source's `read_into` (`odd`: a filtered dataset, an unallocated or a
    distant chunk, a window across two shards, an id outside the source). Rows [lo, hi) are
    read by `read_planned`."""

    seq_len: int
    fields: dict[str, np.dtype]
    src: np.ndarray
    """source of each window"""
    start: np.ndarray
    """first element of each window in its source's stream"""
    fd: dict[str, list[int]]
    """field -> each window's file descriptor (-1: `read_into`)"""
    offset: dict[str, list[int]]
    """field -> each window's byte offset in its file"""
    odd: dict[str, list[int]]
    """field -> the windows (ascending) read by `read_into`: a batch without any is one plain loop"""
    direct: dict[str, bool]
    """field -> every file holds it in the field's dtype (else each read goes through a scratch row)"""
    run_end: dict[str, list[int]] | None = None
    """field -> the last window of window k's run: the windows after k whose spans each run on
    into the next in the same file (adjacent samples, e.g. a `data.shuffle_block` block), read
    in one call; None: no window of the plan is adjacent to the next (a call each)"""
    maps: dict[int, np.ndarray] | None = None
    """`data.read: mmap`: descriptor -> its file's bytes (`TokenFile.mapped`), each window's span
    copied from there instead of read by a call; None: `os.preadv`"""
    opened: tuple[int, int] = (-1, -1)
    """(pid, TokenFile.closes) when the descriptors were taken: a plan read in another process or
    after a file was closed (its descriptor number maybe reused) reads every window by `read_into`"""


def _files_of(source: Any) -> tuple[list[Gatherer], np.ndarray] | None:
    """(files, first stream element of each and the end) of a source: a TokenSource's shards, a
    TokenFile itself; None for a source `gather` cannot read (read_into only)."""
    files = getattr(source, "files", None)
    if files is not None and all(hasattr(f, "extents") for f in files):
        return list(files), np.asarray(source.starts, dtype=np.int64)
    if hasattr(source, "extents"):
        return [source], np.array([0, int(source.n_tokens)], dtype=np.int64)
    return None


def plan_reads(sources: list[Any], src: np.ndarray, sample: np.ndarray, seq_len: int,
               fields: Mapping[str, np.dtype], mapped: bool = False) -> Planned:
    """The reads of windows (source src[k], sample id sample[k]); see `Planned`. `mapped`: from
    the files' memory maps (`data.read: mmap`)."""
    src, sample = np.asarray(src, dtype=np.int64), np.asarray(sample, dtype=np.int64)
    n, width = len(sample), seq_len + 1
    start = sample * seq_len
    fd = {name: np.full(n, -1, dtype=np.int64) for name in fields}
    offset = {name: np.full(n, -1, dtype=np.int64) for name in fields}
    direct = {name: True for name in fields}
    maps: dict[int, np.ndarray] | None = {} if mapped else None
    for s in np.unique(src).tolist():
        parts = _files_of(sources[s])
        if parts is None:
            continue
        shards, bounds = parts
        rows = np.flatnonzero(src == s) if len(sources) > 1 else np.arange(n)
        t = start[rows]
        f = np.searchsorted(bounds, t, side="right") - 1
        ok = (f >= 0) & (f < len(shards))
        ok[ok] &= t[ok] + width <= bounds[f[ok] + 1]  # within one shard (else: read_into)
        for fi in np.unique(f[ok]).tolist():
            mine = ok & (f == fi)
            at, local, shard = rows[mine], t[mine] - bounds[fi], shards[fi]
            size = len(maps.setdefault(shard.fileno(), shard.mapped())) if maps is not None else -1
            for name, dt in fields.items():
                o = shard.extents(local, width, name)
                good = o >= 0
                fd[name][at[good]], offset[name][at[good]] = shard.fileno(), o[good]
                direct[name] &= bool(shard.dtype_of(name) == dt)
                if maps is not None:  # a span past the map's end (a file cut short): read_into says so
                    past = at[good][o[good] + width * shard.dtype_of(name).itemsize > size]
                    fd[name][past] = -1
    run_end: dict[str, list[int]] = {}
    for name, dt in fields.items():  # k runs on into k+1: the same file, k+1's span seq_len elements on
        f, o = fd[name], offset[name]
        link = (f[:-1] >= 0) & (f[:-1] == f[1:]) & (o[1:] - o[:-1] == seq_len * np.dtype(dt).itemsize)
        if link.any():
            ends = np.flatnonzero(~np.append(link, False))  # windows that do not run on: each run's last
            run_end[name] = ends[np.searchsorted(ends, np.arange(n))].tolist()
    return Planned(seq_len, {k: np.dtype(v) for k, v in fields.items()}, src, start,
                   {k: v.tolist() for k, v in fd.items()}, {k: v.tolist() for k, v in offset.items()},
                   {k: np.flatnonzero(v < 0).tolist() for k, v in fd.items()}, direct, run_end or None,
                   maps, (os.getpid(), TokenFile.closes))


def read_planned(plan: Planned, sources: list[Any], lo: int, hi: int, alloc: Alloc | None = None,
                 pool: ReadPool | None = None) -> dict[str, np.ndarray]:
    """{field: [hi-lo, seq_len+1]} of rows [lo, hi) of a plan: one `os.preadv` per window straight
    into its row (through a scratch row when a file's dtype is not the field's), `read_into` for
    the plan's odd windows. With a `pool`, the direct reads of many rows are shared among its
    threads (contiguous slices of rows, each its own loop of calls)."""
    n, width = hi - lo, plan.seq_len + 1
    out: dict[str, np.ndarray] = {}
    stale = plan.opened != (os.getpid(), TokenFile.closes)
    for name, dt in plan.fields.items():
        dst = (alloc or _empty)(name, (n, width), dt)
        out[name] = dst
        odd = list(range(lo, hi)) if stale else plan.odd[name]
        a, b = bisect.bisect_left(odd, lo), bisect.bisect_left(odd, hi)
        if stale:
            pass
        elif plan.direct[name]:
            runs = plan.run_end[name] if plan.run_end is not None and name in plan.run_end else None
            fds, offsets, maps = plan.fd[name], plan.offset[name], plan.maps

            def direct(x: int, y: int, dst: np.ndarray = dst, runs: list[int] | None = runs,
                       fds: list[int] = fds, offsets: list[int] = offsets,
                       maps: dict[int, np.ndarray] | None = maps) -> None:
                # rows [x, y): a run cut at y reads its last row whole, so slices need no stitching
                if maps is not None:
                    _copy_rows(dst[x - lo:y - lo], maps, fds[x:y], offsets[x:y])
                elif runs is not None:
                    _preadv_runs(dst[x - lo:y - lo], fds, offsets, runs, x, y)
                else:
                    _preadv_rows(dst[x - lo:y - lo], fds[x:y], offsets[x:y])

            if pool is None:
                direct(lo, hi)
            else:
                pool.share(direct, lo, hi)
        else:
            for k in range(n):
                if plan.fd[name][lo + k] >= 0:
                    row = np.empty((1, width), dtype=sources[int(plan.src[lo + k])].dtype_of(name))
                    _preadv_rows(row, plan.fd[name][lo + k:lo + k + 1], plan.offset[name][lo + k:lo + k + 1])
                    dst[k] = row[0]
        for k in odd[a:b]:
            source = sources[int(plan.src[k])]
            disk = source.dtype_of(name)
            row = dst[k - lo] if disk == dst.dtype else np.empty(width, dtype=disk)
            source.read_into(int(plan.start[k]), row, name)
            dst[k - lo] = row
    return out


class ReadPool:
    """Threads that share a group's reads (`data.read_threads`): `share(fn, lo, hi)` splits rows
    [lo, hi) into contiguous slices, runs fn on each (the caller's thread takes the first) and
    returns when all are read, raising the first error. `os.preadv` releases the GIL, so the
    threads' calls are in flight together: on a parallel file system or an NVMe drive, whose
    latency a single thread of random window reads waits out one at a time, that is the queue
    depth; page-cached, it is the copies on more cores. Daemon threads: a read stuck in the file
    system does not hold the interpreter's exit (the prefetcher's thread is one too)."""

    MIN_ROWS = 4
    """rows below which a slice is not worth a hand-off (a few us each)"""

    def __init__(self, threads: int) -> None:
        if threads < 2:
            raise ValueError(f"a read pool of {threads} thread(s): 1 reads in the caller alone")
        self.threads = threads
        self._tasks: queue.SimpleQueue[tuple[Callable[[], None], list[BaseException], threading.Event] | None] = (
            queue.SimpleQueue())
        self._workers = [threading.Thread(target=self._work, daemon=True, name=f"dslurm-read-{i}")
                         for i in range(threads - 1)]
        for t in self._workers:
            t.start()

    def _work(self) -> None:
        while (task := self._tasks.get()) is not None:
            fn, errors, done = task
            try:
                fn()
            except BaseException as exc:  # raised in the caller's thread
                errors.append(exc)
            finally:
                done.set()

    def share(self, fn: Callable[[int, int], None], lo: int, hi: int) -> None:
        parts = max(1, min(self.threads, (hi - lo) // self.MIN_ROWS))
        if parts == 1:
            fn(lo, hi)
            return
        cuts = [lo + (hi - lo) * i // parts for i in range(parts + 1)]
        errors: list[BaseException] = []
        dones = []
        for x, y in zip(cuts[1:-1], cuts[2:]):
            done = threading.Event()
            self._tasks.put((functools.partial(fn, x, y), errors, done))
            dones.append(done)
        try:
            fn(cuts[0], cuts[1])
        finally:
            for done in dones:  # every slice finished before the block is handed out (or freed)
                done.wait()
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Let the threads go (idempotent; a thread in a stuck read leaves when it returns)."""
        for _ in self._workers:
            self._tasks.put(None)
        self._workers = []


READ_GROUP_BYTES = 1 << 20
"""The background reader reads about this many bytes of batches per `read_planned` call (one
block, handed out as views): the call's own Python (the block, the field loop, the odd windows'
search) is paid per group, not per batch, which at a few 16 KB windows a batch was as much as
the reads. The read-ahead resident beyond the prefetch queue is at most this (or one batch)."""


def read_group(batch_bytes: int) -> int:
    """Batches read together by the background reader: about READ_GROUP_BYTES of them, at least one."""
    return max(1, READ_GROUP_BYTES // max(1, batch_bytes))


def _preadv_rows(dst: np.ndarray, fds: list[int], offsets: list[int]) -> None:
    """Row k of `dst` (C-contiguous) from descriptor fds[k] at byte offsets[k]; fd -1: left alone.
    The loop is the reader's only Python per window: kept to the call."""
    width = dst.shape[1] * dst.dtype.itemsize
    view = memoryview(dst.data).cast("B")  # rows end to end
    preadv, at = os.preadv, 0
    for fd, off in zip(fds, offsets):
        if fd >= 0 and preadv(fd, [view[at:at + width]], off) != width:
            _finish(fd, view[at:at + width], off)
        at += width


def _copy_rows(dst: np.ndarray, maps: dict[int, np.ndarray], fds: list[int], offsets: list[int]) -> None:
    """`_preadv_rows` from memory maps: row k of `dst` (C-contiguous) is a copy of fds[k]'s bytes
    at offsets[k] (a memoryview slice assignment: a memcpy, ~10% less per row than numpy's).
    `plan_reads` sent any span past its map's end to `read_into`; a file cut short after it was
    mapped is a SIGBUS on the lost pages (the price of `data.read: mmap`)."""
    view = memoryview(dst.data).cast("B")  # rows end to end
    width = dst.shape[1] * dst.dtype.itemsize
    at, last, src = 0, -1, memoryview(b"")
    for fd, off in zip(fds, offsets):
        if fd >= 0:
            if fd != last:
                last, src = fd, maps[fd].data
            view[at:at + width] = src[off:off + width]
        at += width


def _preadv_runs(dst: np.ndarray, fds: list[int], offsets: list[int], run_end: list[int], lo: int, hi: int) -> None:
    """Rows [lo, hi) of a plan into `dst` as `_preadv_rows` does, but a run of windows adjacent in
    one file (run_end[k]: its last window; cut at the batch's end) is one `os.preadv`: the run's
    bytes scattered into its rows, seq_len elements each and the last row's closing one, then each
    row's last element (the next window's first: neighbouring windows share one boundary token)
    copied from the row after it. A short read reads the run again row by row."""
    width_el = dst.shape[1]
    item = dst.dtype.itemsize
    width, stride = width_el * item, (width_el - 1) * item
    view = memoryview(dst.data).cast("B")
    preadv, k = os.preadv, lo
    joined: list[int] = []  # rows whose last element is the next row's first (fixed at the end, at once)
    while k < hi:
        j = min(run_end[k], hi - 1)
        fd, off, a, b = fds[k], offsets[k], k - lo, j - lo
        if fd < 0:
            pass
        elif j == k:
            if preadv(fd, [view[a * width:(a + 1) * width]], off) != width:
                _finish(fd, view[a * width:(a + 1) * width], off)
        else:
            bufs = [view[r * width:r * width + stride] for r in range(a, b)]
            bufs.append(view[b * width:(b + 1) * width])
            if preadv(fd, bufs, off) != (b - a) * stride + width:
                _preadv_rows(dst[a:b + 1], fds[k:j + 1], offsets[k:j + 1])
            joined.extend(range(a, b))
        k = j + 1
    if joined:
        rows = np.asarray(joined, dtype=np.intp)
        dst[rows, -1] = dst[rows + 1, 0]


def _finish(fd: int, piece: memoryview, off: int) -> None:
    """A short read (a signal, a network file system): read the span again until it is whole,
    or say the file is short."""
    got = 0
    while got < len(piece):
        more = os.preadv(fd, [piece[got:]], off + got)
        if more <= 0:
            raise OSError(f"short read: {got} of {len(piece)} bytes at offset {off} (a truncated file?)")
        got += more


def read_windows(sources: list[Any], src: np.ndarray, sample: np.ndarray, seq_len: int,
                 fields: Mapping[str, np.dtype], alloc: Alloc | None = None) -> dict[str, np.ndarray]:
    """{field: [n, seq_len+1] array of dtype fields[field]} for samples (source src[k], id sample[k]).

    `sources` hold `read_into(start, out, name)` and `dtype_of(name)` (TokenFile, TokenSource);
    `alloc(field, shape, dtype)` gives each output array (pinned host memory for a GPU).
    """
    return read_planned(plan_reads(sources, src, sample, seq_len, fields), sources, 0, len(sample), alloc)


_DONE = object()


Batches = Callable[[Any], Iterator[tuple[int, np.ndarray, Any]]]
"""sampler -> the batches it gives, read: (stream position, ids, payload), advancing the sampler"""


class Prefetcher:
    """A thread keeping up to `depth` batches read ahead; `take(position, ids)` -> its payload or None.

    `batches(sampler)` yields (position, ids, payload) for the sampler's next batches, read (and,
    on a GPU, pinned): `TokenLoader.batches`, which works out the reads of many batches at once.
    `sampler` is a private copy the thread advances: the caller's sampler is never touched here.
    """

    def __init__(self, batches: Batches, sampler: Any, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth {depth} must be >= 1")
        self._queue: queue.Queue[tuple[int, Any, Any]] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(batches, sampler), daemon=True,
                                        name="dslurm-prefetch")
        atexit.register(self.close)  # stop the thread before the interpreter tears down h5py
        self._thread.start()

    def _put(self, item: tuple[int, Any, Any]) -> bool:
        """Block until there is room (no polling: an idle reader sleeps); `close` sets the stop
        flag first and then empties the queue, which wakes a blocked put."""
        self._queue.put(item)
        return not self._stop.is_set()

    def _run(self, batches: Batches, sampler: Any) -> None:
        it = batches(sampler)
        try:
            for item in it:
                if self._stop.is_set() or not self._put(item):
                    return
        except BaseException as exc:  # handed to the step, which raises it
            self._put((-1, _DONE, exc))
        finally:  # a generator's frame (its plans, their maps) goes now, not when collected
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def take(self, position: int, ids: np.ndarray) -> Any | None:
        """The payload read for (position, ids); None when the reader went another way."""
        while True:
            got_pos, got_ids, payload = self._queue.get()
            if got_ids is _DONE:
                raise payload
            if got_pos < position:  # a batch the step skipped (a rollback's skip_positions)
                continue
            if got_pos == position and np.array_equal(got_ids, ids):
                return payload
            return None

    def close(self) -> None:
        """Stop the thread and drop what it read ahead; idempotent."""
        self._stop.set()
        deadline = time.monotonic() + 30  # a read stuck in the file system: leave the daemon thread
        while (self._thread.is_alive() and self._thread is not threading.current_thread()
               and time.monotonic() < deadline):
            try:  # emptying the queue wakes a blocked put; the thread then sees the flag
                while True:
                    self._queue.get_nowait()
            except queue.Empty:
                pass
            self._thread.join(timeout=0.05)
        atexit.unregister(self.close)


def staging_dtype(sources: list[Any]) -> np.dtype:
    """The dtype a batch's tokens are read and moved in: the files' own uint16 when all are, else
    int32 (ids < 2**31), else int64. The step widens them to int64 after the move (on the GPU),
    so the host reads, pins and copies 2 or 4 bytes per token, not 8."""
    disk = np.result_type(*[s.dtype_of(DATASET) for s in sources])
    if disk == np.uint16:
        return np.dtype(np.uint16)
    return np.dtype(np.int32) if max(int(s.vocab_size) for s in sources) <= 1 << 31 else np.dtype(np.int64)
