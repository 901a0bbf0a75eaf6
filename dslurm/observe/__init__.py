"""Observe a run: the event ledger, `dslurm report`, `dslurm doctor`."""
