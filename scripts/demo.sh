#!/usr/bin/env bash
# The main job: set up, start the built-in local real Slurm cluster (if it is not up),
# run the 2-node demo job (2x2 FSDP x TP, tiny Llama, burn-in first), preempt it twice
# while it trains (scontrol requeue, then the time-limit signal), let it resume from the
# checkpoint pointer each time and finish, then print `dslurm report` (goodput, restarts,
# lost steps, a PNG timeline). Extra arguments go to examples/preempt_demo.py.
#
# Set-up is only what the demo needs: the system packages and .venv, not the second torch
# (.venv-torch2, which only the test command uses: DSLURM_TORCH2=none). Its chatter (apt's and
# pip's warnings, the cluster's start) goes to checkpoints/demo-setup.log; one line per phase here,
# and the log's end if a phase fails.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p checkpoints
log=checkpoints/demo-setup.log
: > "$log"

phase() {  # phase NAME COMMAND...: the command's output into the log, one line here
  local name=$1 t0=$SECONDS
  shift
  printf '%-8s ... ' "$name"
  echo "=== $name: $*" >> "$log"
  if "$@" >> "$log" 2>&1; then
    echo "ok ($((SECONDS - t0)) s)"
  else
    local rc=$?
    echo "FAILED (exit $rc); the end of $log:"
    tail -n 25 "$log" | sed 's/^/  /'
    exit "$rc"
  fi
}

echo "demo: set-up output goes to $log"
phase setup env DSLURM_TORCH2=none bash scripts/setup.sh
phase cluster .venv/bin/python -m dslurm cluster up --nodes 3 --accounting
.venv/bin/python -m dslurm cluster status >> "$log" 2>&1 || true
exec .venv/bin/python examples/preempt_demo.py "$@"
