#!/usr/bin/env bash
# The main job: set up, start the built-in local real Slurm cluster (if it is not up),
# run the 2-node demo job (2x2 FSDP x TP, tiny Llama, burn-in first), preempt it twice
# while it trains (scontrol requeue, then the time-limit signal), let it resume from the
# checkpoint pointer each time and finish, then print `dslurm report` (goodput, restarts,
# lost steps, a PNG timeline). Extra arguments go to examples/preempt_demo.py.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m dslurm cluster up --nodes 3 --accounting
.venv/bin/python -m dslurm cluster status
exec .venv/bin/python examples/preempt_demo.py "$@"
