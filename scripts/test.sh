#!/usr/bin/env bash
# The test command: set up (idempotent), then run every layer of the suite:
# unit (pure), integration (torchrun + gloo on this machine), cluster (the built-in
# local real Slurm cluster, started by the test session's fixture).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not cluster"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; that is a failure here" >&2
  exit 1
fi
exit "$rc"
