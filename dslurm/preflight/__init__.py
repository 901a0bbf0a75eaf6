"""Pre-flight burn-in: NVML health, GEMM throughput, all-reduce busbw, slow-node localization.

Light to import (no torch): `dslurm.preflight.cli` is loaded by the `dslurm` CLI.
See docs/burnin.md for the checks, thresholds and fault injection.
"""

# Exit codes of the standalone burn-in: one home, dslurm.exitcodes (BURNIN_*).
from dslurm.exitcodes import BURNIN_BAD_NODES as EXIT_BAD_NODES
from dslurm.exitcodes import BURNIN_NO_REPORT as EXIT_NO_REPORT
from dslurm.exitcodes import BURNIN_UNLOCALIZED as EXIT_UNLOCALIZED
from dslurm.exitcodes import OK as EXIT_OK

__all__ = ["EXIT_OK", "EXIT_BAD_NODES", "EXIT_UNLOCALIZED", "EXIT_NO_REPORT"]
