"""Sweeps on Slurm job arrays (docs/sweeps.md): spec (the sweep file, its tasks, their names,
the split by MaxArraySize; pure), build (every task resolved, the array's flags and scripts),
submit (`dslurm submit --sweep`, `dslurm render --sweep`), report (`dslurm status|report
SWEEP_DIR`)."""
