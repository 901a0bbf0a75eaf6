"""A connectivity probe to run in place of the trainer (`entry: dslurm.launch.probe`).

Each process joins the process group the launcher set up (env://, gloo or NCCL),
all-reduces its rank and writes what it saw — host, ranks, master, the sum, the GPU device files
it can open (dslurm/launch/devices.py) — to `<run_dir>/probe/rank-<R>.json`. It proves the chain
sbatch -> srun -> dslurm launch -> torchrun -> process group end to end without a model.

In a job step of `dslurm supervise` (spares) each step also keeps its own record,
`probe/step-<RESTART>.<STEP>-rank-<R>.json`, with whether a warm pool forked it; and
DSLURM_FAULT_CRASH (scoped, dslurm/faults.py: e.g. `1:0@0.0`) makes the aimed ranks crash right
after the all-reduce and their record: the failure a warm restart recovers from (the site check's
warm row, tests/cluster/test_gpu_gres.py).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path

from dslurm.durable import atomic_write_text
from dslurm.launch.devices import device_view
from dslurm.launch.slurm_env import GPU_ENV, STEP_INDEX_ENV


def main(argv: list[str] | None = None) -> int:
    import torch
    import torch.distributed as dist

    from dslurm.endings.worker_exit import Outcome, report
    from dslurm.faults import await_files, await_step, step_fault
    from dslurm.health.process_group import init_process_group
    from dslurm.launch.warm import FORKED_ENV
    from dslurm.preflight.in_job import gate_in_process

    t0 = time.time()
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
        "devices": device_view(), "warm": bool(os.environ.get(FORKED_ENV)),
        "slurm_step_id": os.environ.get("SLURM_STEP_ID"),
    }
    out = Path(os.environ.get("DSLURM_RUN_DIR", ".")) / "probe"
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / f"rank-{rank}.json", json.dumps(record))
    if STEP_INDEX_ENV in os.environ:
        start = f"{os.environ.get('SLURM_RESTART_COUNT') or 0}.{os.environ[STEP_INDEX_ENV]}"
        atomic_write_text(out / f"step-{start}-rank-{rank}.json", json.dumps(record))
    if STEP_INDEX_ENV in os.environ and rank == 0 and os.environ.get("DSLURM_RUN_DIR"):
        # The all-reduce is the probe's first step: said as the trainer says it, so the warm pools
        # of a supervised job start now (dslurm/recover/warm_pools.py), not when this step ends.
        from dslurm.observe.events import StartPhases
        from dslurm.observe.ledger import Ledger

        Ledger(os.environ["DSLURM_RUN_DIR"]).append(StartPhases(t0=t0, total_s=round(time.time() - t0, 4)))
    if await_step() is not None:  # every rank, outside any collective: e.g. until the warm pools serve
        await_files()
    if step_fault("DSLURM_FAULT_CRASH") is not None:  # the peers wait in the barrier until torchrun ends them
        outcome.failed(RuntimeError("injected crash after the probe's all-reduce (DSLURM_FAULT_CRASH)"))
        report(outcome, 1, rank)
        return 1
    dist.barrier()
    dist.destroy_process_group()
    report(outcome, 0, rank)
    return 0


if __name__ == "__main__":
    sys.exit(main())
