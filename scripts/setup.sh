#!/usr/bin/env bash
# Set up a fresh machine for dslurm: system packages (Slurm, munge, tini, MariaDB for
# accounting, shellcheck) and a virtual environment in .venv with the test extras.
# Idempotent: a second run only checks. torch is pinned to the CPU build 2.13.0 here;
# on a GPU cluster, install your site's CUDA build of torch instead. A second environment,
# .venv-torch2, holds the second torch the suite tests (2.14.1, below).
set -euo pipefail
cd "$(dirname "$0")/.."

if [ -x scripts/install-system-deps.sh ] || [ -f scripts/install-system-deps.sh ]; then
  bash scripts/install-system-deps.sh
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.dslurm-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  # The CPU wheel first, so the project's `torch>=` requirement installs nothing more.
  .venv/bin/python -m pip install -q "torch==2.13.0"
  .venv/bin/python -m pip install -q -e '.[test]'
  touch "$stamp"
fi

# The second torch: the checkpoint / trainer / init_from layer also runs under it (scripts/test.sh,
# docs/checkpoint.md "Tested torch versions"), in its own environment. pip finds the wheel and its
# CUDA libraries where this machine's pip is configured to look (here a local index); the CUDA build
# runs on CPU. DSLURM_TORCH2=none skips it (and the layer); another version tests that one instead.
TORCH2=${DSLURM_TORCH2:-2.14.1}
stamp2=.venv-torch2/.dslurm-installed
if [ "$TORCH2" != none ]; then
  if [ ! -x .venv-torch2/bin/python ]; then
    "$PY" -m venv .venv-torch2
  fi
  if [ ! -f "$stamp2" ] || [ pyproject.toml -nt "$stamp2" ] || [ "$(cat "$stamp2")" != "$TORCH2" ]; then
    .venv-torch2/bin/python -m pip install -q --upgrade pip
    .venv-torch2/bin/python -m pip install -q "torch==$TORCH2"
    # The runtime dependencies, the test runner and transformers (init_from's reference); no trackers.
    .venv-torch2/bin/python -m pip install -q -e '.[test-torch2]'
    echo "$TORCH2" > "$stamp2"
  fi
  echo "setup: ok (.venv-torch2 ready: torch $TORCH2)"
fi
echo "setup: ok (.venv ready)"
