"""`model.init_from`: a fresh run starts from published weights, each rank reading only its shard.

The directory is a Hugging Face one of a family the built-in decoder runs (Llama, Mistral, Qwen2,
Qwen3: dslurm/config/families.py; config.json, model.safetensors or numbered shards with
model.safetensors.index.json) or a `dslurm ckpt export --format safetensors` output (with --hf it
is the former; without, the tensors carry the built-in names and there is no config.json). The
job's model shape was read from that config.json when the job was loaded (`ModelSpec.shape`).
Used only when the restore found no generation: once one exists, resume wins, and the ledger's
`init_from` event says which happened.

Before anything is read, every rank checks the same things (so all of them fail together, before
any collective): config.json against the job's model shape (every differing field named, exit 2),
then every tensor the model needs is present with its full shape (the file and tensor named).

Then each parameter this rank holds (after TP/FSDP/PP: a DTensor whose placements give the global
box of its local shard, or a plain tensor) is filled from just that box. Reads are `os.pread`s of
the safetensors data (the format: an 8-byte header length, a JSON header of name -> dtype, shape,
byte range, then the raw data): safetensors' own `get_slice` maps the file, and a column slice then
touches every page of the tensor, which counts in the rank's resident memory. Rows are read in
blocks of at most BLOCK_BYTES, so a column shard costs its own bytes plus one block. q/k rows are
read as whole heads in HF's half-split order and put back into interleaved pairs
(hf_layout.from_half_split), then cut to the shard's rows; so are q/k biases and q/k norm weights.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dslurm.checkpoint import hf_layout
from dslurm.config import families
from dslurm.config.models import ModelShape
from dslurm.errors import UserError
from dslurm.observe import events

log = logging.getLogger(__name__)
CONFIG = families.CONFIG
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
BLOCK_BYTES = 8 << 20  # one read of a column shard's rows; the fixed part of a rank's load memory
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")  # activation checkpointing, compile


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file: where its bytes are."""

    file: Path
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


# ---------------------------------------------------------------- pure parts


def shape_message(where: Path, shape: ModelShape, differ: dict[str, Any], other: list[str]) -> str:
    """The exit-2 message of a config.json that does not fit the job's model (changed since the job
    was loaded, or a model the built-in decoder cannot run): every differing field, both values."""
    parts = [f"model.{f}: the job has {getattr(shape, f)}, {CONFIG} has {families.KEY_OF[f]}={v!r}"
             for f, v in differ.items()]
    return (f"model.init_from {where}: {CONFIG} does not match the job's model: " + "; ".join(parts + other)
            + f". Fix: drop the model's shape fields from the job (they then come from {CONFIG}), or point "
            "model.init_from at the weights the job was written for")


def wanted(shape: ModelShape, hf: bool) -> dict[str, tuple[str, int | None]]:
    """Built-in parameter name -> (its name in the files, heads whose q/k rows are in HF's order)."""
    return {name: (hf_layout.hf_name(name) if hf else name, hf_layout.rope_heads(name, shape) if hf else None)
            for name in hf_layout.expected_names(shape)}


def canonical(name: str) -> str:
    """A parameter name of a parallelised part as the unsplit model names it."""
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def read_header(path: Path) -> dict[str, Entry]:
    """The tensors of one safetensors file (only its header is read)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as exc:
        raise UserError(f"model.init_from: {path} is not a readable safetensors file ({exc}); "
                        "fix: re-download or re-export it") from None
    base = 8 + n
    return {k: Entry(path, v["dtype"], tuple(v["shape"]), base + v["data_offsets"][0], base + v["data_offsets"][1])
            for k, v in header.items() if k != "__metadata__"}


def open_dir(path: Path) -> dict[str, Entry]:
    """Every tensor of the directory's safetensors files, by name."""
    if not path.is_dir():
        raise UserError(f"model.init_from {path}: not a directory; give a Hugging Face Llama directory or a "
                        "`dslurm ckpt export --format safetensors` output (a relative path is taken from the "
                        f"job's working directory, here {Path.cwd()})")
    if (path / INDEX).is_file():
        weight_map = json.loads((path / INDEX).read_text()).get("weight_map", {})
        files = sorted(set(weight_map.values()))
        if missing := [f for f in files if not (path / f).is_file()]:
            raise UserError(f"model.init_from {path}: {INDEX} names {', '.join(missing)}, which is missing; "
                            "fix: copy the whole directory (every shard) or re-export it")
    elif (path / SINGLE).is_file():
        files = [SINGLE]
    else:
        torch_files = sorted(p.name for p in path.glob("pytorch_model*.bin"))
        hint = (f"it holds {', '.join(torch_files)}: re-export with `dslurm ckpt export --format safetensors`"
                if torch_files else "fix: give the directory that holds the weights")
        raise UserError(f"model.init_from {path}: no {SINGLE} and no {INDEX}; {hint}")
    out: dict[str, Entry] = {}
    for f in files:
        out.update(read_header(path / f))
    return out


