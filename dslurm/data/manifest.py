"""The manifest of a sharded tokenization: which shards, how many tokens, which tokenizer.

`manifest.json` sits next to its shards (each an HDF5 token file, `dslurm.data.tokenize`):

    {"format": "dslurm-manifest", "version": 1, "vocab_size": N, "dtype": "uint16",
     "n_tokens": T,
     "tokenizer": {"hash": ..., "vocab_size": ..., "bos_id": ..., "eos_id": ..., "path": ...},
     "shards": [{"path": "shard-00000.h5", "n_tokens": ..., "inputs": [{"path", "size", "mtime"}]}],
     "inputs": [{"path", "size", "mtime"}, ...]}

Shard paths are relative to the manifest's folder (the folder can be moved as a whole).
The trainer reads the token stream through `token_sources`: one token file, a manifest or a
folder holding one. Torch-free (json + the format module).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dslurm.durable import atomic_write_text
from dslurm.errors import UserError

FORMAT = "dslurm-manifest"
VERSION = 1
FILENAME = "manifest.json"


@dataclass(frozen=True, slots=True)
class Shard:
    """One token file of a tokenization: its absolute path and its token count."""

    path: Path
    n_tokens: int


@dataclass(frozen=True, slots=True)
class Manifest:
    """A read, validated manifest. `tokenizer` holds hash, vocab_size, bos_id, eos_id, path."""

    path: Path
    shards: list[Shard]
    n_tokens: int
    vocab_size: int
    dtype: str
    tokenizer: dict[str, Any] = field(default_factory=dict)
    inputs: list[dict[str, Any]] = field(default_factory=list)


def manifest_path(path: str | Path) -> Path:
    """`path` itself when it is a file, else `path/manifest.json`."""
    p = Path(path)
    return p / FILENAME if p.is_dir() else p


def _fix_rerun(mpath: Path) -> str:
    return (f"Fix: re-run the same `dslurm data tokenize ... --out {mpath.parent}` command; it "
            f"redoes only missing or partial shards")


def _field(raw: dict[str, Any], key: str, kind: type, mpath: Path, where: str = "") -> Any:
    if key not in raw or not isinstance(raw[key], kind) or isinstance(raw[key], bool):
        got = repr(raw.get(key, "<missing>"))
        raise UserError(f"{mpath}: field {where}{key!r} is {got}; expected {kind.__name__}. "
                        f"Fix: regenerate the manifest with `dslurm data tokenize`")
    return raw[key]


def parse_manifest(raw: Any, mpath: Path) -> Manifest:
    """Check the JSON's shape and build a Manifest (shard paths resolved; files not touched)."""
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise UserError(f"{mpath}: not a dslurm manifest (format is not {FORMAT!r}). "
                        f"Fix: give a manifest.json written by `dslurm data tokenize`")
    if raw.get("version") != VERSION:
        raise UserError(f"{mpath}: manifest version {raw.get('version')!r}; this dslurm reads "
                        f"version {VERSION}. Fix: re-tokenize with this dslurm")
    shards = []
    for i, s in enumerate(_field(raw, "shards", list, mpath)):
        if not isinstance(s, dict):
            raise UserError(f"{mpath}: shards[{i}] is not an object. {_fix_rerun(mpath)}")
        rel = _field(s, "path", str, mpath, f"shards[{i}].")
        n = _field(s, "n_tokens", int, mpath, f"shards[{i}].")
        shards.append(Shard(path=(mpath.parent / rel).resolve(), n_tokens=n))
    total = _field(raw, "n_tokens", int, mpath)
    if total != sum(s.n_tokens for s in shards):
        raise UserError(f"{mpath}: n_tokens {total} != sum of the shards' "
                        f"{sum(s.n_tokens for s in shards)}. {_fix_rerun(mpath)}")
    return Manifest(path=mpath.resolve(), shards=shards, n_tokens=total,
                    vocab_size=_field(raw, "vocab_size", int, mpath),
                    dtype=_field(raw, "dtype", str, mpath),
                    tokenizer=dict(raw.get("tokenizer") or {}),
                    inputs=list(raw.get("inputs") or []))


def check_shards(m: Manifest) -> None:
    """Every shard exists and holds exactly the tokens the manifest says (header read only)."""
    from dslurm.data.tokenize import read_info

    for s in m.shards:
        if not s.path.is_file():
            raise UserError(f"{m.path}: shard {s.path} is missing. {_fix_rerun(m.path)}")
        info = read_info(s.path)
        if info.n_tokens != s.n_tokens:
            raise UserError(f"{s.path}: {info.n_tokens} tokens but the manifest {m.path} says "
                            f"{s.n_tokens} (a partial or replaced shard). Fix: delete {s.path} "
                            f"and re-run the tokenize command; it redoes that shard")
        if info.vocab_size != m.vocab_size:
            raise UserError(f"{s.path}: vocab_size {info.vocab_size} but the manifest says "
                            f"{m.vocab_size}. {_fix_rerun(m.path)}")


def read_manifest(path: str | Path, *, check: bool = True) -> Manifest:
    """Read `path` (a manifest.json or a folder holding one); with `check`, the shards too."""
    mpath = manifest_path(path)
    if not mpath.is_file():
        raise UserError(f"{mpath}: no manifest. Fix: run `dslurm data tokenize ... --out "
                        f"{mpath.parent}` (it writes {FILENAME} when every shard is done)")
    try:
        raw = json.loads(mpath.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"{mpath}: not readable JSON ({exc}). {_fix_rerun(mpath)}") from exc
    m = parse_manifest(raw, mpath)
    if check:
        check_shards(m)
    return m


def write_manifest(path: str | Path, raw: dict[str, Any]) -> Path:
    """Write the manifest JSON durably (dslurm.durable) after checking its shape."""
    mpath = manifest_path(path)
    parse_manifest(raw, mpath)
    atomic_write_text(mpath, json.dumps(raw, indent=1, sort_keys=True) + "\n")
    return mpath


def token_sources(path: str | Path) -> list[Shard]:
    """The token files behind `path`: one HDF5 token file, a manifest.json, or its folder."""
    p = Path(path)
    if p.is_dir() or p.suffix == ".json":
        return read_manifest(p).shards
    from dslurm.data.tokenize import read_info

    return [Shard(path=p.resolve(), n_tokens=read_info(p).n_tokens)]


def format_manifest(m: Manifest) -> str:
    """Human-readable summary of a read (and checked) manifest."""
    t = m.tokenizer
    lines = [
        f"manifest    {m.path}",
        f"tokens      {m.n_tokens:,} ({m.dtype}) in {len(m.shards)} shards, all present and complete",
        f"vocab_size  {m.vocab_size}",
        f"tokenizer   {t.get('path')}  sha256 {str(t.get('hash', ''))[:16]}  bos_id "
        f"{t.get('bos_id')}  eos_id {t.get('eos_id')}",
        f"inputs      {len(m.inputs)} files, {sum(int(f.get('size', 0)) for f in m.inputs) / 1e6:.1f} MB",
    ]
    lines += [f"  {s.path.name}  {s.n_tokens:,} tokens" for s in m.shards[:20]]
    if len(m.shards) > 20:
        lines.append(f"  ... {len(m.shards) - 20} more")
    return "\n".join(lines)
