"""SLURM_* -> node rank, master, port: pure derivation, uneven and odd host lists."""

from __future__ import annotations

import pytest

from dslurm.errors import UserError
from dslurm.launch.slurm_env import derive, master_port

BASE = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[001-003,010]", "SLURM_NNODES": "4",
        "SLURM_NODEID": "3", "SLURM_GPUS_ON_NODE": "8"}


def test_issue_example_node_rank_master_and_port():
    info = derive(BASE)
    assert info.node_rank == 3 and info.hostname == "gpu010"
    assert info.master_addr == "gpu001" and info.hosts == ["gpu001", "gpu002", "gpu003", "gpu010"]
    assert info.nproc_per_node == 8 and info.world_size == 32
    ports = {derive({**BASE, "SLURM_NODEID": str(i)}).master_port for i in range(4)}
    assert len(ports) == 1 and 20000 <= ports.pop() < 32000


def test_port_differs_between_jobs_and_restarts():
    assert master_port("4242") != master_port("4243")
    assert master_port("4242", 0) != master_port("4242", 1)
    assert derive({**BASE, "SLURM_RESTART_COUNT": "2"}).master_port == master_port("4242", 2)
    assert master_port("123_4") == master_port("1234")  # array job ids keep their digits


@pytest.mark.parametrize("nodelist,expected", [
    ("node-a1,node-b[2-3]", ["node-a1", "node-b2", "node-b3"]),
    ("x.y-z[9-11]", ["x.y-z9", "x.y-z10", "x.y-z11"]),  # unpadded, crosses a digit boundary
    ("c1-r[01-02]n7", ["c1-r01n7", "c1-r02n7"]),  # range in the middle of the name
    ("solo", ["solo"]),
])
def test_odd_host_names(nodelist, expected):
    info = derive({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": nodelist, "SLURM_NNODES": str(len(expected)),
                   "SLURM_NODEID": "0"}, nproc_per_node=2)
    assert info.hosts == expected and info.master_addr == expected[0]


def test_step_variables_win_over_job_variables():
    env = {**BASE, "SLURM_STEP_NODELIST": "gpu[002-003]", "SLURM_STEP_NUM_NODES": "2", "SLURM_NODEID": "1"}
    info = derive(env)
    assert info.master_addr == "gpu002" and info.hostname == "gpu003" and info.nnodes == 2


@pytest.mark.parametrize("drop,var", [("SLURM_JOB_ID", "SLURM_JOB_ID"), ("SLURM_NODEID", "SLURM_NODEID"),
                                      ("SLURM_JOB_NODELIST", "SLURM_JOB_NODELIST"),
                                      ("SLURM_NNODES", "SLURM_NNODES")])
def test_missing_variable_is_named(drop, var):
    env = {k: v for k, v in BASE.items() if k != drop}
    with pytest.raises(UserError, match=var):
        derive(env)


@pytest.mark.parametrize("change,msg", [
    ({"SLURM_NNODES": "3"}, "SLURM_NNODES=3 but SLURM_JOB_NODELIST expands to 4 hosts"),
    ({"SLURM_NODEID": "4"}, "SLURM_NODEID=4 but only 4 nodes"),
    ({"SLURM_NODEID": "x"}, "SLURM_NODEID='x' is not an integer"),
    ({"SLURM_JOB_NODELIST": "gpu[3-1]"}, "not a valid host list"),
    ({"SLURMD_NODENAME": "gpu002"}, "SLURMD_NODENAME=gpu002 is host #1"),
])
def test_inconsistent_variables_are_explained(change, msg):
    with pytest.raises(UserError, match=msg.replace("[", r"\[").replace("(", r"\(")):
        derive({**BASE, **change})


def test_nproc_needs_gpus_or_flag_and_cannot_exceed_gpus():
    cpu = {k: v for k, v in BASE.items() if k != "SLURM_GPUS_ON_NODE"}
    with pytest.raises(UserError, match="--nproc-per-node"):
        derive(cpu)
    assert derive(cpu, nproc_per_node=2).world_size == 8
    with pytest.raises(UserError, match="gave this node 8 GPUs"):
        derive(BASE, nproc_per_node=9)
    assert derive({**cpu, "SLURM_GPUS_PER_NODE": "h100:4"}).nproc_per_node == 4


