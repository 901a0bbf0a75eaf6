"""Per-rank state in a generation: each rank saves its own, each rank gets its own back (in-job).

Why: DCP keeps ONE copy of a plain tensor or value saved under the same key on every rank (it
is taken for replicated), so a per-rank data stream (a `torch.Generator` seeded by rank, a
sampler's position, torchdata's `StatefulDataLoader`, a counter of the rank's own) saved through
DCP comes back as one rank's state on every rank: the resumed run silently trains on other data.

So everything a script hands `dslurm.runtime.Checkpoint` that is not a model, an optimizer or
marked `shared(...)` is per-rank state: pickled by this rank at the save call (a snapshot, also
for async saves), written into the generation's `ranks/rank-NNNNN.json` beside the rank's RNG
streams (so the manifest's crc32 covers it), and loaded back by the same rank.

On a resume with another world size, an entry that knows how to reshard (its
`per_rank(obj, reshard=fn)`, or a torch `DataLoader` over a `DistributedSampler`, built in:
`reshard_distributed_loader`) gets its new state from all the old ranks' states; anything
else is refused with an error naming the entry. Even a state that is identical on every old
rank: a loader's position is the same number on every rank and still means "of my own slice".
State that really is one for the job (a scheduler, an epoch counter) belongs in DCP:
`shared(obj)`, which schedulers and GradScalers are by default.
"""

from __future__ import annotations

import base64
import io
import json
import pickle
import zlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dslurm import checkpoint as ck
from dslurm.checkpoint.unpickle import refused_by_torch
from dslurm.errors import UserError

# reshard(obj, old_states, new_rank, new_world) -> the state for this rank (or raise ValueError)
Resharder = Callable[[Any, list[Any], int, int], Any]


class GeneratorState:
    """A `torch.Generator` (or numpy `Generator`) as a Stateful: its stream position."""

    def __init__(self, gen: Any) -> None:
        self.gen = gen

    def state_dict(self) -> dict[str, Any]:
        if isinstance(self.gen, torch.Generator):
            return {"torch": self.gen.get_state()}
        return {"numpy": self.gen.bit_generator.state}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        if "torch" in sd:
            self.gen.set_state(sd["torch"])
        else:
            self.gen.bit_generator.state = sd["numpy"]


class DictState:
    """A plain dict, restored in place."""

    def __init__(self, d: dict[str, Any]) -> None:
        self.d = d

    def state_dict(self) -> dict[str, Any]:
        return dict(self.d)

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.d.clear()
        self.d.update(sd)


def is_generator(obj: Any) -> bool:
    return isinstance(obj, torch.Generator) or (hasattr(obj, "bit_generator") and hasattr(obj, "integers"))


@dataclass
class Entry:
    """One named per-rank entry: how to read and set its state, and how to reshard it."""

    name: str
    obj: Any  # the user's object (for the resharder)
    stateful: Any  # state_dict() / load_state_dict()
    reshard: Resharder | None = None


def entry_for(name: str, obj: Any, reshard: Resharder | None = None) -> Entry:
    """The per-rank entry for a script's object; the built-in resharder where one fits."""
    if isinstance(obj, dict):
        stateful: Any = DictState(obj)
    elif is_generator(obj):
        stateful = GeneratorState(obj)
    elif callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        stateful = obj
    else:
        raise ValueError(f"checkpoint entry {name!r} is a {type(obj).__name__}: per-rank state needs "
                         "state_dict/load_state_dict, a torch/numpy Generator, or a dict")
    if reshard is None and _distributed_loader(obj):
        reshard = reshard_distributed_loader
    return Entry(name, obj, stateful, reshard)


# ---------------------------------------------------------------- save


