#!/usr/bin/env bash
# The GPU self-check in one line: bash bench/gpu_check.sh OUT.json [more `dslurm selftest` flags]
# Runs `dslurm selftest --gpu` (docs/gpu.md) from this checkout with the Python that holds
# the machine's CUDA build of torch ($PYTHON, default python3), writes the JSON report to OUT.json
# and prints it. Installs nothing: the project's Python packages must be importable (pip install -e .,
# or on PYTHONPATH); the check below names any that is missing. Exit 0: every part ran and met its
# goal; 6: a part failed or a goal was missed (the report says which); 2: a usage error.
set -euo pipefail
if [ $# -lt 1 ] || [ -z "$1" ]; then
  echo "usage: bash bench/gpu_check.sh OUT.json [dslurm selftest flags]" >&2
  exit 2
fi
out=$1
shift
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
missing=$("$py" - <<'PY'
import importlib.util
need = {"torch": "torch (a CUDA build)", "yaml": "pyyaml", "hostlist": "python-hostlist", "h5py": "h5py",
        "numpy": "numpy", "pynvml": "nvidia-ml-py"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
PY
)
if [ -n "$missing" ]; then
  echo "gpu_check: $py lacks: $missing. Fix: pip install -e . with that Python, or put them on PYTHONPATH" >&2
  exit 2
fi
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$py" -m dslurm selftest --gpu --out "$out" "$@"
