"""Entry of the standalone burn-in job (`dslurm burnin --site S --nodes N`): the same
gate every training job runs first (dslurm/preflight_gate.py), and nothing after it.

    python -m dslurm.preflight.job --site S --job J     (under dslurm launch --preflight)
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    import torch
    import torch.distributed as dist

    from dslurm.launch import write_worker_code
    from dslurm.preflight_gate import gate_in_process

    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        code = gate_in_process(device)
    finally:
        dist.destroy_process_group()
    write_worker_code(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
