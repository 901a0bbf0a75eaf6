"""The one gate every pickle dslurm reads from a run directory goes through (torch-free).

Why: a pickle runs code while it loads (`__reduce__` names any callable, `os.system` included),
and a run directory on a shared file system is writable by more people than the one who reads
it; a generation's manifest vouches for bytes, not for who wrote them (its crc32 and size are
easy to recompute). So nothing from a run directory is unpickled with `pickle.load`: DCP's
`.metadata` goes through `Restricted`, whose `find_class` hands out only the classes DCP's
metadata consists of (`ALLOWED`), and refuses anything else, naming the file and the class,
before any of it is called. Tensors and per-rank state go through `torch.load(weights_only=True)`
(torch's own restricted unpickler); Flight Recorder dumps hold plain values only (`ALLOWED` is
not consulted for them: `loads(..., allowed=frozenset())`).

`check_file` reads a pickle with stand-ins for the allowed classes (nothing is imported, nothing
is called), so `dslurm ckpt verify` and the restore's precheck refuse a hostile `.metadata`
without torch. docs/checkpoint.md, "What a checkpoint is trusted with".
"""

from __future__ import annotations

import importlib
import io
import pickle
import re
from pathlib import Path
from typing import Any

from dslurm.errors import UserError

_DCP_MD = "torch.distributed.checkpoint.metadata"

# (module, name) of every class DCP's `.metadata` holds (checked on torch 2.13 and 2.14): the metadata
# dataclasses, the storage records, tensor sizes, dtypes and layouts, and StorageMeta's path.
ALLOWED: frozenset[tuple[str, str]] = frozenset({
    (_DCP_MD, "Metadata"), (_DCP_MD, "MetadataIndex"), (_DCP_MD, "StorageMeta"),
    (_DCP_MD, "TensorStorageMetadata"), (_DCP_MD, "BytesStorageMetadata"),
    (_DCP_MD, "ChunkStorageMetadata"), (_DCP_MD, "TensorProperties"), (_DCP_MD, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib._local", "PosixPath"), ("pathlib._local", "PurePosixPath"),  # Python 3.13+
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
})

# torch's dtypes pickle as globals of `torch` (torch.float32); they are values, not callables.
DTYPES: frozenset[str] = frozenset({
    "float64", "float32", "float16", "bfloat16", "complex32", "complex64", "complex128", "uint8",
    "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64", "bool", "float8_e4m3fn",
    "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
    "qint8", "quint8", "qint32", "quint4x2", "quint2x4", "double", "float", "half", "cdouble",
    "cfloat", "chalf", "short", "int", "long",
})


class UnsafePickle(UserError):
    """A pickle in a run directory names a class no checkpoint holds; it was not loaded."""

    def __init__(self, source: str, module: str, name: str, own: str = "") -> None:
        self.source, self.cls = source, f"{module}.{name}"
        super().__init__(
            f"{source}: refused, it names the class {self.cls}, which no dslurm checkpoint holds (a "
            "pickle runs what it names while it loads, so it was not loaded and nothing of it ran); "
            "fix: someone or something rewrote this file, so do not use this generation: restore or "
            "export an older one (`dslurm ckpt ls --full`, `--generation`) and find out who can write "
            f"to the run directory{'; ' + own if own else ''} (docs/checkpoint.md, 'What a checkpoint "
            "is trusted with')")


def allowed(module: str, name: str, allow: frozenset[tuple[str, str]] = ALLOWED) -> bool:
    return (module, name) in allow or (allow is ALLOWED and module == "torch" and name in DTYPES)


class Restricted(pickle.Unpickler):
    """An Unpickler that hands out only `allow`'s classes (imported for real) and refuses the
    rest with UnsafePickle, before anything is called."""

    def __init__(self, file: Any, source: str, allow: frozenset[tuple[str, str]] = ALLOWED) -> None:
        super().__init__(file)
        self.source, self.allow = source, allow

    def find_class(self, module: str, name: str) -> Any:
        if not allowed(module, name, self.allow):
            raise UnsafePickle(self.source, module, name)
        return getattr(importlib.import_module(module), name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError(f"{self.source}: a persistent id {pid!r} (not a plain pickle)")


class _Stand:
    """What `check_file` hands out for an allowed class: takes any arguments and state, runs nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _Checker(Restricted):
    def find_class(self, module: str, name: str) -> Any:
        if not allowed(module, name, self.allow):
            raise UnsafePickle(self.source, module, name)
        return _Stand


def loads(data: bytes, source: str, allow: frozenset[tuple[str, str]] = ALLOWED) -> Any:
    """Unpickle `data` (read from `source`, which the errors name) allowing only `allow`'s classes.
    Raises UnsafePickle for any other class and pickle.UnpicklingError (or EOFError, ValueError)
    for bytes that are not a pickle."""
    return Restricted(io.BytesIO(data), source, allow).load()


def load_file(path: Path, allow: frozenset[tuple[str, str]] = ALLOWED) -> Any:
    with open(path, "rb") as f:
        return Restricted(f, str(path), allow).load()


def check_file(path: Path) -> str | None:
    """Read the pickle at `path` with stand-ins for the allowed classes (no import, no call).
    -> None when it holds only allowed classes, else why it is unreadable. Raises UnsafePickle
    when it names any other class."""
    try:
        with open(path, "rb") as f:
            _Checker(f, str(path)).load()
    except UnsafePickle:
        raise
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError, MemoryError, RecursionError, UnicodeDecodeError) as exc:
        return f"{path}: not a readable DCP metadata pickle ({type(exc).__name__}: {exc})"
    return None


def refuse_unsafe(path: Path) -> None:
    """Raise UnsafePickle when the pickle at `path` names a class outside ALLOWED; anything
    else (absent, unreadable) is left to the checks that name it."""
    if path.is_file():
        check_file(path)


def refused_by_torch(exc: Exception, source: str, own: str = "") -> UserError:
    """`torch.load(weights_only=True)`'s refusal (an UnpicklingError naming `GLOBAL module.name`)
    as UnsafePickle naming `source` and the class; any other unreadable bytes as a UserError."""
    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    if found is None:
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        return UserError(f"{source}: unreadable ({first}); fix: restore or export an older generation "
                         "(`dslurm ckpt ls --full`)")
    module, _, name = found.group(1).rpartition(".")
    return UnsafePickle(source, module, name, own)