def _has_dtensor(x: Any) -> bool:
    from torch.distributed.tensor import DTensor

    if isinstance(x, DTensor):
        return True
    if isinstance(x, Mapping):
        return any(_has_dtensor(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_has_dtensor(v) for v in x)
    return False


def capture(entries: list[Entry]) -> dict[str, dict[str, Any]]:
    """This rank's per-rank state now, as JSON-able {name: {"b64", "crc"}}: a snapshot taken
    at the save call, so an async save writes the state of its step, not of a later one."""
    out: dict[str, dict[str, Any]] = {}
    for e in entries:
        sd = e.stateful.state_dict()
        if _has_dtensor(sd):
            raise UserError(f"checkpoint entry {e.name!r} holds DTensors (sharded state): mark it "
                            f"dslurm.runtime.shared({e.name}) so DCP saves and reshards it")
        buf = io.BytesIO()
        torch.save(sd, buf)
        raw = buf.getvalue()
        out[e.name] = {"b64": base64.b64encode(raw).decode(), "crc": f"{zlib.crc32(raw):08x}"}
    return out


# ---------------------------------------------------------------- restore


def _decode(rec: Mapping[str, Any], source: str) -> Any:
    """One entry's state back. A crc32 that matches says nothing about who wrote the file (a run
    directory is often writable by a whole group), so the pickle is read by torch's own restricted
    unpickler (weights_only=True: tensors, containers, numbers, strings, and the classes a
    script adds with `torch.serialization.add_safe_globals`); anything else is refused unrun
    (dslurm.checkpoint.unpickle, docs/checkpoint.md)."""
    raw = base64.b64decode(rec["b64"])
    try:
        return torch.load(io.BytesIO(raw), weights_only=True)
    except pickle.UnpicklingError as exc:
        raise refused_by_torch(exc, source, own=(
            "if the class is your own and you trust every writer of the run directory, allow it "
            "with torch.serialization.add_safe_globals([TheClass]) before the restore")) from None


def _rank_path(gen: Path, rank: int) -> Path:
    return gen / ck.RANKS / f"rank-{rank:05d}.json"


def _rank_file(gen: Path, rank: int) -> dict[str, Any]:
    return json.loads(_rank_path(gen, rank).read_text())  # type: ignore[no-any-return]


def restore(entries: list[Entry], gen: Path, saved_world: int, rank: int, world: int) -> list[str]:
    """Load each entry's state for this rank from generation `gen`. -> how each was restored
    (for the log). Raises UserError naming the entry when one cannot be mapped onto `world`
    ranks, or when the generation lacks an entry the script declares (every rank decides the
    same from the same files)."""
    if not entries:
        return []
    if saved_world == world:
        own = _rank_file(gen, rank).get("state") or {}
        _require(entries, own, gen)
        for e in entries:
            e.stateful.load_state_dict(_decode(own[e.name], f"{_rank_path(gen, rank)} ({e.name})"))
            rng_neutral_next_iter(e.obj)
        return [f"{e.name}: this rank's own" for e in entries]
    olds = [_rank_file(gen, r).get("state") or {} for r in range(saved_world)]
    for o in olds:
        _require(entries, o, gen)
    how = []
    for e in entries:
        # No shortcut for states that are identical on every old rank: a loader's position
        # is the same number on every rank and still means "of my own slice", which another
        # world size slices differently. Only a resharder knows.
        if e.reshard is None:
            raise UserError(
                f"checkpoint entry {e.name!r} is per-rank state saved by {saved_world} ranks, and it cannot be "
                f"mapped onto {world} ranks ({gen.name}): resume with {saved_world} ranks; or, if it is one "
                f"state for the whole job, mark it dslurm.runtime.shared({e.name}); or give it a resharder "
                f"(dslurm.runtime.per_rank({e.name}, reshard=fn)); or leave it out of the checkpoint")
        try:
            states = [_decode(o[e.name], f"{_rank_path(gen, r)} ({e.name})") for r, o in enumerate(olds)]
            e.stateful.load_state_dict(e.reshard(e.obj, states, rank, world))
            rng_neutral_next_iter(e.obj)
        except ValueError as exc:
            raise UserError(f"checkpoint entry {e.name!r}: cannot reshard from {saved_world} to {world} ranks "
                            f"({gen.name}): {exc}") from None
        how.append(f"{e.name}: resharded {saved_world} -> {world} ranks")
    return how


def rng_neutral_next_iter(obj: Any) -> None:
    """The first iterator a restored torch `DataLoader` makes leaves the global torch RNG as the
    restore left it.

    Why: creating a DataLoader iterator draws its base seed from the global torch RNG when the
    loader has no `generator` of its own (torch.utils.data.dataloader._BaseDataLoaderIter). An
    uninterrupted run made its iterator once, at step 0; a resumed one makes it again after the
    restore set the RNG to the saved step's state, so that one extra draw shifts every later
    dropout mask (issue 38: 0.213 away after two resumes). The restored iterator needs no fresh
    seed -- a StatefulDataLoader's state holds its position, and the multi-process one its
    saved base seed -- so the draw is undone: dslurm owns this ordering, the script keeps
    `it = iter(loader)` after `restore()`. Only the first iterator: a later one (the next
    epoch) draws in both runs alike. Installed per instance on `_get_iterator`, which every
    `DataLoader.__iter__` path calls."""
    from torch.utils.data import DataLoader

    if not isinstance(obj, DataLoader) or obj.generator is not None or "_get_iterator" in vars(obj):
        return
    make = obj._get_iterator

    def first_iterator() -> Any:
        del obj._get_iterator  # once: back to the class's method
        state = torch.get_rng_state()
        try:
            return make()
        finally:
            torch.set_rng_state(state)

    obj._get_iterator = first_iterator  # type: ignore[method-assign]


def _require(entries: list[Entry], saved: Mapping[str, Any], gen: Path) -> None:
    missing = [e.name for e in entries if e.name not in saved]
    if missing:
        raise UserError(f"checkpoint {gen.name} has no per-rank state for {', '.join(map(repr, missing))} "
                        f"(it holds {sorted(saved) or 'none'}): the script's Checkpoint(...) entries changed "
                        "since that save; restore with the same entries, or start a fresh run directory")


# ---------------------------------------------------------------- built-in resharder


def _distributed_loader(obj: Any) -> bool:
    from torch.utils.data import DataLoader, DistributedSampler

    return isinstance(obj, DataLoader) and isinstance(getattr(obj, "sampler", None), DistributedSampler)


def reshard_distributed_loader(loader: Any, states: list[Any], rank: int, world: int) -> Any:
    """A `StatefulDataLoader` (torchdata) over a `DistributedSampler`, single-process
    (num_workers=0), to another world size. Rank r of W reads the epoch's permutation at
    r, r+W, r+2W, ...: after every rank has read s samples, the first s*W samples of the
    permutation are consumed, whatever W. So each of the new W' ranks skips s*W/W' of its own
    (same seed, same epoch); refused when that is not a whole number of batches."""
    sampler = loader.sampler
    if sampler.num_replicas != world:
        raise ValueError(f"the loader's DistributedSampler has num_replicas={sampler.num_replicas}, "
                         f"the job has {world} ranks")
    if any("_sampler_iter_yielded" not in s or "_snapshot" in s for s in states):
        raise ValueError("only a single-process loader state (num_workers=0) can be resharded")
    batches = {int(s["_sampler_iter_yielded"]) for s in states}
    if len(batches) != 1:
        raise ValueError(f"the saved ranks had read different numbers of batches ({sorted(batches)})")
    bs = loader.batch_size
    if not bs:
        raise ValueError("a loader with its own batch_sampler cannot be resharded")
    consumed = batches.pop() * bs * len(states)  # samples of the permutation consumed, all ranks
    if consumed % (world * bs):
        raise ValueError(f"{consumed} consumed samples do not split into whole batches of {bs} over "
                         f"{world} ranks")
    nb = consumed // (world * bs)
    new = dict(states[0])
    new["_sampler_iter_yielded"] = new["_num_yielded"] = nb
    it = dict(new.get("_sampler_iter_state") or {})
    if "samples_yielded" in it:
        it["samples_yielded"] = nb * bs
    if isinstance(it.get("sampler_state"), dict) and "yielded" in it["sampler_state"]:
        it["sampler_state"] = {**it["sampler_state"], "yielded": nb * bs}
    new["_sampler_iter_state"] = it or None
    return new
