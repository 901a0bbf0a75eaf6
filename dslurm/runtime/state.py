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

from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

_OPTS = StateDictOptions(flatten_optimizer_state_dict=True)


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
            out.update(get_optimizer_state_dict(part, opt, options=_OPTS))
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for part, opt in zip(self.parts, self.optimizers):
            set_optimizer_state_dict(part, opt, state_dict, options=_OPTS)


def train_state(parts: list[nn.Module], optimizers: list[Any]) -> dict[str, Stateful]:
    """The `state` dict handed to `CheckpointManager.save/restore`."""
    return {"model": ModelState(parts), "optim": OptimizerState(parts, optimizers)}


def split_state(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """A script's named state -> (tensor state for DCP, JSON dicts for the generation's metadata).
    Modules and optimizers go through the DCP state-dict helpers (sharded under FSDP2/TP, the
    `module.` prefix of DDP dropped), so a checkpoint loads into another layout; anything with
    `state_dict`/`load_state_dict` (a scheduler, a GradScaler, your own) is saved as it says;
    a plain dict (data position, counters) must be JSON and is restored in place.
    Raises ValueError naming the entry and the fix."""
    from torch.optim import Optimizer

    modules = [v for v in state.values() if isinstance(v, nn.Module)]
    optims = {k: v for k, v in state.items() if isinstance(v, Optimizer)}
    if optims and len(modules) != 1:
        raise ValueError(f"optimizer(s) {', '.join(sorted(optims))} need exactly one model in the checkpoint "
                         f"(got {len(modules)}): put the models in one nn.ModuleDict")
    tensors: dict[str, Any] = {}
    extra: dict[str, dict[str, Any]] = {}
    for name, value in state.items():
        if isinstance(value, nn.Module):
            tensors[name] = ModelState([value])
        elif isinstance(value, Optimizer):
            tensors[name] = OptimizerState(modules, [value])
        elif isinstance(value, Stateful):
            tensors[name] = value
        elif isinstance(value, dict):
            extra[name] = value
        else:
            raise ValueError(f"checkpoint entry {name!r} is a {type(value).__name__}: give a module, an "
                             "optimizer, an object with state_dict/load_state_dict, or a dict of JSON values")
    return tensors, extra