def check_tensors(path: Path, entries: dict[str, Entry], want: dict[str, tuple[str, int | None]],
                  shape: ModelShape) -> None:
    """Every tensor the model needs, present with its full shape and a floating dtype."""
    from dslurm.checkpoint.export import natural_key

    full = hf_layout.full_shapes(shape)
    problems = []
    for name, (src, _) in sorted(want.items(), key=lambda kv: natural_key(kv[0])):
        e = entries.get(src)
        if e is None:
            problems.append(f"no file holds {src} (the job's {name})")
        elif e.shape != full[name]:
            problems.append(f"{e.file.name} holds {src} with shape {list(e.shape)}, the job's model needs "
                            f"{list(full[name])}")
        elif e.dtype not in _DTYPES:
            problems.append(f"{e.file.name} holds {src} as {e.dtype}; a floating type is needed")
    if problems:
        more = f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""
        raise UserError(f"model.init_from {path}: " + "; ".join(problems[:5]) + more + ". Fix: the directory "
                        "must hold every tensor of the job's model at its shape: complete it (every shard of "
                        "the index), or make the job's model: match the weights' config.json")


# ---------------------------------------------------------------- reading the shards


def _bytes(t: torch.Tensor) -> Any:
    """The bytes of a contiguous CPU tensor, writable in place (any dtype, bf16 included)."""
    return t.detach().reshape(-1).view(torch.uint8).numpy().data


