"""The HDF5 token file: its format, its two writers and a lazy reader.

Format (version 1): one 1-D dataset ``tokens`` holding a flat token stream, dtype
uint16 when the vocabulary fits in 16 bits, else uint32. Attributes on the file:
``format`` ("dslurm-tokens"), ``format_version`` (1), ``vocab_size``, ``seq_len`` (a
hint, 0 = none; the model's seq_len decides), ``source`` (free text) and ``created``
(ISO 8601, UTC). Instruction data (dslurm/data/instruct.py) adds two uint8 datasets of the same
length, ``loss_mask`` and ``doc_start``, and the attribute ``packed_seq_len``. A file written
by a real tokenizer (`dslurm.data.shards`) also has
``tokenizer_hash`` (sha256 of its tokenizer.json), ``bos_id`` and ``eos_id`` (-1 = none)
and ``inputs`` (JSON: the input files' paths, sizes and mtimes); files without them (byte
level, synthetic, older files) read as before.

This module is torch-free (numpy + h5py only) so the `dslurm data` CLI can use it
without paying for `import torch`. Every write goes to a temp file in the target
directory, is fsynced, renamed over the target and the directory fsynced, so a reader
sees either no file or a complete one (STYLE.md rule 6); the trainer's
"rank 0 writes, the others wait for the file" relies on exactly that.
"""

from __future__ import annotations

import datetime as _dt
import mmap
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dslurm.errors import UserError

FORMAT = "dslurm-tokens"
FORMAT_VERSION = 1
DATASET = "tokens"
SYNTHETIC_FOLLOW_P = 0.9
"""Synthetic corpus: probability that the next token is the current token's fixed successor."""


