"""The burn-in in front of a script entry: `python -m dslurm.launch.gate SCRIPT.py ARGS...`.

The built-in entries gate themselves in their own process group (dslurm/preflight/in_job.py);
a script of the user's -- plain, or one using dslurm.runtime -- runs behind this wrapper
instead (render.trainer_args puts it there when the job's burn-in is on). Each worker joins a
process group whose keys live under a prefix of their own in torchrun's store, runs the gate,
leaves the group, and then *becomes* the script (exec: same pid, so torchrun, the launcher's
signal forwarding and the worker's status files are unchanged) with the burn-in variables
removed, so a dslurm.runtime script does not gate a second time. Bad nodes: every worker
exits PREFLIGHT_FAILED (78) with its code and its rank report written, as the trainer would.
torchrun mode only: srun mode has no agent store to share (dslurm.config refuses the combination).
"""

from __future__ import annotations

import os
import sys

from dslurm.preflight.in_job import REPORT_ENV, SITE_ENV

STORE_PREFIX = "dslurm-burnin/"


def script_env(env: dict[str, str]) -> dict[str, str]:
    """The script's environment: the launcher's, without the burn-in request. Pure."""
    return {k: v for k, v in env.items() if k not in (REPORT_ENV, SITE_ENV)}


def main(argv: list[str]) -> int:
    if not argv:
        print("error: usage: python -m dslurm.launch.gate SCRIPT.py [ARGS...] (or -m MODULE ...)", file=sys.stderr)
        return 2
    if os.environ.get(REPORT_ENV):
        import torch.distributed as dist

        from dslurm.endings.worker_exit import Outcome, report
        from dslurm.health.process_group import init_process_group
        from dslurm.preflight.in_job import gate_in_process

        device = init_process_group(store_prefix=STORE_PREFIX)
        outcome = Outcome()
        code = gate_in_process(device, outcome=outcome)
        rank = dist.get_rank()
        dist.barrier()  # nobody leaves the group (or starts the script's) before all have the verdict
        dist.destroy_process_group()
        if code:
            report(outcome, code, rank)  # the verdict as this rank's report: the ending is read from it
            return code
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], script_env(dict(os.environ)))
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
