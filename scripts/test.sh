#!/usr/bin/env bash
# The test command: set up (idempotent), then run every layer of the suite:
# unit (pure), integration (torchrun + gloo on this machine), cluster (the built-in
# local real Slurm cluster, started by the test session's fixture), after ruff and mypy; then
# the checkpoint / trainer / init_from layer under the second torch (scripts/test-torch2.sh).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not cluster"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Static checks first: lint (ruff) and types (mypy --strict on the toolkit, dslurm/, and the trainer, train/).
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
# The second torch (pyproject.toml's tested range; docs/checkpoint.md "Tested torch versions"): the
# checkpoint / trainer / init_from layer again under .venv-torch2 (scripts/setup.sh). Skipped with
# DSLURM_TORCH2=none, and when pytest was given arguments (a selection of the first layer's tests).
if [ "${DSLURM_TORCH2:-}" != none ] && [ "$#" -eq 0 ]; then
  set +e
  bash scripts/test-torch2.sh
  rc2=$?
  set -e
  [ "$rc" -ne 0 ] || rc=$rc2
fi
exit "$rc"