def dtype_for(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype of the two the format allows that holds every token id."""
    if not 1 <= vocab_size <= 1 << 32:
        raise ValueError(f"vocab_size={vocab_size} must be in 1..2**32")
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenFileInfo:
    """What `dslurm data info` prints and the loader checks."""

    path: str
    n_tokens: int
    vocab_size: int
    seq_len: int
    dtype: str
    source: str
    created: str
    size_bytes: int
    tokenizer_hash: str = ""
    bos_id: int | None = None
    eos_id: int | None = None
    packed_seq_len: int = 0
    """instruction data: the seq_len its examples were packed for (0: pre-training text)"""

    def samples(self, seq_len: int) -> int:
        """Windows of seq_len+1 tokens, taken with stride seq_len (see train/data.py)."""
        return max(0, (self.n_tokens - 1) // seq_len)


# ------------------------------------------------------------------------- writing


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: str | Path, chunks: Iterable[np.ndarray | dict[str, np.ndarray]], *, vocab_size: int,
                  seq_len: int, source: str, attrs: Mapping[str, Any] | None = None) -> Path:
    """Stream token chunks into <path> atomically; returns the final path. `attrs` are extra
    file attributes (a tokenizer's hash and special ids, the inputs). A chunk may be a dict of
    arrays of one length: "tokens" and datasets beside them (uint8: instruction data's masks)."""
    import h5py  # lazy: keeps `dslurm --help` instant

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    dtype = dtype_for(vocab_size)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        with h5py.File(tmp, "w") as f:
            # Chunked + resizable because tokenize does not know the length up front;
            # 1 Mi-token chunks keep a random seq_len window to one or two chunk reads.
            ds = f.create_dataset(DATASET, shape=(0,), maxshape=(None,), dtype=dtype,
                                  chunks=(1 << 20,))
            beside: dict[str, Any] = {}
            n = 0
            for item in chunks:
                chunk = item[DATASET] if isinstance(item, dict) else item
                if chunk.size and int(chunk.max()) >= vocab_size:
                    raise ValueError(f"token id {int(chunk.max())} >= vocab_size {vocab_size}")
                ds.resize((n + chunk.size,))
                ds[n:n + chunk.size] = chunk.astype(dtype, copy=False)
                for name, arr in (item.items() if isinstance(item, dict) else ()):
                    if name != DATASET:
                        if name not in beside:
                            beside[name] = f.create_dataset(name, shape=(0,), maxshape=(None,), dtype=np.uint8,
                                                            chunks=(1 << 20,))
                        beside[name].resize((n + chunk.size,))
                        beside[name][n:n + chunk.size] = arr
                n += chunk.size
            f.attrs.update({
                "format": FORMAT, "format_version": FORMAT_VERSION, "vocab_size": vocab_size,
                "seq_len": seq_len, "source": source,
                "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                **(attrs or {}),
            })
        with open(tmp, "rb+") as fh:  # h5py's close does not fsync
            os.fchmod(fh.fileno(), 0o666 & ~_umask())  # mkstemp made it 0600: a dataset is for the team
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _umask() -> int:
    """The process's umask (reading it means setting it; set straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def synthetic_tokens(n_tokens: int, vocab_size: int, seed: int) -> np.ndarray:
    """A deterministic, learnable token stream (int64), fully vectorised.

    A Markov chain: each token is followed by its fixed successor with probability
    SYNTHETIC_FOLLOW_P, else by a uniformly random token. The successor map is one
    random cycle through the vocabulary, so k steps of "follow" from token t land on
    cycle[(pos[t] + k) % V] and the whole stream is computed without a Python loop.
    A model only has to learn a bigram table to go from ln(V) to about 0.9 nats
    (V=256), which a tiny transformer does in a few dozen steps.
    """
    if n_tokens < 2:
        raise ValueError(f"n_tokens={n_tokens} must be at least 2")
    rng = np.random.default_rng([seed, vocab_size, 0x70CE])
    cycle = rng.permutation(vocab_size)
    pos = np.empty(vocab_size, dtype=np.int64)
    pos[cycle] = np.arange(vocab_size)
    reset = rng.random(n_tokens) >= SYNTHETIC_FOLLOW_P
    reset[0] = True
    fresh = rng.integers(0, vocab_size, n_tokens)
    idx = np.arange(n_tokens)
    last = np.maximum.accumulate(np.where(reset, idx, 0))  # index of the latest reset
    tokens: np.ndarray = cycle[(pos[fresh[last]] + (idx - last)) % vocab_size]
    return tokens


def write_synthetic(path: str | Path, n_tokens: int, vocab_size: int, seed: int = 0, *,
                    seq_len: int = 0) -> Path:
    """Write the synthetic corpus of `synthetic_tokens` to `path` (atomically)."""
    tokens = synthetic_tokens(n_tokens, vocab_size, seed)
    source = f"synthetic markov follow_p={SYNTHETIC_FOLLOW_P} seed={seed}"
    step = 1 << 22
    chunks = (tokens[i:i + step] for i in range(0, n_tokens, step))
    return _write_atomic(path, chunks, vocab_size=vocab_size, seq_len=seq_len, source=source)


def tokenize_text(path_in: str | Path, path_out: str | Path, *, seq_len: int = 0,
                  chunk_bytes: int = 1 << 26) -> Path:
    """Byte-level tokenization (vocab 256): every byte of the input is one token.

    Streams the input in chunks so a file larger than memory still converts.
    """
    path_in = Path(path_in)
    if not path_in.is_file():
        raise UserError(f"{path_in}: no such file. Fix: give an existing text file to tokenize")

    def chunks() -> Iterable[np.ndarray]:
        with open(path_in, "rb") as fh:
            while block := fh.read(chunk_bytes):
                yield np.frombuffer(block, dtype=np.uint8)

    if path_in.stat().st_size < 2:
        raise UserError(f"{path_in}: {path_in.stat().st_size} bytes; a token file needs at least 2")
    return _write_atomic(path_out, chunks(), vocab_size=256, seq_len=seq_len,
                         source=f"bytes of {path_in}")


# ------------------------------------------------------------------------- reading


class _Layout:
    """Where a dataset's elements lie in the file, for reads that bypass HDF5 (`os.preadv`).

    Only for what our writers make: no filters, native byte order, a contiguous or a chunked
    layout. A chunk's file offset is looked up once (h5py's chunk index) and cached in an
    int64 array of one entry per chunk (8 bytes per Mi tokens: 7.6 MB at a trillion tokens),
    -2 = not looked up, -1 = unallocated (reads as the fill value, 0).
    """

    __slots__ = ("chunk", "itemsize", "base", "offsets")

    def __init__(self, ds: Any) -> None:
        import h5py

        dcpl = ds.id.get_create_plist()
        self.itemsize = ds.dtype.itemsize
        self.chunk, self.base, self.offsets = 0, -1, np.empty(0, dtype=np.int64)
        if dcpl.get_layout() == h5py.h5d.CHUNKED:
            self.chunk = int(ds.chunks[0])
            self.offsets = np.full(-(-int(ds.shape[0]) // self.chunk), -2, dtype=np.int64)
        else:
            off = ds.id.get_offset()
            self.base = -1 if off is None else int(off)

    @staticmethod
    def usable(ds: Any) -> bool:
        import h5py

        dcpl = ds.id.get_create_plist()
        return bool(dcpl.get_nfilters() == 0 and ds.dtype.isnative and ds.ndim == 1
                    and dcpl.get_layout() in (h5py.h5d.CHUNKED, h5py.h5d.CONTIGUOUS))

    def chunk_offset(self, ds: Any, c: int) -> int:
        off = int(self.offsets[c])
        if off == -2:
            info = ds.id.get_chunk_info_by_coord((c * self.chunk,))
            off = -1 if info.byte_offset is None else int(info.byte_offset)
            self.offsets[c] = off
        return off

    def extents(self, ds: Any, start: np.ndarray, length: int) -> np.ndarray:
        """The file byte offset of each span [start, start+length) lying in one contiguous extent
        of the file (one chunk, or two chunks adjacent on disk, as our writers lay them out; any
        span of a contiguous dataset); -1 for the others (an unallocated or a distant chunk)."""
        if not self.chunk:
            return np.full(start.shape, -1, dtype=np.int64) if self.base < 0 else self.base + start * self.itemsize
        c0, c1 = start // self.chunk, (start + length - 1) // self.chunk
        for c in np.unique(np.concatenate([c0, c1])[self.offsets[np.concatenate([c0, c1])] == -2]).tolist():
            self.chunk_offset(ds, c)  # each chunk looked up once per process
        o0, o1 = self.offsets[c0], self.offsets[c1]
        span = self.chunk * self.itemsize
        whole = (o0 >= 0) & ((c1 == c0) | ((c1 == c0 + 1) & (o1 == o0 + span)))
        return np.where(whole, o0 + (start - c0 * self.chunk) * self.itemsize, -1)


class TokenFile:
    """Lazy reader: opens the file on first use, once per process, reads only windows.

    The handle is reopened after a fork (HDF5 handles must not cross a fork), which is
    why the pid is remembered. Header fields are read at construction and the handle
    closed again, so constructing one in a parent process is safe.

    Reads (`read_into`) go straight to the file with `os.preadv` at the element's file
    offset (`_Layout`) when the dataset allows it: no HDF5 call per window (about 30 us
    each), the GIL released during the read, so a background reader overlaps the step.
    Any other dataset (compressed, foreign) is read through h5py. `name` selects another
    1-D per-token dataset of the same file (read over the same range as the tokens).
    The loader's batches (train/reader.py) take their windows' file offsets from `extents`,
    vectorised over many batches, and read each with one `os.preadv` through `fileno()`.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: Any = None
        self._fd = -1
        self._pid = -1
        self._open: dict[str, tuple[Any, _Layout | None, np.dtype]] = {}
        self._map: tuple[int, mmap.mmap, np.ndarray] | None = None
        self.info = read_info(self.path)
        self._dtype = np.dtype(self.info.dtype)

    @property
    def n_tokens(self) -> int:
        return self.info.n_tokens

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    def dtype_of(self, name: str = DATASET) -> np.dtype:
        """The dtype of 1-D dataset `name` (the tokens, or a per-token array beside them)."""
        return self.dtype if name == DATASET else self._layout(name)[2]

    def _dataset(self, name: str = DATASET) -> Any:  # an h5py Dataset (h5py has no type information)
        if self._file is None or self._pid != os.getpid():
            import h5py

            self._file = h5py.File(self.path, "r")
            self._fd = os.open(self.path, os.O_RDONLY)
            self._pid = os.getpid()
            self._open = {}
        return self._file[name]

    def _layout(self, name: str) -> tuple[Any, _Layout | None, np.dtype]:
        """(dataset, its layout or None, its dtype), looked up once per process: an h5py
        lookup costs about a millisecond, a window's read microseconds."""
        got = self._open.get(name) if self._pid == os.getpid() else None
        if got is None:
            ds = self._dataset(name)
            got = self._open[name] = (ds, _Layout(ds) if _Layout.usable(ds) else None, np.dtype(ds.dtype))
        return got

    def read_into(self, start: int, out: np.ndarray, name: str = DATASET) -> None:
        """Elements [start, start+len(out)) of dataset `name` into `out` (its dtype, contiguous)."""
        n = len(out)
        if start < 0 or start + n > self.n_tokens:
            raise IndexError(f"window [{start}, {start + n}) outside {self.n_tokens} tokens")
        ds, lay, dtype = self._layout(name)
        if lay is None or out.dtype != dtype:
            out[:] = ds[start:start + n]
            return
        size = lay.itemsize
        if not lay.chunk:
            if lay.base < 0:
                out[:] = 0
            else:
                _pread(self._fd, out, lay.base + start * size)
            return
        pos = start
        while pos < start + n:
            c = pos // lay.chunk
            take = min(start + n, (c + 1) * lay.chunk) - pos
            piece = out[pos - start:pos - start + take]
            off = lay.chunk_offset(ds, c)
            if off < 0:
                piece[:] = 0  # an unallocated chunk reads as the fill value
            else:
                _pread(self._fd, piece, off + (pos - c * lay.chunk) * size)
            pos += take

    def extents(self, start: np.ndarray, length: int, name: str = DATASET) -> np.ndarray:
        """The file byte offset of each span [start[k], start[k]+length) of dataset `name`, for
        one `os.preadv` each through `fileno()`, vectorised; -1 where one read cannot do (outside
        the dataset, an unallocated chunk or one apart from its neighbour, a dataset h5py must
        decode): read those with `read_into`.

        The same offsets index `mapped()` (`data.read: mmap`: a slice copied per window). A
        memory map gathered with one numpy fancy index per batch was measured too: slower here on
        a window's first touch (its page faults cost more than the calls)."""
        start = np.asarray(start, dtype=np.int64)
        out = np.full(start.shape, -1, dtype=np.int64)
        ds, lay, _ = self._layout(name)
        inside = (start >= 0) & (start + length <= self.n_tokens)
        if lay is None or not inside.any():
            return out
        out[inside] = lay.extents(ds, start[inside], length)
        return out

    def fileno(self) -> int:
        """The descriptor `extents`' offsets are read through (train/reader.py: one `os.preadv`
        per window, straight into its row), opened in this process."""
        if self._pid != os.getpid() or self._file is None:
            self._dataset()
        return self._fd

    def mapped(self) -> np.ndarray:
        """The whole file as bytes (uint8) through a read-only memory map made in this process, for
        `data.read: mmap` (train/reader.py copies each window's span at `extents`' offset from it: no
        call per window). A file of at most POPULATE_MAX_BYTES whose pages are all in the page cache
        is mapped whole at once (MAP_POPULATE: page tables only, no disk read, ~0.07 s a GB here),
        since a copy from a mapped page is ~2x a call and a first touch's fault ~0.7x; any other
        is mapped as it is touched (from a cold disk a fault's read-around beats a call per window
        here). A file cut short under the map is a SIGBUS on its lost pages (docs/data.md)."""
        if self._map is None or self._map[0] != os.getpid():
            fd = self.fileno()  # the map holds a descriptor of its own: close() may close this one
            whole = os.fstat(fd).st_size <= POPULATE_MAX_BYTES and cached_share(fd) >= 1.0
            mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED | (mmap.MAP_POPULATE if whole else 0), prot=mmap.PROT_READ)
            self._map = (os.getpid(), mm, np.frombuffer(mm, dtype=np.uint8))
        return self._map[2]

    def window(self, start: int, length: int, name: str = DATASET) -> np.ndarray:
        """Tokens [start, start+length) as int64 (or, by `name`, a dataset beside them)."""
        buf = np.empty(length, dtype=self.dtype_of(name))
        self.read_into(start, buf, name)
        return buf.astype(np.int64)

    closes = 0
    """TokenFile closes in this process so far: descriptors taken from `fileno` before one may
    name another file now (train/reader.py checks it before reading a plan's)."""

    def close(self) -> None:
        TokenFile.closes += 1
        if self._file is not None and self._pid == os.getpid():
            self._file.close()
            os.close(self._fd)
        self._file, self._fd, self._open = None, -1, {}
        if self._map is not None:
            pid, mm = self._map[:2]
            self._map = None  # our own view (an export of the map) first, else the map cannot close
            if pid == os.getpid():
                try:
                    mm.close()
                except BufferError:  # a plan still holds a view: the map goes with the last one
                    pass


POPULATE_MAX_BYTES = 8 << 30
"""`data.read: mmap` maps a page-cached file whole up to this size: its page tables (8 bytes a 4 KB
page: 16 MB at the cap, per rank) stay modest; a larger one is mapped as it is touched."""


def cached_share(fd: int, probes: int = 256) -> float:
    """The share of `probes` 4 KB pages spread over an open file that are in the page cache: a
    read with RWF_NOWAIT returns data for a cached page and refuses (EAGAIN) otherwise."""
    size, buf, hits = os.fstat(fd).st_size, bytearray(4096), 0
    if size == 0:
        return 1.0
    for k in range(probes):
        try:
            hits += os.preadv(fd, [buf], max(0, size - 4096) * k // max(1, probes - 1) // 4096 * 4096,
                              os.RWF_NOWAIT) > 0
        except BlockingIOError:
            pass
    return hits / probes


def _pread(fd: int, out: np.ndarray, offset: int) -> None:
    """Fill `out` from the file at `offset`; a short read (a truncated file) is an error."""
    view = memoryview(out.data).cast("B")
    got = os.preadv(fd, [view], offset)
    while 0 < got < len(view):
        more = os.preadv(fd, [view[got:]], offset + got)
        if more <= 0:
            break
        got += more
    if got != len(view):
        raise OSError(f"short read: {got} of {len(view)} bytes at offset {offset}")


def read_info(path: str | Path) -> TokenFileInfo:
    """Header of a token file; a missing or malformed file is a UserError naming the fix."""
    import h5py

    path = Path(path)
    fix = "Fix: create it with `dslurm data synth` or `dslurm data tokenize`"
    if not path.is_file():
        raise UserError(f"{path}: no such token file. {fix}")
    try:
        with h5py.File(path, "r") as f:
            if DATASET not in f or f[DATASET].ndim != 1:
                raise UserError(f"{path}: no 1-D dataset {DATASET!r}. {fix}")
            ds = f[DATASET]
            if ds.dtype not in (np.uint16, np.uint32):
                raise UserError(f"{path}: dataset {DATASET!r} has dtype {ds.dtype}; expected "
                                f"uint16 or uint32. {fix}")
            attrs = dict(f.attrs)
            n_tokens, dtype = int(ds.shape[0]), str(ds.dtype)
    except OSError as exc:
        raise UserError(f"{path}: not a readable HDF5 file ({exc}). {fix}") from exc
    if "vocab_size" not in attrs:
        raise UserError(f"{path}: attribute 'vocab_size' is missing. {fix}")
    return TokenFileInfo(
        path=str(path), n_tokens=n_tokens, vocab_size=int(attrs["vocab_size"]),
        seq_len=int(attrs.get("seq_len", 0)), dtype=dtype, source=str(attrs.get("source", "")),
        created=str(attrs.get("created", "")), size_bytes=path.stat().st_size,
        tokenizer_hash=str(attrs.get("tokenizer_hash", "")),
        bos_id=_special(attrs.get("bos_id")), eos_id=_special(attrs.get("eos_id")),
        packed_seq_len=int(attrs.get("packed_seq_len", 0)))


def _special(value: Any) -> int | None:
    """A special id attribute: absent or -1 means none."""
    return None if value is None or int(value) < 0 else int(value)
