"""Documents out of input files: `.txt`, `.jsonl`, `.parquet`, streamed in batches.

* `.txt`: `txt_docs="blank"` (default): one document per block of lines, blocks separated by
  one or more blank (whitespace-only) lines; the document is the block's lines with their line
  breaks, the last line break dropped. `txt_docs="file"`: the whole file is one document.
* `.jsonl`: one JSON object per line; the document is its `field` (default "text"). Empty
  lines are skipped; a line without the field, or whose value is not a string, is an error
  naming the file and line. A null value is skipped (no document).
* `.parquet`: the column `field`, read one row group at a time (never the whole file);
  null values are skipped; a file without the column is an error listing its columns.

Every error is a UserError naming the file, the line or field, and the fix. Torch-free.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from dslurm.errors import UserError

TxtDocs = Literal["blank", "file"]
SUFFIXES = (".txt", ".jsonl", ".parquet")
BATCH_BYTES = 1 << 20
"""A batch of documents is handed to the tokenizer once it holds about this many characters."""


def find_inputs(paths: list[str | Path]) -> list[Path]:
    """Input files, in a fixed order: each file as given, each folder's .txt/.jsonl/.parquet
    files (recursively) sorted by path. A missing path or a folder with none is an error."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in SUFFIXES)
            if not found:
                raise UserError(f"{p}: no {', '.join(SUFFIXES)} files in this folder. "
                                f"Fix: point at the folder that holds the data")
            out += found
        elif p.is_file():
            if p.suffix not in SUFFIXES:
                raise UserError(f"{p}: unknown input type {p.suffix!r}. Fix: give "
                                f"{', '.join(SUFFIXES)} files (the type is read from the suffix)")
            out.append(p)
        else:
            raise UserError(f"{p}: no such file or folder. Fix: give existing input files")
    return [p.resolve() for p in out]


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


def _jsonl(path: Path, field: str) -> Iterator[str]:
    fix = f"Fix: give the right field with --field NAME (now {field!r})"
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise UserError(f"{path}:{n}: not a JSON line ({exc}). Fix: one JSON object per "
                                f"line; repair or remove line {n}") from exc
            if not isinstance(obj, dict) or field not in obj:
                keys = ", ".join(map(repr, obj)) if isinstance(obj, dict) else type(obj).__name__
                raise UserError(f"{path}:{n}: no field {field!r} (this line has: {keys}). {fix}")
            value = obj[field]
            if value is None:
                continue
            if not isinstance(value, str):
                raise UserError(f"{path}:{n}: field {field!r} is a {type(value).__name__}, not a "
                                f"string. {fix}")
            yield value


def _parquet(path: Path, field: str) -> Iterator[str]:
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
    for g in range(pf.num_row_groups):
        col = pf.read_row_group(g, columns=[field]).column(0)
        for value in col.to_pylist():
            if value is None:
                continue
            if not isinstance(value, str):
                raise UserError(f"{path}: column {field!r} holds {type(value).__name__}, not "
                                f"strings. Fix: give the text column with --field NAME")
            yield value


def documents(path: Path, *, field: str = "text", txt_docs: TxtDocs = "blank") -> Iterator[str]:
    """The documents of one input file, in file order."""
    if path.suffix == ".jsonl":
        return _jsonl(path, field)
    if path.suffix == ".parquet":
        return _parquet(path, field)
    if path.suffix == ".txt":
        return _txt(path, txt_docs)
    raise UserError(f"{path}: unknown input type {path.suffix!r}. Fix: give "
                    f"{', '.join(SUFFIXES)} files")


def batches(paths: list[Path], *, field: str = "text", txt_docs: TxtDocs = "blank",
            batch_bytes: int = BATCH_BYTES) -> Iterator[list[str]]:
    """The documents of `paths`, in order, in lists of about `batch_bytes` characters."""
    batch: list[str] = []
    size = 0
    for path in paths:
        try:
            for doc in documents(path, field=field, txt_docs=txt_docs):
                batch.append(doc)
                size += len(doc)
                if size >= batch_bytes:
                    yield batch
                    batch, size = [], 0
        except UnicodeDecodeError as exc:
            raise UserError(f"{path}: not UTF-8 text ({exc}). Fix: convert it to UTF-8") from exc
    if batch:
        yield batch
