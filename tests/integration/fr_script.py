"""A script on dslurm.runtime for tests/integration/test_collective_forensics.py: rank 1 raises
before the all-reduce of step 4, so rank 0 waits inside it and fails when rank 1 goes away; both
ranks' uncaught errors go through dslurm.runtime, which dumps their Flight Recorders."""

from __future__ import annotations

import torch
import torch.distributed as dist

import dslurm.runtime as dr


def main() -> None:
    dr.init()
    rank = dist.get_rank()
    x = torch.ones(4)
    for step in range(8):
        if rank == 1 and step == 3:
            raise RuntimeError("rank 1 fails between collectives (test)")
        dist.all_reduce(x)
    dr.finish(8)


if __name__ == "__main__":
    main()
