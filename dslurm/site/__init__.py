"""A site config from the cluster itself, and the check that a site config keeps its promises.

discover (`dslurm site discover`): Slurm's answers (dslurm/slurm/facts.py) and one node's probe (probe.py) ->
a commented site YAML. check (`dslurm site check`): each promise a row (check.py), decided from
Slurm's answers and three small jobs (jobs.py). Torch-free: the probe imports torch on the node,
inside a try, to report whether it can.
"""
