#!/usr/bin/env bash
# The checkpoint / trainer / init_from layer under the second torch (.venv-torch2, made by
# scripts/setup.sh): the tests where dslurm meets DCP's internals (the streamed crc32 writer, the
# reader that loads into the model, their public-DCP fallback), a resharded resume across world
# sizes under torchrun, init_from, and the trainer's layouts against one process. A few minutes;
# scripts/test.sh runs it after the first layer. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-torch2/bin/python ]; then
  echo "test-torch2: no .venv-torch2; run scripts/setup.sh (DSLURM_TORCH2=none skips this layer)" >&2
  exit 1
fi
.venv-torch2/bin/python -c 'import torch; print(f"test-torch2: torch {torch.__version__}")'
exec .venv-torch2/bin/python -m pytest -p no:cacheprovider \
  tests/integration/test_checkpoint_compat.py \
  tests/integration/test_checkpoint_local.py \
  tests/integration/test_checkpoint_fastpath.py \
  tests/integration/test_checkpoint_dist.py \
  tests/integration/test_init_from.py \
  tests/integration/test_parity.py \
  "$@"
