"""A step's windows off the disk: contiguous reads, per-token fields, a background prefetch.

`read_windows` reads the windows of a batch's samples. Samples adjacent in a stream (window
starts seq_len apart: eval's in-order batches, a corpus smaller than the batch) are read as
one run of m*seq_len+1 tokens and cut into overlapping windows by a strided view, so a run
costs one read, not m. Every field is read over the same (source, range) as the tokens: a
per-token array stored beside the tokens (a dataset of that name in the same HDF5 file) comes
back with the same [n, seq_len+1] shape, row for row.

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
import queue
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from dslurm.data.tokenize import DATASET

Alloc = Callable[[str, tuple[int, ...], np.dtype], np.ndarray]


def _empty(name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    return np.empty(shape, dtype=dtype)


def read_windows(sources: list[Any], src: np.ndarray, sample: np.ndarray, seq_len: int,
                 fields: Mapping[str, np.dtype], alloc: Alloc = _empty) -> dict[str, np.ndarray]:
    """{field: [n, seq_len+1] array of dtype fields[field]} for samples (source src[k], id sample[k]).

    `sources` hold `read_into(start, out, name)` and `dtype_of(name)` (TokenFile, TokenSource);
    `alloc(field, shape, dtype)` gives each output array (pinned host memory for a GPU). A lone
    window of the output's own dtype is read straight into its row (no copy).
    """
    n, width = len(sample), seq_len + 1
    out = {name: alloc(name, (n, width), np.dtype(dt)) for name, dt in fields.items()}
    if n == 0:
        return out
    s_sorted, st_sorted, order, bounds = _runs(np.asarray(src, dtype=np.int64),
                                               np.asarray(sample, dtype=np.int64) * seq_len, seq_len)
    for name, dt in fields.items():
        dst = out[name]
        for a, b in zip(bounds[:-1], bounds[1:]):
            source = sources[s_sorted[a]]
            m = b - a
            disk = source.dtype_of(name)
            if m == 1 and disk == dst.dtype:
                source.read_into(st_sorted[a], dst[order[a]], name)
                continue
            flat = np.empty(m * seq_len + 1, dtype=disk)
            source.read_into(st_sorted[a], flat, name)
            if m == 1:
                dst[order[a]] = flat
            else:  # m overlapping windows of one run, stride seq_len
                step = flat.strides[0]
                dst[order[a:b]] = np.lib.stride_tricks.as_strided(flat, (m, width), (seq_len * step, step))
    return out


def _runs(src: np.ndarray, starts: np.ndarray, seq_len: int) -> tuple[list[int], list[int], Any, list[int]]:
    """Windows sorted by (source, start) and cut into runs of adjacent ones: (sources, starts,
    order, run bounds), lists. A step's few windows are sorted in Python (numpy's per-call cost
    is the larger one below a few hundred); a big batch in numpy."""
    n = len(starts)
    if n <= 256:
        sr, st = src.tolist(), starts.tolist()
        order_l = sorted(range(n), key=lambda k: (sr[k], st[k]))
        s_sorted, st_sorted = [sr[k] for k in order_l], [st[k] for k in order_l]
        bounds = [0] + [k for k in range(1, n) if s_sorted[k] != s_sorted[k - 1]
                        or st_sorted[k] != st_sorted[k - 1] + seq_len] + [n]
        return s_sorted, st_sorted, np.asarray(order_l, dtype=np.int64), bounds
    order = np.lexsort((starts, src))
    s_np, st_np = src[order], starts[order]
    # a run breaks where the source changes or the next window does not start seq_len later
    brk = np.flatnonzero((np.diff(s_np) != 0) | (np.diff(st_np) != seq_len)) + 1
    return s_np.tolist(), st_np.tolist(), order, np.concatenate([[0], brk, [n]]).tolist()


_DONE = object()


class Prefetcher:
    """A thread keeping up to `depth` batches read ahead; `take(position, ids)` -> its payload or None.

    `stage(ids)` reads (and, on a GPU, pins) one batch; `sampler` is a private copy the thread
    advances (`stream_position`, `next_ids`): the caller's sampler is never touched here.
    """

    def __init__(self, stage: Callable[[np.ndarray], Any], sampler: Any, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"prefetch depth {depth} must be >= 1")
        self._queue: queue.Queue[tuple[int, Any, Any]] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(stage, sampler), daemon=True,
                                        name="dslurm-prefetch")
        atexit.register(self.close)  # stop the thread before the interpreter tears down h5py
        self._thread.start()

    def _put(self, item: tuple[int, Any, Any]) -> bool:
        """Block until there is room (no polling: an idle reader sleeps); `close` sets the stop
        flag first and then empties the queue, which wakes a blocked put."""
        self._queue.put(item)
        return not self._stop.is_set()

    def _run(self, stage: Callable[[np.ndarray], Any], sampler: Any) -> None:
        try:
            while not self._stop.is_set():
                position = int(sampler.stream_position)
                ids = sampler.next_ids()
                if not self._put((position, ids, stage(ids))):
                    return
        except BaseException as exc:  # handed to the step, which raises it
            self._put((-1, _DONE, exc))

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
