"""Training data on disk: HDF5 token files (tokenize, synthesize) and `dslurm data`."""
