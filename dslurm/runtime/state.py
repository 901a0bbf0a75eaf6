"""What a checkpoint holds, as DCP `Stateful`s: the trainer's model parts and optimizers, and
whatever a script hands `dslurm.runtime.Checkpoint` (in-job: imports torch).

The model parts of this rank (one, or two for an interleaved pipeline) and their
optimizers are saved under the unsplit model's parameter names with flattened optimizer
state (`flatten_optimizer_state_dict=True`), so the keys do not depend on which stage
holds which layer: a checkpoint from PP=2 loads into PP=1 or into FSDPxTP, and back.
The LR follows from the step (train.lr is a pure function), so schedulers are restored by
setting their step, not saved.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful
from torch.optim import Optimizer

from dslurm.checkpoint.dcp import optimizer_state_dict
from dslurm.checkpoint.per_rank import DictState, Entry, entry_for
from dslurm.runtime.checkpoint import PerRank, Shared

_OPTS = StateDictOptions(flatten_optimizer_state_dict=True)
# One state for the whole job by nature (the step count, the loss scale): saved through DCP.
_SHARED_KINDS: tuple[type, ...] = (torch.optim.lr_scheduler.LRScheduler, torch.amp.GradScaler)


class ModelState(Stateful):
    """Union of the parts' model state dicts (names are disjoint: each layer lives once)."""

    def __init__(self, parts: list[nn.Module]) -> None:
        self.parts = parts

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for part in self.parts:
            out.update(get_model_state_dict(part, options=_OPTS))
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part in self.parts:
            # strict=False: the dict holds every part's keys; each part takes its own.
            set_model_state_dict(part, state_dict, options=StateDictOptions(strict=False))


class OptimizerState(Stateful):
    """Union of the parts' flattened optimizer state dicts."""

    def __init__(self, parts: list[nn.Module], optimizers: list[Any]) -> None:
        self.parts, self.optimizers = parts, optimizers

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for part, opt in zip(self.parts, self.optimizers):
            out.update(optimizer_state_dict(part, opt, options=_OPTS))  # exact before the first step too
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part, opt in zip(self.parts, self.optimizers):
            set_optimizer_state_dict(part, opt, state_dict, options=_OPTS)


def train_state(parts: list[nn.Module], optimizers: list[Any]) -> dict[str, Stateful]:
    """The `state` dict handed to `CheckpointManager.save/restore`."""
    return {"model": ModelState(parts), "optim": OptimizerState(parts, optimizers)}


def split_state(state: dict[str, Any]) -> tuple[dict[str, Any], list[Entry]]:
    """A script's named state -> (shared state for DCP, per-rank entries for the rank files).

    Shared (one copy for the job, through DCP: sharded under FSDP2/TP, the `module.` prefix of
    DDP dropped, so it loads into another layout): modules, optimizers, LR schedulers,
    GradScalers, and whatever is marked `dslurm.runtime.shared(obj)` (a dict, or replicated or
    DTensor state of your own).
    Per rank (each rank saves its own and gets its own back; dslurm/checkpoint/per_rank.py):
    everything else -- a `StatefulDataLoader`, a sampler, a `torch.Generator` or numpy
    `Generator`, a plain dict (restored in place), any object with `state_dict`/
    `load_state_dict`, and whatever is marked `dslurm.runtime.per_rank(obj, reshard=fn)`.
    Raises ValueError naming the entry and the fix."""
    modules = [v for v in state.values() if isinstance(v, nn.Module)]
    optims = {k: v for k, v in state.items() if isinstance(v, Optimizer)}
    if optims and len(modules) != 1:
        raise ValueError(f"optimizer(s) {', '.join(sorted(optims))} need exactly one model in the checkpoint "
                         f"(got {len(modules)}): put the models in one nn.ModuleDict")
    shared: dict[str, Any] = {}
    ranks: list[Entry] = []
    for name, value in state.items():
        value = accelerate_entry(name, value)
        if isinstance(value, nn.Module):
            shared[name] = ModelState([value])
        elif isinstance(value, Optimizer):
            shared[name] = OptimizerState(modules, [value])
        elif isinstance(value, Shared) or isinstance(value, _SHARED_KINDS):
            obj = value.obj if isinstance(value, Shared) else value
            if isinstance(obj, dict):
                obj = DictState(obj)
            if not isinstance(obj, Stateful):
                raise ValueError(f"checkpoint entry {name!r}: shared(...) needs a dict or an object with "
                                 f"state_dict/load_state_dict, not a {type(obj).__name__}")
            shared[name] = obj
        elif isinstance(value, PerRank):
            ranks.append(entry_for(name, value.obj, value.reshard))
        else:
            ranks.append(entry_for(name, value))
    return shared, ranks


def accelerate_entry(name: str, value: Any) -> Any:
    """An `accelerate` Accelerator's prepared object as the entry it stands for, so a script hands
    them over as they are: the prepared model is a module (DDP's `module.` prefix dropped like any
    DDP's) and the AcceleratedOptimizer an Optimizer already; an AcceleratedScheduler is its
    scheduler (one state for the job, through DCP); a prepared DataLoader is per-rank state only
    when it is stateful (`DataLoaderConfiguration(use_stateful_dataloader=True)`), refused by name
    otherwise: a plain one has no position to give back. Anything else is returned unchanged."""
    kind = type(value).__module__.split(".")[0], type(value).__name__
    if kind == ("accelerate", "AcceleratedScheduler"):
        return value.scheduler
    if kind[0] == "accelerate" and kind[1] in ("DataLoaderShard", "DataLoaderDispatcher") and not getattr(
            value, "use_stateful_dataloader", False):
        raise ValueError(f"checkpoint entry {name!r} is an accelerate {kind[1]} without a position to save. Fix: "
                         "Accelerator(dataloader_config=DataLoaderConfiguration(use_stateful_dataloader=True)), "
                         "or leave the loader out and skip the batches done yourself "
                         "(accelerator.skip_first_batches)")
    return value


def inexact_resumes(state: dict[str, Any], world_size: int) -> list[str]:
    """What in a script's state keeps a resume from being bit-identical to an uninterrupted run,
    by entry name, with the fix (said once when the Checkpoint is built). DDP rebuilds its
    gradient buckets after a process's first iteration unless `find_unused_parameters=True`:
    a resumed process reduces its first step in the other layout, and with 3 or more ranks the
    sums round differently in the last bit (README, "DDP and bit-identical resumes")."""
    from torch.nn.parallel import DistributedDataParallel

    out = []
    for name, v in state.items():
        if (isinstance(v, DistributedDataParallel) and world_size >= 3 and not v.find_unused_parameters
                and not getattr(v, "static_graph", False)):
            out.append(f"checkpoint entry {name!r}: DDP rebuilds its gradient buckets after the first step of each "
                       f"process, so a resumed run's first step rounds differently in the last bit ({world_size} "
                       f"ranks); for bit-identical resumes build it with DDP(..., find_unused_parameters=True)")
    return out
