"""`dslurm selftest chaos`: a seeded soak of random outside faults against a training job on the
built-in local cluster, then the same training uninterrupted, compared (docs/chaos.md).

schedule (the seeded faults; pure), inject (one fault done to the live job), jobs (the job under
faults, the reference, the final parameters), promises (what must hold; pure), table (the table
and its PNG), run (the soak), cli (flags -> a Soak). The processes and the controller are hit
through dslurm/cluster/disrupt.py and dslurm.cluster.restart_slurmctld, shared with the cluster
tests.
"""
