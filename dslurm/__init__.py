"""dslurm: Slurm-native toolkit for distributed PyTorch training.

Nothing here imports torch at module level, so the CLI stays instant.
"""

__version__ = "0.1.0"
