"""`dslurm ckpt export`: one generation's model weights as plain files that other tools read.

The generation may have been saved by any layout (FSDP x TP x PP): DCP's .metadata records every
tensor's full shape, so an empty full-size tensor per model key, loaded with `dcp.load(no_dist=True)`
in this one process, is filled by DCP's own resharding reader; no process group, no model code.
Only the entries under the model's key are read (not the optimizer's, about twice their size).

The output directory holds one file (model.safetensors / pytorch_model.bin) or, with a size limit,
numbered shards and the Hugging Face index json (weight_map: name -> file), plus export.json
(where the weights came from). Each output shard is loaded, cast and written before the next,
so memory stays near one shard. Everything is written into a hidden sibling directory and renamed
into place at the end: an export that stopped part-way never looks complete.

torch (and safetensors) are imported inside functions: the CLI imports this module.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dslurm import checkpoint as ck
from dslurm.checkpoint import hf_layout, unpickle
from dslurm.config import families
from dslurm.config.models import ModelShape
from dslurm.durable import fsync_dir
from dslurm.errors import UserError

FORMATS = ("torch", "safetensors")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # flag -> torch dtype name
# (stem, suffix) of the weight files and the index name: the Hugging Face conventions.
_FILES = {"torch": ("pytorch_model", "bin"), "safetensors": ("model", "safetensors")}
INDEX = {"torch": "pytorch_model.bin.index.json", "safetensors": "model.safetensors.index.json"}
INFO = "export.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


# ---------------------------------------------------------------- pure parts


def parse_size(text: str) -> int:
    """'5GB' -> 5_000_000_000 (decimal units as Hugging Face uses them; KiB/MiB/GiB are binary);
    a plain number is bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", text.upper())
    if not m or m.group(2) not in _UNITS or float(m.group(1)) * _UNITS[m.group(2)] < 1:
        raise UserError(f"--max-shard-size {text!r}: not a size; write e.g. 5GB, 500MB, 2GiB or a number "
                        "of bytes (more than 0)")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def plan_shards(sizes: list[tuple[str, int]], max_bytes: int | None) -> list[list[str]]:
    """Names grouped into files in the given order: a new file starts when the next tensor would
    take the current one past max_bytes (None: everything in one file). A tensor larger than the
    limit gets a file of its own, as transformers' save_pretrained does."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, size in sizes:
        if max_bytes is not None and shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards if shards[0] else []


def file_names(fmt: str, n: int) -> list[str]:
    """model.safetensors for one file; model-00001-of-00003.safetensors ... for n shards."""
    stem, suffix = _FILES[fmt]
    if n == 1:
        return [f"{stem}.{suffix}"]
    return [f"{stem}-{i:05d}-of-{n:05d}.{suffix}" for i in range(1, n + 1)]


def index_doc(shards: list[list[str]], files: list[str], total_size: int) -> dict[str, Any]:
    """The index json: total byte size and which file holds each tensor."""
    weight_map = {name: f for names, f in zip(shards, files) for name in names}
    return {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}


def natural_key(name: str) -> list[Any]:
    """layers.2 before layers.10: digit runs compare as numbers."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", name)]


_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4,
             "int16": 2, "int8": 1, "uint8": 1, "bool": 1}
