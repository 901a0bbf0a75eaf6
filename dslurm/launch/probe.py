"""A connectivity probe to run in place of the trainer (`entry: dslurm.launch.probe`).

Each process joins the process group the launcher set up (env://, gloo or NCCL),
all-reduces its rank and writes what it saw — host, ranks, master, the sum — to
`<run_dir>/probe/rank-<R>.json`. It proves the chain sbatch -> srun -> dslurm launch ->
torchrun -> process group end to end without a model.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

from dslurm.durable import atomic_write_text
from dslurm.launch.slurm_env import GPU_ENV


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.distributed as dist

    from dslurm.preflight.in_job import gate_in_process
    from dslurm.process_group import init_process_group
    from dslurm.worker_exit import Outcome, report

    device = init_process_group()
    outcome = Outcome()
    rank, world = dist.get_rank(), dist.get_world_size()
    code = gate_in_process(device, outcome=outcome)
    if code:
        dist.destroy_process_group()
        report(outcome, code, rank)  # the verdict as this rank's own report: the ending is read from it
        return code
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    record = {
        "rank": rank, "world_size": world, "local_rank": int(os.environ.get("LOCAL_RANK", "0")),
        "group_rank": int(os.environ.get("GROUP_RANK", os.environ.get("DSLURM_NODE_RANK", "-1"))),
        "node_rank": int(os.environ.get("DSLURM_NODE_RANK", "-1")), "hostname": socket.gethostname(),
        "master_addr": os.environ.get("MASTER_ADDR"), "master_port": os.environ.get("MASTER_PORT"),
        "allreduce_sum": t.item(), "slurm_job_id": os.environ.get("SLURM_JOB_ID"), "argv": sys.argv[1:],
        "device": str(device), "gpu_env": {k: os.environ.get(k) for k in GPU_ENV},
    }
    out = Path(os.environ.get("DSLURM_RUN_DIR", ".")) / "probe"
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / f"rank-{rank}.json", json.dumps(record))
    dist.barrier()
    dist.destroy_process_group()
    report(outcome, 0, rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
