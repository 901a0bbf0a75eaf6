"""Build this rank's model parts, parallelised in torchtitan's order.

full model (same seed on every rank) -> [PP: one copy per owned stage, other layers
deleted] -> CP (attention over the gathered sequence) -> TP(+SP, loss parallel) -> activation
checkpointing -> compile -> FSDP2/HSDP (over dp_shard x cp) -> [PP: PipelineStage + schedule].
On GPU the full model is built on the meta device and materialised after sharding
(`to_empty` + `init_weights` under the seed), so no rank ever holds the unsharded weights; on
CPU it is built for real so every layout starts from bit-identical weights (the parity tests
need that).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from dslurm.config import JobSpec, TrainSpec
from dslurm.config.layout import stages_per_rank
from dslurm.config.models import ModelShape
from train.model import Transformer, build_model
from train.parallel.dims import ParallelDims

if TYPE_CHECKING:  # the pipelining package is imported only by a PP layout (below)
    from torch.distributed.pipelining.schedules import _PipelineSchedule

# Each parallelism's module is imported where the layout asks for it, never at the top: a
# pp=1, tp=1, no-compile worker must not pay for torch.distributed.pipelining (which pulls in
# torch._dynamo and torch._inductor, ~0.5-1 s per process), nor for the DTensor parallel
# styles or the compiler (tests/unit/test_worker_imports.py checks it).


@dataclass(slots=True)
class Parts:
    """This rank's share of the model."""

    parts: list[nn.Module]
    """model parts (one without PP; one per owned stage with PP): each a `Transformer`"""
    schedule: _PipelineSchedule | None
    """the pipeline schedule, or None without PP"""
    has_first_stage: bool
    """this rank feeds tokens (holds the embedding)"""
    has_last_stage: bool
    """this rank computes the loss (holds the output projection)"""


def _parallelize_part(part: Transformer, dims: ParallelDims, train: TrainSpec, fsdp: bool,
                      precision: str | None = None) -> None:
    lay = dims.layout
    if lay.cp_enabled:
        from train.parallel.cp import apply_cp

        cp_mesh = dims.get_mesh("cp")
        apply_cp(part, cp_mesh.get_group(), cp_mesh.get_local_rank(), lay.cp)
    if lay.tp_enabled:
        from train.parallel.tp import apply_tp

        apply_tp(part, dims.get_mesh("tp"), loss_parallel=lay.loss_parallel_enabled)
    if train.activation_checkpoint != "none":
        from train.parallel.ac import apply_ac

        apply_ac(part, train.activation_checkpoint)
    if train.compile:
        from train.parallel.compile import apply_compile

        apply_compile(part)
    if fsdp:
        from train.parallel.fsdp import apply_fsdp

        apply_fsdp(part, dims.fsdp_mesh(), dtype=train.dtype, device_type=precision or dims.device_type,
                   pp_enabled=lay.pp_enabled)


def meta_init(device: torch.device) -> bool:
    """Whether the model is built on the meta device and materialised after sharding (see above)."""
    return device.type != "cpu"


def build_parts(shape: ModelShape, job: JobSpec, dims: ParallelDims, device: torch.device, *,
                loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                fsdp: bool | None = None, precision: str | None = None) -> Parts:
    """Model parts and (with PP) the schedule for this rank. `fsdp=None` applies FSDP when
    there is data parallelism; True forces it (the 1-process overhead benchmark). `precision`:
    the device type whose mixed precision FSDP applies (default the run's; `dslurm plan check`
    builds a GPU run's parts on a CPU)."""
    train, par, lay = job.train, job.parallel, dims.layout
    fsdp = lay.fsdp_enabled if fsdp is None else fsdp
    meta = meta_init(device)
    full = build_model(shape, train.seed, "meta" if meta else "cpu")
    if lay.pp_enabled:
        from train.parallel.pp import split_stage, stage_ids

        pp_rank = dims.get_mesh("pp").get_local_rank()
        n_stages = lay.pp * stages_per_rank(par.pp_schedule)
        ids = stage_ids(pp_rank, lay.pp, par.pp_schedule)
        stages = [split_stage(full, i, n_stages) for i in ids]
        del full
    else:
        ids, n_stages, stages = [0], 1, [full]
    for part in stages:
        _parallelize_part(part, dims, train, fsdp, precision)
        if meta:
            part.to_empty(device=device)
            torch.manual_seed(train.seed)
            with torch.no_grad():
                part.init_weights()
    schedule = None
    if lay.pp_enabled:
        from train.parallel.pp import build_schedule

        schedule = build_schedule(stages, ids, n_stages, pp_group=dims.get_mesh("pp").get_group(),
                                  device=device, schedule=par.pp_schedule, microbatches=lay.microbatches,
                                  loss_fn=loss_fn)
    return Parts(parts=list(stages), schedule=schedule, has_first_stage=0 in ids,
                 has_last_stage=n_stages - 1 in ids)
