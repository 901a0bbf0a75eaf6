"""Learning-rate schedule: linear warmup, then cosine decay to min_lr_ratio · lr.

Steps are 0-based optimizer steps: `lr_at(0, ...)` is the rate of the first update.
A pure function of the step, so a restored run can simply set the rate from the
restored step (no scheduler state to carry); `lr_lambda` gives the same curve as a
`torch.optim.lr_scheduler.LambdaLR` factor for loops that prefer a scheduler object
(LambdaLR calls it with 0 for the first step, matching the convention here).

    warmup   (step < W):       lr · (step + 1) / W       -- never 0: step 0 would be wasted
    decay    (W <= step < T):  lr · (m + (1 - m) · ½(1 + cos(π · (step - W) / (T - W))))
    after    (step >= T):      lr · m
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dslurm.config import TrainSpec


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """The multiplier of the peak rate at `step` (see the module docstring)."""
    if step < 0 or warmup_steps < 0 or total_steps < 0:
        raise ValueError(f"step({step}), warmup_steps({warmup_steps}) and total_steps({total_steps}) "
                         "must be >= 0")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"min_lr_ratio={min_lr_ratio} must be in [0, 1]")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if step >= total_steps:
        return min_lr_ratio
    progress = (step - warmup_steps) / (total_steps - warmup_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_at(step: int, *, lr: float, warmup_steps: int, total_steps: int,
          min_lr_ratio: float) -> float:
    """The learning rate at 0-based optimizer step `step`."""
    return lr * lr_factor(step, warmup_steps=warmup_steps, total_steps=total_steps,
                          min_lr_ratio=min_lr_ratio)


def lr_lambda(*, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> Callable[[int], float]:
    """A `LambdaLR(optimizer, lr_lambda(...))` factor; the optimizer's lr is the peak."""
    lr_factor(0, warmup_steps=warmup_steps, total_steps=total_steps, min_lr_ratio=min_lr_ratio)

    def factor(step: int) -> float:
        return lr_factor(step, warmup_steps=warmup_steps, total_steps=total_steps,
                         min_lr_ratio=min_lr_ratio)

    return factor


def schedule_for(train: TrainSpec) -> Callable[[int], float]:
    """step -> lr for a `dslurm.config.TrainSpec` (lr, warmup_steps, steps, min_lr_ratio)."""
    def at(step: int) -> float:
        return lr_at(step, lr=train.lr, warmup_steps=train.warmup_steps,
                     total_steps=train.steps, min_lr_ratio=train.min_lr_ratio)

    return at
