"""Pipeline parallel with torch.distributed.pipelining: GPipe, 1F1B, Interleaved1F1B.

Each stage is a deep copy of the full model with the layers it does not own deleted (and
the embedding / final norm + output removed where they do not belong), so its parameter
names are those of the unsplit model and DCP can reshard between PP layouts. Stages are
assigned loop-style: with v virtual stages per rank, pp rank r owns stages r, r+pp, ...
Schedules need microbatches >= stages (`Layout.schedule_problem`, checked in `dslurm.config.resolve`
before any process group work). Parameters of a stage are then parallelised (TP, AC, compile, FSDP) by the
caller, before the `PipelineStage` is created.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from dslurm.config.layout import layer_split, stage_ids
from train.model import Transformer

__all__ = ["Stage", "build_schedule", "layer_split", "split_stage", "stage_ids"]

if TYPE_CHECKING:  # torch's private base classes: for the type checker only
    from torch.distributed.pipelining.schedules import _PipelineSchedule
    from torch.distributed.pipelining.stage import _PipelineStageBase

SCHEDULES = {"GPipe": ScheduleGPipe, "1F1B": Schedule1F1B, "Interleaved1F1B": ScheduleInterleaved1F1B}


class Stage(PipelineStage):
    """A PipelineStage that tells its module which microbatch it runs (`Transformer.chunk`): how
    the documents of packed instruction data find their microbatch on every stage
    (train/packing.py). Shape inference calls the module directly, outside any chunk."""

    def forward_one_chunk(self, fwd_chunk_id: int, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None,
                          save_forward_output: bool = True) -> Any:
        model = cast(Transformer, self.submod)  # split_stage's (sharded in place, same class)
        model.chunk = fwd_chunk_id
        try:
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        finally:
            model.chunk = None


def split_stage(full: Transformer, stage: int, n_stages: int) -> Transformer:
    """A copy of `full` holding only what stage `stage` of `n_stages` runs."""
    keep = layer_split(len(full.layers), n_stages)[stage]
    module = copy.deepcopy(full)
    for key in list(module.layers.keys()):
        if int(key) not in keep:
            del module.layers[key]
    if stage > 0:
        module.tok_embeddings = None
    if stage < n_stages - 1:
        module.norm = None
        module.output = None
    return module


def build_schedule(stage_modules: list[Transformer], ids: list[int], n_stages: int, *,
                   pp_group: dist.ProcessGroup, device: torch.device, schedule: str, microbatches: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> _PipelineSchedule:
    """PipelineStages for this rank's modules and the schedule that drives them.

    `loss_fn` must already divide by the number of microbatches: `scale_grads=False`, because
    the schedule would otherwise rescale *all* gradients after each `step()`, including those
    accumulated by earlier gradient-accumulation steps.

    Shapes between stages are inferred at run time (no example inputs): with SP the hidden
    states are (mb, seq/tp, dim) local shards, which the stage learns from the first step.
    """
    stages: list[_PipelineStageBase] = [Stage(m, i, n_stages, device, group=pp_group)
                                        for m, i in zip(stage_modules, ids)]
    cls = SCHEDULES[schedule]
    if cls is ScheduleInterleaved1F1B:
        multi: _PipelineSchedule = cls(stages, n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
        return multi
    single: _PipelineSchedule = cls(stages[0], n_microbatches=microbatches, loss_fn=loss_fn, scale_grads=False)
    return single
