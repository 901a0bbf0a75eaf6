#!/usr/bin/env bash
# The test command: set up (idempotent), then run every layer of the suite:
# unit (pure), integration (torchrun + gloo on this machine), cluster (the built-in
# local real Slurm cluster, started by the test session's fixture), after ruff and mypy.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not cluster"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Static checks first: lint (ruff) and types (mypy on the torch-free toolkit, dslurm/).
.venv/bin/ruff check .
.venv/bin/mypy
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "test.sh: pytest collected no tests; that is a failure here" >&2
  exit 1
fi
exit "$rc"