def read_box(e: Entry, offset: tuple[int, ...], size: tuple[int, ...], into: torch.Tensor | None = None
             ) -> torch.Tensor:
    """The box [offset, offset + size) of one tensor. A box of whole rows (dim 0 cut only) is one
    pread straight into `into` (a contiguous CPU tensor of the file's dtype: the parameter's own
    memory, so the bytes are copied once, by the kernel) or into a new tensor; otherwise rows are
    read in blocks of at most BLOCK_BYTES, each cut to the box's other dims at once."""
    dtype = _DTYPES[e.dtype]
    item = torch.empty((), dtype=dtype).element_size()
    row = item * (int(torch.Size(e.shape[1:]).numel()) if len(e.shape) > 1 else 1)
    fd = os.open(e.file, os.O_RDONLY)
    try:
        if tuple(size[1:]) == tuple(e.shape[1:]):
            direct = (into is not None and into.device.type == "cpu" and into.dtype == dtype
                      and into.is_contiguous() and tuple(into.shape) == tuple(size))
            out = into if direct and into is not None else torch.empty(size, dtype=dtype)
            if out.numel():
                _pread_into(fd, _bytes(out), e.begin + offset[0] * row, e.file)
            return out
        inner = tuple(slice(o, o + s) for o, s in zip(offset[1:], size[1:]))
        out = torch.empty(size, dtype=dtype)
        per = max(1, BLOCK_BYTES // max(row, 1))
        for r in range(0, size[0], per):
            n = min(per, size[0] - r)
            buf = bytearray(n * row)
            _pread_into(fd, buf, e.begin + (offset[0] + r) * row, e.file)
            out[r:r + n] = torch.frombuffer(buf, dtype=dtype).view(n, *e.shape[1:])[(slice(None), *inner)]
        return out
    finally:
        os.close(fd)


def _pread_into(fd: int, buf: Any, start: int, path: Path) -> None:
    view, done = memoryview(buf), 0
    while done < len(buf):
        got = os.preadv(fd, [view[done:]], start + done)
        if got <= 0:
            raise UserError(f"model.init_from: {path} ends early (read {done} of {len(buf)} bytes at {start}); "
                            "fix: re-download or re-export it")
        done += got


def read_local(e: Entry, offset: tuple[int, ...], size: tuple[int, ...], heads: int | None,
               into: torch.Tensor | None = None) -> torch.Tensor:
    """This shard's box of a built-in tensor (read into `into` where it can be: `read_box`); q/k
    rows (heads given) are read as whole heads in HF's order, reordered to interleaved pairs, then
    cut to the box."""
    if heads is None or size[0] == 0:
        return read_box(e, offset, size, into)
    head_dim = e.shape[0] // heads
    first, end = hf_layout.head_span(offset[0], offset[0] + size[0], head_dim)
    rows = read_box(e, (first * head_dim, *offset[1:]), ((end - first) * head_dim, *size[1:]))
    interleaved: torch.Tensor = hf_layout.from_half_split(rows, end - first)
    skip = offset[0] - first * head_dim
    return interleaved[skip:skip + size[0]]


def local_box(p: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """(the local tensor to fill, its global offset, its shape) of a parameter."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = p.to_local()
        size, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        if tuple(size) != tuple(local.shape):
            raise RuntimeError(f"init_from: local shard {tuple(local.shape)} of a {tuple(p.shape)} parameter is "
                               f"not the box {tuple(size)} at {tuple(offset)} its placements {p.placements} give")
        return local, tuple(offset), tuple(size)
    return p, (0,) * p.dim(), tuple(p.shape)


@dataclass
class Loaded:
    tensors: int = 0
    bytes_read: int = 0
    shard_bytes: int = 0
    seconds: float = 0.0


def load(path: Path, shape: ModelShape, parts: list[torch.nn.Module]) -> Loaded:
    """Check the directory against the job's model, then fill this rank's parameters from it."""
    t0 = time.monotonic()
    if (path / CONFIG).is_file():
        differ, other = families.config_problems(families.read_config(path, f"model.init_from {path}"), shape)
        if differ or other:
            raise UserError(shape_message(path, shape, differ, other))
    entries = open_dir(path)
    hf = any(k.startswith("model.") for k in entries)
    if hf and not (path / CONFIG).is_file():
        raise UserError(f"model.init_from {path}: Hugging Face tensor names but no {CONFIG}; fix: copy the "
                        "model's config.json into the directory (its shape is checked against the job's)")
    want = wanted(shape, hf)
    check_tensors(path, entries, want, shape)
    out = Loaded()
    with torch.no_grad():
        for part in parts:
            for name, p in part.named_parameters():
                src, heads = want[canonical(name)]
                local, offset, size = local_box(p)
                t = read_local(entries[src], offset, size, heads, into=local)
                if t is not local:  # another dtype, a GPU, a column shard, reordered q/k rows
                    local.copy_(t)
                out.tensors += 1
                out.bytes_read += t.numel() * t.element_size()
                out.shard_bytes += local.numel() * local.element_size()
    out.seconds = time.monotonic() - t0
    return out


def start(resolved: Any, parts: list[torch.nn.Module], restored: Any) -> events.InitFrom:
    """The trainer's call once the restore has run: load `model.init_from` on a fresh start, or
    say that the run resumed from a generation instead. The event is for rank 0 to write."""
    path = Path(resolved.job.model.init_from).expanduser()
    if restored is not None:
        log.info("model.init_from %s not used: resumed from generation %s (step %d)", path,
                 restored.generation, restored.step)
        return events.InitFrom(path=str(path), action="resumed", generation=restored.generation,
                               step=restored.step)
    got = load(path, resolved.shape, parts)
    log.info("model.init_from %s: %d tensors, %d bytes read by this rank in %.2f s", path, got.tensors,
             got.bytes_read, got.seconds)
    return events.InitFrom(path=str(path), action="loaded", tensors=got.tensors, bytes_read=got.bytes_read,
                           load_s=round(got.seconds, 3))
