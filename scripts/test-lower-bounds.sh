#!/usr/bin/env bash
# The runtime dependency ranges' lower bounds are tested versions (pyproject.toml): the data
# tests (tokenizers, parquet through pyarrow) run with the lowest versions the ranges allow,
# installed beside the suite's pinned ones and put first on the path.
#   scripts/test-lower-bounds.sh            (about 40 s here)
set -euo pipefail
cd "$(dirname "$0")/.."
LOW=${LOW_DIR:-.venv/lower-bounds}
.venv/bin/python -m pip install -q --no-deps --target "$LOW" "tokenizers==0.21.0" "pyarrow==18.0.0"
PYTHONPATH="$LOW" .venv/bin/python -c 'import tokenizers, pyarrow; print("lower bounds:", "tokenizers", tokenizers.__version__, "pyarrow", pyarrow.__version__)'
PYTHONPATH="$LOW" exec .venv/bin/python -m pytest -q -p no:cacheprovider tests/unit/test_data_real_tokenizer.py tests/unit/test_data_sources.py "$@"
