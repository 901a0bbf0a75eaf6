"""Pre-flight burn-in: NVML health, GEMM throughput, all-reduce busbw, slow-node localization.

Light to import (no torch): `dslurm.preflight.cli` is loaded by the `dslurm` CLI.
See docs/burnin.md for the checks, thresholds and fault injection.
"""

# Exit codes of `python -m dslurm.preflight.run` (rank 0; under srun each task's code is
# kept, torchrun folds any non-zero worker code into 1) and of `dslurm burnin`.
EXIT_OK = 0
"""Every node passed."""
EXIT_BAD_NODES = 3
"""At least one node failed; report["verdict"]["bad_nodes"] names them and why."""
EXIT_UNLOCALIZED = 4
"""A cluster-wide threshold failed (e.g. inter-node busbw) but no single node was to blame."""
EXIT_NO_REPORT = 5
"""`dslurm burnin`: the runner crashed before writing its report."""
