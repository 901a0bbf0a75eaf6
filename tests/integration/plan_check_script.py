"""Run under torchrun (gloo, CPU): what the real run allocates and sends, for `dslurm plan check`'s test.

argv: site, job, out_dir, then --set overrides. Every rank builds its parts as the trainer does (real
tensors, a real process group), runs one micro-batch's forward and backward on each of its stages
with the collectives recorded as train/plan_check.py records them, and writes
out_dir/rank-R.json: its local shard shapes and its collectives.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from dslurm.config.layout import stage_ids, stages_per_rank
from dslurm.config.resolve import load
from train.model import cross_entropy
from train.parallel.build import build_parts
from train.parallel.dims import ParallelDims
from train.plan_check import local_shapes, rows, run_micro_batch


def main() -> None:
    site, job, out, sets = sys.argv[1], sys.argv[2], Path(sys.argv[3]), sys.argv[4:]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    res = load(site, job, sets, ["node.nvlink_domain=8"])
    lay, spec = res.layout, res.job
    dims = ParallelDims.from_layout(lay, world, "cpu")
    built = build_parts(res.shape, spec, dims, torch.device("cpu"), loss_fn=cross_entropy)
    sched = spec.parallel.pp_schedule
    ids = stage_ids(lay.coords(rank)["pp"], lay.pp, sched) if lay.pp_enabled else [0]
    n_stages = lay.pp * stages_per_rank(sched) if lay.pp_enabled else 1
    mb = lay.micro_batch(spec.train.global_batch, spec.train.grad_accum)
    comm = run_micro_batch(built.parts, dims, res.shape, ids, n_stages, mb)
    (out / f"rank-{rank}.json").write_text(json.dumps({"shapes": local_shapes(built.parts), "collectives": rows(comm)}))
    dist.barrier()  # no rank tears its groups down while a peer's last collective is in flight
    dist.destroy_process_group()
    # Skip the interpreter's finalization, as the trainer does (dslurm.endings.worker_exit): gloo's
    # worker threads can still hold tensors then, and freeing them there aborted one rank (SIGABRT,
    # "terminate called without an active exception") once in a clean-clone run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
