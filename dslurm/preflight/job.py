"""Entry of the standalone burn-in job (`dslurm burnin --site S --nodes N`): the same
gate every training job runs first (dslurm/preflight/in_job.py), and nothing after it.

    python -m dslurm.preflight.job --site S --job J     (under dslurm launch --preflight)
"""

from __future__ import annotations

import sys


def main() -> int:
    import torch.distributed as dist

    from dslurm.endings.worker_exit import Outcome, report
    from dslurm.health.process_group import init_process_group
    from dslurm.preflight.in_job import gate_in_process

    device = init_process_group()
    outcome = Outcome()
    rank = dist.get_rank()
    try:
        code = gate_in_process(device, outcome=outcome)
    finally:
        dist.destroy_process_group()
    report(outcome, code, rank)
    return code


if __name__ == "__main__":
    sys.exit(main())
