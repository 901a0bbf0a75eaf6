"""Writes that matter: temp file in the same directory, fsync, rename over, fsync the
directory. A reader (or a restart after kill -9 or power loss) sees the old content or the
new one, never half of one, and never a moment with no file at all. One implementation
for the pointer, manifests, reports, frozen configs, rendered scripts and cluster state.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename/creation in `path` durable (the entry lives in the directory, not the file)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> None:
    """Replace `path` with `data` atomically and durably. The temp file has `mode` from the
    start (mkstemp creates 0600, then fchmod before any byte is written), so a secret written
    with mode 0o400 is never readable by others, even for a moment."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write_text(path: str | os.PathLike[str], text: str, mode: int = 0o644) -> None:
    atomic_write_bytes(path, text.encode(), mode)
