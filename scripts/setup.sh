#!/usr/bin/env bash
# Set up a fresh machine for dslurm: system packages (Slurm, munge, tini, MariaDB for
# accounting, shellcheck) and a virtual environment in .venv with the test extras.
# Idempotent: a second run only checks. torch is pinned to the CPU build 2.13.0 here;
# on a GPU cluster, install your site's CUDA build of torch instead.
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
echo "setup: ok (.venv ready)"
