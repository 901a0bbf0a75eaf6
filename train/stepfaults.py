"""The fault knobs that act inside one step's forward pass (dslurm/faults.py names them all).

DSLURM_FAULT_STALL, _OOM and _SLOW_COMPUTE act in the middle transformer block this rank holds,
in a forward pre-hook registered after FSDP's own (so its parameters are already gathered):
the rank is then between the collectives of one `forward_backward` -- the place the trainer's
own notes cannot see into, and the collective-level record can. No knob set: no hook, no cost.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from dslurm import faults


def install(parts: list[nn.Module], step_now: Callable[[], int]) -> list[RemovableHandle]:
    """Register the hook when a knob aims at this process; `step_now()`: the 1-based step
    being taken. Returns the hook handles (empty: nothing to do)."""
    stall_at = faults.step_fault("DSLURM_FAULT_STALL")
    oom_at = faults.step_fault("DSLURM_FAULT_OOM")
    slow_s = faults.seconds_fault("DSLURM_FAULT_SLOW_COMPUTE")
    if stall_at is None and oom_at is None and not slow_s:
        return []
    block = _middle_block(parts)
    if block is None:
        return []

    def hook(module: nn.Module, args: Any) -> None:
        step = step_now()
        if slow_s:
            time.sleep(slow_s)
        if stall_at is not None and step == stall_at:
            faults.stall(step)
        if oom_at is not None and step == oom_at:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate 2.00 GiB (injected by DSLURM_FAULT_OOM at step {step})")

    return [block.register_forward_pre_hook(hook)]


def _middle_block(parts: list[nn.Module]) -> nn.Module | None:
    for part in parts:
        layers = getattr(part, "layers", None)
        if layers is not None and len(layers):
            keys = list(layers.keys())
            return layers[keys[len(keys) // 2]]  # type: ignore[no-any-return]
    return None
