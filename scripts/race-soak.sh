#!/usr/bin/env bash
# The crash race under load (issue 12's "must show"): both exit orders, forced, N times each,
# with a CPU hog on every core beside the local Slurm cluster. Writes docs/fault-race-soak.md.
# Usage: bash scripts/race-soak.sh [N]   (default 10; about 1 minute per run on 2 cores)
set -euo pipefail
cd "$(dirname "$0")/.."
n=${1:-10}
bash scripts/setup.sh
hogs=()
for _ in $(seq "$(nproc)"); do
  (while :; do :; done) &
  hogs+=($!)
done
trap 'kill "${hogs[@]}" 2>/dev/null || true' EXIT
export DSLURM_RACE_REPEAT="$n" DSLURM_FAULT_MATRIX_DOC=docs/fault-race-soak.md
cores=$(nproc)
export DSLURM_FAULT_MATRIX_CMD="bash scripts/race-soak.sh $n (a busy loop on each of the $cores cores beside the cluster)"
.venv/bin/python -m pytest tests/cluster/test_fault_matrix.py -k "crash_first or victims_exit_first" -v "${@:2}"
