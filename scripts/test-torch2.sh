#!/usr/bin/env bash
# The checkpoint / trainer / init_from layer under the second torch (.venv-torch2, made by
# scripts/setup.sh): the tests where dslurm meets DCP's internals (the streamed crc32 writer, the
# reader that loads into the model, their public-DCP fallback), FSDP2 saves and a kill -9 mid-save
# under torchrun, and init_from, whose trainer runs (FSDP x TP 2x2 and PP 2 under torchrun) match
# transformers' own Llama within 1e-5: the trainer's layouts on this torch. A few minutes (the
# full layout parity, ~7 min more here, stays in the first layer); scripts/test.sh runs it after
# the first layer (init_from's two CLI-only cases too: nothing of torch's in them). Extra arguments go to pytest.
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
  -k "not resume_wins_over_init_from and not does_not_fit_the_job" \
  "$@"