def test_srun_mode_uses_slurm_ranks_and_uneven_tasks_per_node():
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_NNODES": "3", "SLURM_NODEID": "2",
           "SLURM_PROCID": "6", "SLURM_LOCALID": "0", "SLURM_NTASKS": "7", "SLURM_TASKS_PER_NODE": "3(x2),1"}
    info = derive(env, mode="srun")
    assert (info.rank, info.local_rank, info.world_size, info.local_world_size) == (6, 0, 7, 1)
    wenv = info.worker_env()
    assert wenv["RANK"] == "6" and wenv["WORLD_SIZE"] == "7" and wenv["LOCAL_WORLD_SIZE"] == "1"
    assert wenv["MASTER_ADDR"] == "n1"
    with pytest.raises(UserError, match="SLURM_TASKS_PER_NODE='3\\(x2\\),2' gives"):
        derive({**env, "SLURM_TASKS_PER_NODE": "3(x2),2"}, mode="srun")
    with pytest.raises(UserError, match="SLURM_PROCID"):
        derive({k: v for k, v in env.items() if k != "SLURM_PROCID"}, mode="srun")


@pytest.mark.parametrize("port", ["0", "65536", "99999", "-1"])
def test_master_port_outside_the_tcp_range_is_refused(port):
    with pytest.raises(UserError, match=rf"DSLURM_MASTER_PORT={port} must be between 1 and 65535\. Fix: "):
        derive({**BASE, "DSLURM_MASTER_PORT": port})
    assert derive({**BASE, "DSLURM_MASTER_PORT": "65535"}).master_port == 65535


@pytest.mark.parametrize("per_node,n", [("a100:2,v100:2", 4), ("8", 8), ("h100:8", 8), ("gpu:a100:2,3", 5)])
def test_typed_gpu_counts_are_summed(per_node, n):
    cpu = {k: v for k, v in BASE.items() if k != "SLURM_GPUS_ON_NODE"}
    assert derive({**cpu, "SLURM_GPUS_PER_NODE": per_node}).nproc_per_node == n


def test_gpus_per_node_that_is_not_a_count_is_named():
    cpu = {k: v for k, v in BASE.items() if k != "SLURM_GPUS_ON_NODE"}
    with pytest.raises(UserError, match=r"SLURM_GPUS_PER_NODE='a100:2,v100:x': 'v100:x' is not \[type:\]count"):
        derive({**cpu, "SLURM_GPUS_PER_NODE": "a100:2,v100:x"})


def test_no_gpus_on_the_node_says_so_not_a_flag_the_user_never_passed():
    with pytest.raises(UserError) as e:
        derive({**BASE, "SLURM_GPUS_ON_NODE": "0"})
    msg = str(e.value)
    assert "no GPUs on this node (SLURM_GPUS_ON_NODE='0')" in msg and "--gpus-per-node=N" in msg
    assert "--nproc-per-node=0" not in msg
    assert derive({**BASE, "SLURM_GPUS_ON_NODE": "0"}, nproc_per_node=2).world_size == 8  # a CPU run


@pytest.mark.parametrize("job_id", ["abc", "12x", "", " ", "local-", "4242_1"])
def test_non_numeric_job_id_is_refused(job_id):
    with pytest.raises(UserError, match="SLURM_JOB_ID"):
        derive({**BASE, "SLURM_JOB_ID": job_id})


def test_job_ids_slurm_and_the_local_runner_use_are_accepted():
    assert derive({**BASE, "SLURM_JOB_ID": "4242"}).job_id == "4242"
    assert derive({**BASE, "SLURM_JOB_ID": "local-77"}).job_id == "local-77"  # dslurm.api.run_local
    env = {k: v for k, v in BASE.items() if k != "SLURM_JOB_ID"}
    with pytest.raises(UserError, match="SLURM_JOBID='x' is not a Slurm job id"):
        derive({**env, "SLURM_JOBID": "x"})
