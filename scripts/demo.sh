#!/usr/bin/env bash
# The main job: set up, start the built-in local real Slurm cluster (if it is not up),
# submit the 2-node demo job (2x2 FSDP x TP, tiny Llama, burn-in first), wait for it, and
# show what happened: state, restarts, the ledger, the checkpoint generations.
# Extra arguments go to `dslurm submit`, e.g. `--set train.steps=200`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
DSLURM=(.venv/bin/python -m dslurm)

"${DSLURM[@]}" cluster up --nodes 3 --accounting
"${DSLURM[@]}" cluster status

run_dir="$PWD/checkpoints/demo-$(date +%Y%m%d-%H%M%S)"
out=$("${DSLURM[@]}" submit --site site-configs/local.yaml --job examples/jobs/tiny-2node.yaml \
      --set "checkpoint.run_dir=$run_dir" "$@")
echo "$out"
job_id=$(sed -n 's/^submitted job \([0-9]*\).*/\1/p' <<<"$out")

echo "demo: waiting for job $job_id (logs in $run_dir/logs)"
.venv/bin/python - "$job_id" <<'PY'
import sys
from dslurm import slurm
state = slurm.wait_job(sys.argv[1], timeout=1800, poll=2)
print(f"demo: job {sys.argv[1]} ended {state}")
PY
"${DSLURM[@]}" status "$job_id"
echo "--- ledger ($run_dir/ledger.jsonl)"
.venv/bin/python - "$run_dir" <<'PY'
import sys
from dslurm.ledger import read_events
for e in read_events(sys.argv[1]):
    keep = {k: v for k, v in e.items() if k not in ("t", "host", "job_id") and not isinstance(v, (dict, list))}
    print(" ", e["event"], keep)
PY
echo "--- checkpoints"
"${DSLURM[@]}" ckpt ls "$run_dir" || true
if "${DSLURM[@]}" report --help >/dev/null 2>&1; then "${DSLURM[@]}" report "$run_dir"; fi
