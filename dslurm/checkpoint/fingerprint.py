"""The fingerprint of a generation (in-job; imports torch): what each rank held when it saved,
checked against what it holds after a restore, before the first step (docs/recovery.md, "A resume
that proves itself").

A checkpoint's crc32s prove that its files are the files that were written. They cannot prove that
the state a restore assembled is the state that was saved: a copy whose manifest was rewritten to
agree, shards put together from the wrong replicas (Megatron-LM #5281: a deterministic NaN after a
restore from replicas, 44 restarts in a loop) or a planner that mapped an item to the wrong file
all load without one bad checksum. So each rank also records, in its rank file, a crc32 of every
floating tensor it holds (its own shard of a DTensor), computed from the tensors themselves on a
helper thread while DCP writes; after dcp.load each rank computes the same from what it loaded.
A difference names the tensor, and the copy is refused like a corrupt one.

The check needs the same ranks holding the same shards: a restore onto another world size or
layout (a reshard) skips it, and says so.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

KEY = "fingerprint"  # the rank file's field


def floating_tensors(sd: Any, prefix: str = "") -> list[tuple[str, torch.Tensor]]:
    """(key, this rank's part) of every floating tensor in a (nested) state dict; DTensors by
    their local shard."""
    out: list[tuple[str, torch.Tensor]] = []
    if isinstance(sd, dict):
        for k, v in sd.items():
            out += floating_tensors(v, f"{prefix}{k}.")
    elif isinstance(sd, (list, tuple)):
        for i, v in enumerate(sd):
            out += floating_tensors(v, f"{prefix}{i}.")
    elif isinstance(sd, torch.Tensor) and sd.is_floating_point():
        local = sd.to_local() if hasattr(sd, "to_local") else sd
        if local.numel():
            out.append((prefix.rstrip("."), local))
    return out



def tensor_crc(t: torch.Tensor) -> str:
    """crc32 of a tensor's bytes as stored (any dtype, any device), 8 hex digits."""
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    raw = flat.contiguous().view(torch.uint8).numpy()
    return f"{zlib.crc32(raw.data):08x}"


def of_tensors(tensors: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """The fingerprint of one rank's floating tensors (floating_tensors)."""
    return {"tensors": {key: [tensor_crc(t), list(t.shape), str(t.dtype).removeprefix("torch.")]
                        for key, t in tensors}}


def mismatches(saved: dict[str, Any] | None, now: dict[str, Any]) -> list[tuple[str, str]]:
    """(tensor, what differs) for each tensor both name whose crc32, shape or dtype differs now.
    A saved tensor the restoring state does not hold is no mismatch (DCP loads what the state asks
    for: code that dropped a buffer resumes), nor is a new one. Empty when nothing was saved (an
    older generation). Pure."""
    if not saved:
        return []
    want, got = saved.get("tensors", {}), now.get("tensors", {})
    out = []
    for key in sorted(want.keys() & got.keys()):
        if list(got[key]) != list(want[key]):
            (c0, s0, d0), (c1, s1, d1) = want[key], got[key]
            if d0 != d1:  # restored into another dtype: DCP casts, so the bytes cannot be compared
                continue
            what = f"crc32 {c1} != saved {c0}" if (s0, d0) == (s1, d1) else f"{d1}{s1} != saved {d0}{s0}"
            out.append((key, what))
    return out


def check(rank_file: Path, state_dict: Any) -> list[str]:
    """This rank's problems with the state it now holds (`state_dict`, as a save would take it)
    against the fingerprint in its rank file: one line per tensor, "tensor KEY: what (fingerprint)"."""
    saved = json.loads(Path(rank_file).read_text()).get(KEY)
    return [f"tensor {key}: {what} (fingerprint)"
            for key, what in mismatches(saved, of_tensors(floating_tensors(state_dict)))]


def tensor_of(problem: str) -> str:
    """The tensor a fingerprint problem names ("" for any other problem). Pure."""
    if problem.startswith("tensor ") and problem.endswith("(fingerprint)"):
        return problem[len("tensor "):].split(": ", 1)[0]
    return ""
