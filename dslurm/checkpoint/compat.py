"""Which DCP internals this torch offers the checkpoint fast paths, detected, never assumed
(issue 34: a site brings its own torch). Imported by the in-job checkpoint code (imports torch).

The fast paths lean on torch.distributed.checkpoint beyond its public API:
  - the crc32 streamed while DCP writes: `FileSystemWriter.fs`, the FileSystem its write_data
    and finish go through (dslurm.checkpoint.io.crc_writer, twotier.NodeWriter);
  - the restore that reads each stored tensor straight into the model: a copy of
    `FileSystemReader.read_data` (io.CrcReader), which needs the reader's `storage_data`, `fs`,
    `path` and `transforms`, and `narrow_tensor_by_index` (a private torch helper).
Each is detected here. Without one, the public DCP path does the work and the checks stay whole:
a plain FileSystemWriter, whose files are checksummed by reading them back after the save
(`checkpoint.checksum_files`), and a plain FileSystemReader, after which the manager reads every
byte nobody summed (`coverage.verify_reads`): slower, never unchecked. DSLURM_DCP_PUBLIC=1 forces
the public path (tests/integration/test_checkpoint_compat.py restores bit for bit through it).
The torch range tested is declared in pyproject.toml and docs/checkpoint.md.
"""

from __future__ import annotations

import os
from typing import Any

import torch

PUBLIC_ENV = "DSLURM_DCP_PUBLIC"
"""set to 1: every fast path off, the public DCP path only"""


def public_only() -> bool:
    return os.environ.get(PUBLIC_ENV, "") == "1"


def _torch_narrow() -> Any:
    try:
        from torch.distributed._shard._utils import narrow_tensor_by_index
    except ImportError:  # moved or gone in this torch: the copy below
        return None
    return narrow_tensor_by_index


def _narrow(tensor: torch.Tensor, offsets: Any, sizes: Any) -> torch.Tensor:
    """torch's narrow_tensor_by_index (2.5-2.14: the same few lines): the [offsets, offsets +
    sizes) box of `tensor`, a view."""
    out = tensor
    for dim, (offset, size) in enumerate(zip(offsets, sizes)):
        if size < tensor.size(dim):
            out = out.narrow(dim, offset, size)
    return out


def narrow_tensor_by_index(tensor: torch.Tensor, offsets: Any, sizes: Any) -> torch.Tensor:
    fn = None if public_only() else _torch_narrow()
    return (fn or _narrow)(tensor, offsets, sizes)


def writer_streams(writer: Any) -> bool:
    """Does this FileSystemWriter write through a replaceable `fs` (a FileSystem)?"""
    from torch.distributed.checkpoint.filesystem import FileSystem

    return not public_only() and isinstance(getattr(writer, "fs", None), FileSystem)


READER_NEEDS = ("storage_data", "fs", "path", "transforms")


def reader_fast(reader: Any) -> bool:
    """Can io.CrcReader's own read_data run on this torch's FileSystemReader? Checked once DCP
    set the reader up (storage_data comes from the metadata), before any byte is read."""
    from torch.distributed.checkpoint.planner import LoadItemType

    if public_only() or not hasattr(LoadItemType, "BYTE_IO"):
        return False
    if not all(hasattr(reader, a) for a in READER_NEEDS):
        return False
    return hasattr(reader.transforms, "transform_load_stream") and hasattr(reader.fs, "concat_path")
