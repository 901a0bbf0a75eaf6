"""Documents out of input files, streamed in batches; large files cut into pieces.

* `.txt`: `txt_docs="blank"` (default): one document per block of lines, blocks separated by
  one or more blank (whitespace-only) lines; the document is the block's lines with their line
  breaks, the last line break dropped. `txt_docs="file"`: the whole file is one document.
* `.jsonl`, `.jsonl.gz`, `.jsonl.zst`: one JSON object per line (the compressed ones are
  decompressed as a stream); the document is its `field` (default "text"). Empty lines are
  skipped; a line without the field, or whose value is not a string, is an error naming the
  file and line. A null value is skipped (no document).
* `.json`: an array of such objects (parsed element by element, never the whole file at once),
  or one object per line (as `.jsonl`), told apart by the first character.
* `.parquet`: the column `field`, read one row group at a time (never the whole file);
  null values are skipped; a file without the column is an error listing its columns.

Pieces. A plain `.jsonl` file can be read as byte ranges [a, b): a range holds the lines that
*start* in it, so the ranges of a file, in order, hold each line exactly once and in file
order. A `.parquet` file can be read as row-group ranges [g0, g1). `split_points` cuts a file
into k such ranges; the shards of a plan (dslurm/data/shards.py) can so outnumber the files.

Every error is a UserError naming the file, the line or field, and the fix. Torch-free.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Literal

from dslurm.errors import UserError

TxtDocs = Literal["blank", "file"]
SUFFIXES = (".txt", ".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".parquet")
BATCH_BYTES = 1 << 20
"""A batch of documents is handed to the tokenizer once it holds about this many characters."""
Range = tuple[int, int]


def kind(path: Path) -> str | None:
    """The input type of `path` from its name (the longest suffix of SUFFIXES it ends with)."""
    name = path.name
    found = [s for s in SUFFIXES if name.endswith(s) and len(name) > len(s)]
    return max(found, key=len) if found else None


def find_inputs(paths: list[str | Path]) -> list[Path]:
    """Input files, in a fixed order: each file as given, each folder's files of the known types
    (recursively, any mix of them) sorted by path. A missing path or a folder with none is an error."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and kind(f))
            if not found:
                raise UserError(f"{p}: no {', '.join(SUFFIXES)} files in this folder. "
                                f"Fix: point at the folder that holds the data")
            out += found
        elif p.is_file():
            if not kind(p):
                raise UserError(f"{p}: unknown input type {''.join(p.suffixes) or p.name!r}. Fix: give "
                                f"{', '.join(SUFFIXES)} files (the type is read from the suffix)")
            out.append(p)
        else:
            raise UserError(f"{p}: no such file or folder. Fix: give existing input files")
    return [p.resolve() for p in out]


