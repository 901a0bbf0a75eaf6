"""The first link end to end on the real local Slurm: dslurm submit -> sbatch -> srun ->
dslurm launch -> torchrun (or one srun task per process) -> a gloo process group.

The job runs `dslurm.launch.probe` in place of the trainer: every rank all-reduces its rank and
writes what it saw into the run directory.
"""

from __future__ import annotations

import json
import re

import pytest

from cluster_jobs import probe_job
from dslurm import slurm


@pytest.mark.parametrize("mode", ["torchrun", "srun"])
def test_two_node_job_runs_four_ranks_on_two_hosts(slurm_cluster, cli, tmp_path, mode):
    env = slurm_cluster.env()
    res = cli("submit", "--site", "site-configs/local.yaml", "--job", probe_job(tmp_path, mode), env=env)
    assert res.returncode == 0, res.stderr
    job_id = int(re.search(r"submitted job (\d+)", res.stdout).group(1))
    state = slurm.wait_job(job_id, timeout=180, env=env)
    logs = "\n".join(p.read_text() for p in (tmp_path / "run" / "logs").glob("*"))
    assert state == "COMPLETED", logs
    recs = [json.loads(p.read_text()) for p in sorted((tmp_path / "run" / "probe").glob("rank-*.json"))]
    assert sorted(r["rank"] for r in recs) == [0, 1, 2, 3], logs
    assert all(r["world_size"] == 4 and r["allreduce_sum"] == 6.0 for r in recs)
    hosts = {r["hostname"] for r in recs}
    assert len(hosts) == 2, hosts
    assert sorted({(r["hostname"], r["node_rank"]) for r in recs}, key=lambda x: x[1]) == \
        [(h, i) for i, h in enumerate(sorted(hosts))]
    assert len({(r["master_addr"], r["master_port"]) for r in recs}) == 1
    assert {r["group_rank"] for r in recs} == {0, 1}
    info = slurm.job_info(job_id, env=env)
    assert info["state"] == "COMPLETED"


def test_submit_to_missing_partition_gives_slurms_reason(slurm_cluster, cli, tmp_path):
    res = cli("submit", "--site", "site-configs/local.yaml", "--site-set", "slurm.partition=nosuch",
                  "--job", probe_job(tmp_path, "torchrun"), env=slurm_cluster.env())
    assert res.returncode != 0
    assert "invalid partition" in res.stderr.lower() and "Traceback" not in res.stderr