_FLOATS = ("float64", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Item:
    """One tensor of the export: its name in the output, its key in the generation, and how it
    is turned into the output tensor."""

    name: str
    key: str
    shape: tuple[int, ...]
    src_dtype: str  # torch name, e.g. float32
    out_dtype: str
    heads: int | None = None  # --hf q/k: reorder the rows of this many heads

    @property
    def out_bytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE.get(self.out_dtype, 8)



def plan_items(entries: dict[str, tuple[tuple[int, ...], str]], key: str, dtype: str | None,
               shape: ModelShape | None) -> list[Item]:
    """What to write, in output order, from the generation's tensor entries {key: (shape, dtype)}
    under `key` (e.g. model.layers.0.attention.wq.weight). `shape` given: the HF layout of its family
    (a tied output projection, saved under both names, written once as the embedding)."""
    prefix = f"{key}."
    names = {k[len(prefix):]: k for k in entries if k.startswith(prefix)}
    if shape is not None and shape.tie_embeddings:
        names.pop("output.weight", None)
    if not names:
        tops = sorted({k.split(".", 1)[0] for k in entries})
        raise UserError(f"--key {key}: the generation holds no tensors under {key!r} (it has: "
                        f"{', '.join(tops) or 'none'}); name the entry holding the model with --key")
    if shape is not None:
        want = hf_layout.expected_names(shape)
        missing, extra = sorted(set(want) - set(names)), sorted(set(names) - set(want))
        if missing or extra:
            raise UserError(f"--hf: the saved model is not the built-in {shape.family} of {shape}: "
                            f"missing {missing[:5]}, unexpected {extra[:5]}; export without --hf")
    items = []
    for name, full in names.items():
        dims, src = entries[full]
        out = dtype if dtype is not None and src in _FLOATS else src
        if shape is None:
            items.append(Item(name, full, dims, src, out))
        else:
            items.append(Item(hf_layout.hf_name(name), full, dims, src, out, hf_layout.rope_heads(name, shape)))
    return sorted(items, key=lambda it: natural_key(it.name))


# ---------------------------------------------------------------- the export


@dataclass
class ExportResult:
    out: Path
    generation: str
    step: int
    files: list[str]
    tensors: int
    total_bytes: int


def _problems(gen: Path, pointer_crc: str | None) -> list[str]:
    problems = ck.verify_generation(gen, full=True, pointer_crc=pointer_crc)
    if (gen / ck.REJECTED).exists():
        problems.append(f"{gen / ck.REJECTED}: a restore found this generation corrupt")
    return problems


def _check_out(out: Path) -> None:
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise UserError(f"-o {out}: exists and is not an empty directory; give a new directory "
                        "(the export is renamed into place whole)")
    if not out.parent.is_dir():
        raise UserError(f"-o {out}: its parent directory {out.parent} does not exist; create it first")


def entries(gen: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from dslurm.checkpoint.io import SafeReader

    try:
        md = SafeReader(gen).read_metadata()
        return {k: (tuple(v.size), str(v.properties.dtype).removeprefix("torch."))
                for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    except (AttributeError, TypeError, ValueError) as exc:  # a pickle, but not DCP's metadata
        raise UserError(f"{gen / '.metadata'}: not DCP metadata ({type(exc).__name__}: {exc}); fix: export "
                        "another generation with --generation (`dslurm ckpt ls --full` lists them)") from None


def load_items(gen: Path, items: list[Item]) -> dict[str, Any]:
    """Full tensors of these items (output names, output dtype and row order), resharded by DCP."""
    import warnings

    import torch
    import torch.distributed.checkpoint as dcp

    from dslurm.checkpoint.io import SafeLoadPlanner, SafeReader

    bufs = {it.key: torch.empty(it.shape, dtype=getattr(torch, it.src_dtype)) for it in items}
    with warnings.catch_warnings():  # single-process use is the point here; DCP warns about it
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(bufs, storage_reader=SafeReader(gen), planner=SafeLoadPlanner(), no_dist=True)
    out = {}
    for it in items:
        t = bufs.pop(it.key)
        if it.heads is not None:
            t = hf_layout.to_half_split(t, it.heads)
        out[it.name] = t.to(getattr(torch, it.out_dtype)).contiguous()
    return out


def _write_file(fmt: str, tensors: dict[str, Any], path: Path) -> None:
    if fmt == "safetensors":
        from safetensors.torch import save_file
        save_file(tensors, str(path), metadata={"format": "pt"})  # transformers checks "format"
    else:
        import torch
        torch.save(tensors, path)
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)  # safetensors creates 0600; a weights file is for others to read
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def export(gen: Path, out: Path, *, fmt: str, dtype: str | None = None, max_shard_bytes: int | None = None,
           hf: bool = False, key: str = "model", pointer_crc: str | None = None,
           progress: Callable[[str], None] = lambda _: None) -> ExportResult:
    """Write generation `gen`'s model weights into the new directory `out`. `dtype` is a key of
    DTYPES (None: as saved; with `hf`, the dtype of the config.json the run started from, when it
    had one). Refuses a generation that fails `dslurm ckpt verify`."""
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"--dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    _check_out(out)
    progress(f"verifying {gen.name} (every file's crc32)")
    unpickle.refuse_unsafe(gen / ".metadata")  # exit 2 naming the class before anything else
    if md_problems := ck.metadata_problems(gen):
        raise UserError(f"{md_problems[0]}; fix: export another generation with --generation "
                        "(`dslurm ckpt ls --full` lists them)")
    if problems := _problems(gen, pointer_crc):
        raise ck.CheckpointError(f"refusing to export {gen}, it fails verification: " + "; ".join(problems)
                                 + "; pick a sound one with --generation (`dslurm ckpt ls --full`)")
    meta = json.loads((gen / ck.META).read_text())
    shape = None
    if hf:
        if not isinstance(meta.get("model_shape"), dict):
            raise UserError(f"--hf: {gen / ck.META} records no model_shape; only the built-in "
                            "trainer's model can be mapped (export without --hf)")
        shape = ModelShape.from_record(meta["model_shape"])
    out_dtype = DTYPES[dtype] if dtype else (shape.dtype if shape is not None else None)
    items = plan_items(entries(gen), key, out_dtype, shape)
    shards = plan_shards([(it.name, it.out_bytes) for it in items], max_shard_bytes)
    files = file_names(fmt, len(shards))
    by_name = {it.name: it for it in items}
    tmp = out.parent / f".{out.name}.partial-{secrets.token_hex(3)}"
    tmp.mkdir()
    try:
        for names, fname in zip(shards, files):
            progress(f"writing {fname} ({len(names)} tensors)")
            _write_file(fmt, load_items(gen, [by_name[n] for n in names]), tmp / fname)
        total = sum(it.out_bytes for it in items)
        if len(files) > 1:
            ck.atomic_write_json(tmp / INDEX[fmt], index_doc(shards, files, total))
        if shape is not None:
            ck.atomic_write_json(tmp / "config.json", families.hf_config(shape, items[0].out_dtype))
        ck.atomic_write_json(tmp / INFO, {
            "generation": gen.name, "step": meta.get("step"), "run_dir": str(gen.parent.parent.resolve()),
            "format": fmt, "dtype": dtype or out_dtype or "as saved",
            "layout": f"hf-{shape.family}" if shape is not None else "built-in",
            "key": key, "files": files, "tensors": len(items), "total_size": total})
        fsync_dir(tmp)
        os.rename(tmp, out)  # replaces an empty `out` directory; one step from nothing to complete
        fsync_dir(out.parent)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception) and not isinstance(exc, UserError):  # e.g. ENOSPC, a shard gone
            raise ck.CheckpointError(f"export of {gen} into {out} failed, nothing was left there: "
                                     f"{type(exc).__name__}: {exc}") from exc
        raise
    return ExportResult(out, gen.name, int(meta.get("step", ck.parse_step(gen.name) or 0)), files,
                        len(items), total)