def split_points(path: Path, k: int) -> list[Range] | None:
    """`path` cut into at most k ranges of about equal bytes, or None when it is read whole
    (k < 2, a compressed or .txt/.json file). jsonl: byte ranges; parquet: row-group ranges."""
    if k < 2:
        return None
    if kind(path) == ".jsonl":
        size = path.stat().st_size
        with open(path, "rb") as fh:  # each cut moved to the line start at or after it: no empty range
            cuts = sorted({_line_start(fh, i * size // k, size) for i in range(k)} | {size})
        return list(zip(cuts[:-1], cuts[1:]))
    if kind(path) == ".parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(path).metadata
        sizes = [meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)]
        if len(sizes) < 2:
            return None
        cuts, acc, total = [0], 0, sum(sizes) or 1
        for g, size in enumerate(sizes[:-1]):
            acc += size
            if acc * min(k, len(sizes)) >= total * len(cuts) and len(cuts) < k:
                cuts.append(g + 1)
        cuts.append(len(sizes))
        return list(zip(cuts[:-1], cuts[1:]))
    return None


def _line_start(fh: IO[bytes], at: int, size: int) -> int:
    """The offset of the first line that starts at or after `at` (`size` when none does)."""
    if at <= 0:
        return 0
    fh.seek(at - 1)
    pos = at - 1
    while chunk := fh.read(1 << 16):
        nl = chunk.find(b"\n")
        if nl >= 0:
            return min(pos + nl + 1, size)
        pos += len(chunk)
    return size


def _txt(path: Path, txt_docs: TxtDocs) -> Iterator[str]:
    with open(path, encoding="utf-8") as fh:
        if txt_docs == "file":
            text = fh.read()
            if text.strip():
                yield text
            return
        block: list[str] = []
        for line in fh:
            if line.strip():
                block.append(line)
            elif block:
                yield "".join(block).removesuffix("\n")
                block = []
        if block:
            yield "".join(block).removesuffix("\n")


def _value(path: Path, where: str, obj: object, field: str) -> str | None:
    """The document of one JSON object: its `field` (None for a null)."""
    fix = f"Fix: give the right field with --field NAME (now {field!r})"
    if not isinstance(obj, dict) or field not in obj:
        keys = ", ".join(map(repr, obj)) if isinstance(obj, dict) else type(obj).__name__
        what = "element" if where.startswith("element") else "line"
        raise UserError(f"{path}:{where}: no field {field!r} (this {what} has: {keys}). {fix}")
    value = obj[field]
    if value is not None and not isinstance(value, str):
        raise UserError(f"{path}:{where}: field {field!r} is a {type(value).__name__}, not a string. {fix}")
    return value


def _lines(path: Path, fh: IO[bytes], field: str, first: int = 1, at: int | None = None) -> Iterator[str]:
    """The documents of JSON lines read from `fh`; line numbers from `first` (or byte offsets from
    `at` inside a byte range, where the line number is unknown)."""
    pos = at
    for n, line in enumerate(fh, first):
        where = f"{n}" if pos is None else f"byte {pos}"
        if pos is not None:
            pos += len(line)
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as exc:
            raise UserError(f"{path}:{where}: not a JSON line ({exc}). Fix: one JSON object per "
                            f"line; repair or remove that line") from exc
        value = _value(path, where, obj, field)
        if value is not None:
            yield value


def _range_lines(fh: IO[bytes], rng: Range) -> Iterator[bytes]:
    """The lines that start in byte range [a, b) of a seekable file."""
    a, b = rng
    if a > 0:
        fh.seek(a - 1)
        fh.readline()  # the rest of the line holding byte a-1: it started before a
    pos = fh.tell()
    while pos < b:
        line = fh.readline()
        if not line:
            return
        yield line
        pos += len(line)


def _open_compressed(path: Path) -> IO[bytes]:
    if kind(path) == ".jsonl.gz":
        return gzip.open(path, "rb")  # type: ignore[return-value]
    import zstandard  # lazy: only for .zst inputs

    raw = open(path, "rb")
    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(raw, closefd=True))


def _jsonl(path: Path, field: str, rng: Range | None = None) -> Iterator[str]:
    if kind(path) in (".jsonl.gz", ".jsonl.zst"):
        try:
            with _open_compressed(path) as fh:
                yield from _lines(path, fh, field)
        except (OSError, EOFError) as exc:  # gzip.BadGzipFile is an OSError; zstd errors too
            raise UserError(f"{path}: does not decompress ({exc}). Fix: repair or remove it") from exc
        return
    with open(path, "rb") as fh:
        if rng is None or rng[0] == 0:
            lines: Iterator[bytes] = fh if rng is None else _range_lines(fh, rng)
            yield from _lines(path, lines, field)  # type: ignore[arg-type]
        else:
            at = _first_start(fh, rng[0])
            yield from _lines(path, _range_lines(fh, rng), field, at=at)  # type: ignore[arg-type]


def _first_start(fh: IO[bytes], a: int) -> int:
    """Offset of the first line that starts at or after byte a (for error messages)."""
    fh.seek(a - 1)
    fh.readline()
    return fh.tell()


_JSON_CHUNK = 1 << 20


class _Text:
    """A text file read in 1 MB pieces with a cursor: `peek` skips whitespace, `more` reads on."""

    def __init__(self, fh: IO[str], head: str) -> None:
        self.fh, self.buf, self.i, self.eof = fh, head, 0, False

    def more(self) -> None:
        chunk = self.fh.read(_JSON_CHUNK)
        self.buf, self.i, self.eof = self.buf[self.i:] + chunk, 0, not chunk

    def peek(self) -> str | None:
        while True:
            while self.i < len(self.buf) and self.buf[self.i] in " \t\r\n":
                self.i += 1
            if self.i < len(self.buf):
                return self.buf[self.i]
            if self.eof:
                return None
            self.more()


def _json(path: Path, field: str) -> Iterator[str]:
    """`.json`: an array of objects, parsed element by element from 1 MB reads, or JSON lines."""
    with open(path, encoding="utf-8") as fh:
        t = _Text(fh, fh.read(_JSON_CHUNK))
        if t.peek() != "[":
            with open(path, "rb") as raw:
                yield from _lines(path, raw, field)
            return
        t.i += 1
        dec, n, fix = json.JSONDecoder(), 0, "Fix: give a JSON array of objects, or one object per line"
        while True:
            c = t.peek()
            if c == "]":
                return
            if c is None:
                raise UserError(f"{path}: the array is not closed (after element {n}). {fix}")
            if n:
                if c != ",":
                    raise UserError(f"{path}: after element {n}: expected ',' or ']', found {c!r}. {fix}")
                t.i += 1
                if t.peek() is None:
                    raise UserError(f"{path}: the array is not closed (after element {n}). {fix}")
            while True:
                try:
                    obj, j = dec.raw_decode(t.buf, t.i)
                except ValueError as exc:
                    if t.eof:
                        raise UserError(f"{path}: element {n + 1} does not parse ({exc}). {fix}") from exc
                    t.more()  # the element may run past this read: read on and parse it again
                    continue
                if j < len(t.buf) or t.eof:
                    break
                t.more()
            t.i, n = j, n + 1
            value = _value(path, f"element {n}", obj, field)
            if value is not None:
                yield value


def _parquet(path: Path, field: str, rng: Range | None = None) -> Iterator[str]:
    import pyarrow.parquet as pq  # lazy: pyarrow takes ~0.3 s to import

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid/OSError subclasses
        raise UserError(f"{path}: not a readable parquet file ({exc}). Fix: repair or remove "
                        f"it") from exc
    names = pf.schema_arrow.names
    if field not in names:
        raise UserError(f"{path}: no column {field!r} (columns: {', '.join(names)}). Fix: give "
                        f"the text column with --field NAME")
    g0, g1 = rng if rng is not None else (0, pf.num_row_groups)
    for g in range(g0, g1):
        col = pf.read_row_group(g, columns=[field]).column(0)
        for value in col.to_pylist():
            if value is None:
                continue
            if not isinstance(value, str):
                raise UserError(f"{path}: column {field!r} holds {type(value).__name__}, not "
                                f"strings. Fix: give the text column with --field NAME")
            yield value


def documents(path: Path, *, field: str = "text", txt_docs: TxtDocs = "blank",
              rng: Range | None = None) -> Iterator[str]:
    """The documents of one input file (or of its range `rng`, see `split_points`), in file order."""
    k = kind(path)
    if k in (".jsonl", ".jsonl.gz", ".jsonl.zst"):
        return _jsonl(path, field, rng)
    if k == ".json":
        return _json(path, field)
    if k == ".parquet":
        return _parquet(path, field, rng)
    if k == ".txt":
        return _txt(path, txt_docs)
    raise UserError(f"{path}: unknown input type {''.join(path.suffixes)!r}. Fix: give "
                    f"{', '.join(SUFFIXES)} files")


def batches(paths: list[Path], *, field: str = "text", txt_docs: TxtDocs = "blank",
            batch_bytes: int = BATCH_BYTES, ranges: list[Range | None] | None = None) -> Iterator[list[str]]:
    """The documents of `paths` (each whole, or its `ranges` entry), in order, in lists of about
    `batch_bytes` characters."""
    batch: list[str] = []
    size = 0
    for path, rng in zip(paths, ranges or [None] * len(paths)):
        try:
            for doc in documents(path, field=field, txt_docs=txt_docs, rng=rng):
                batch.append(doc)
                size += len(doc)
                if size >= batch_bytes:
                    yield batch
                    batch, size = [], 0
        except UnicodeDecodeError as exc:
            raise UserError(f"{path}: not UTF-8 text ({exc}). Fix: convert it to UTF-8") from exc
    if batch:
        yield batch
