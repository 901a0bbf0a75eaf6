"""Parsers of Slurm 22.05 output (samples captured from the local cluster)."""

from __future__ import annotations

import pytest

from dslurm import slurm
from dslurm.errors import SlurmError

SCONTROL_JOB = (
    "JobId=6034225 JobName=wrap UserId=root(0) GroupId=root(0) MCS_label=N/A "
    "Priority=4294901758 Nice=0 Account=(null) QOS=(null) JobState=COMPLETED Reason=None "
    "Dependency=(null) Requeue=1 Restarts=2 BatchFlag=1 Reboot=0 ExitCode=0:0 "
    "RunTime=00:00:00 TimeLimit=365-00:00:00 Partition=debug AllocNode:Sid=localhost:2369 "
    "NodeList=node[1-2] BatchHost=node1 NumNodes=2 NumCPUs=2 NumTasks=2 CPUs/Task=1 "
    "ReqB:S:C:T=0:0:*:* TRES=cpu=2,node=2,billing=2 Command=/x/train.sh --lr=3 a b "
    "WorkDir=/tmp StdOut=/tmp/slurm-6034225.out Power= "
)
SCONTROL_NODE = (
    "NodeName=node1 Arch=x86_64 CoresPerSocket=4  CPUAlloc=0 CPUTot=4 "
    "OS=Linux 6.18.44-fc-v657 #1 SMP PREEMPT_DYNAMIC @0  RealMemory=4096 State=IDLE "
    "Partitions=debug"
)


def test_kv_line_keeps_values_with_spaces_and_equals() -> None:
    rec = slurm.parse_kv_line(SCONTROL_JOB)
    assert rec["JobId"] == "6034225"
    assert rec["TRES"] == "cpu=2,node=2,billing=2"
    assert rec["AllocNode:Sid"] == "localhost:2369"
    assert rec["CPUs/Task"] == "1"
    assert rec["Command"] == "/x/train.sh --lr=3 a b"  # `--lr=3` is not a key
    assert rec["Power"] == ""
    node = slurm.parse_kv_line(SCONTROL_NODE)
    assert node["OS"] == "Linux 6.18.44-fc-v657 #1 SMP PREEMPT_DYNAMIC @0"
    assert node["RealMemory"] == "4096"


def test_job_info_from_scontrol() -> None:
    (rec,) = slurm.parse_scontrol_records(SCONTROL_JOB + "\n\n")
    info = slurm.job_info_from_scontrol(rec)
    assert info == {"job_id": 6034225, "name": "wrap", "state": "COMPLETED",
                    "nodes": "node[1-2]", "num_nodes": 2, "restarts": 2, "exit_code": "0:0",
                    "reason": "", "source": "scontrol"}


def test_job_info_pending_has_reason_and_no_nodes() -> None:
    rec = slurm.parse_kv_line("JobId=7 JobName=x JobState=PENDING Reason=Resources "
                              "Restarts=0 ExitCode=0:0 NodeList=(null) NumNodes=2-2")
    info = slurm.job_info_from_scontrol(rec)
    assert (info["state"], info["reason"], info["nodes"], info["num_nodes"]) == (
        "PENDING", "Resources", "", 2)


# `sacct -D -X -n -P -o JobID,JobName,State,NodeList,ExitCode,Reason,NNodes`, captured from the local
# cluster: the demo job (preempted, stopped by USR2, completed), a job that failed with 76 after a
# requeue, and (without -X) a node failure that Slurm requeued, with its step lines.
SACCT_DEMO = ("6042242|tiny-2node|REQUEUED|node[1-2]|0:0|None|2\n"
              "6042242|tiny-2node|REQUEUED|node[1-2]|0:0|BeginTime|2\n"
              "6042242|tiny-2node|COMPLETED|node[1-2]|0:0|BeginTime|2\n")
SACCT_FAILED = "6041894|race-a|REQUEUED|node[1-2]|0:0|None|2\n6041894|race-a|FAILED|node[1-2]|76:0|BeginTime|2\n"
SACCT_NODE_FAIL = ("6042853|nodeloss|NODE_FAIL|node[1-2]|0:0|None|2\n6042853.batch|batch|FAILED|node1|15:0||1\n"
                   "6042853.0|python|FAILED|node[1-2]|1:0||2\n6042853|nodeloss|COMPLETED|node[1,3]|0:0|BeginTime|2\n"
                   "6042853.batch|batch|COMPLETED|node1|0:0||1\n6042853.0|python|COMPLETED|node[1,3]|0:0||2\n")


def test_sacct_counts_restarts_and_drops_a_stale_pending_reason() -> None:
    info = slurm.parse_sacct(SACCT_DEMO)
    assert info == {"job_id": 6042242, "name": "tiny-2node", "state": "COMPLETED", "nodes": "node[1-2]",
                    "num_nodes": 2, "restarts": 2, "exit_code": "0:0", "reason": "", "source": "sacct"}
    failed = slurm.parse_sacct(SACCT_FAILED)
    assert failed is not None and (failed["state"], failed["restarts"], failed["exit_code"]) == ("FAILED", 1, "76:0")
    moved = slurm.parse_sacct(SACCT_NODE_FAIL)  # step lines are not incarnations
    assert moved is not None and (moved["state"], moved["restarts"], moved["nodes"]) == ("COMPLETED", 1, "node[1,3]")


def test_status_of_a_job_gone_from_the_controller_comes_from_accounting(monkeypatch, capsys) -> None:
    import subprocess

    from dslurm.cli import main

    calls = []

    def fake(args, **kw):
        calls.append(args)
        if args[0] == "scontrol":
            return subprocess.CompletedProcess(args, 1, "", "slurm_load_jobs error: Invalid job id specified\n")
        return subprocess.CompletedProcess(args, 0, SACCT_DEMO, "")

    monkeypatch.setattr(slurm, "run_cmd", fake)
    assert main(["status", "6042242"]) == 0
    out = capsys.readouterr().out
    assert "restarts: 2" in out and "state: COMPLETED" in out and "reason: -" in out
    assert "BeginTime" not in out and "None" not in out and "accounting (sacct" in out
    assert "-D" in calls[-1]  # every incarnation, so the restarts can be counted
    assert main(["status", "6042242", "--json"]) == 0
    import json
    assert json.loads(capsys.readouterr().out)["restarts"] == 2


def test_parse_sacct() -> None:
    out = "6034231|wrap|CANCELLED by 0|node[1-2]|0:15|None|2\n"
    info = slurm.parse_sacct(out)
    assert info is not None
    assert (info["job_id"], info["state"], info["nodes"], info["exit_code"]) == (
        6034231, "CANCELLED", "node[1-2]", "0:15")
    assert slurm.parse_sacct("") is None
    pending = slurm.parse_sacct("9|x|PENDING|None assigned|0:0|Resources|1")
    assert pending is not None and pending["nodes"] == "" and pending["reason"] == "Resources"


def test_parse_sinfo_nodes_merges_partitions_and_flags_not_responding() -> None:
    out = "node1|idle|4|4096|debug*\nnode2|down*|4|4096|debug*\nnode1|idle|4|4096|long\n"
    nodes = slurm.parse_sinfo_nodes(out)
    assert [n["name"] for n in nodes] == ["node1", "node2"]
    assert nodes[0]["partitions"] == ["debug", "long"]
    assert nodes[1]["state"] == "down" and nodes[1]["responding"] is False
    assert nodes[0]["cpus"] == 4 and nodes[0]["memory_mb"] == 4096


def test_parse_squeue() -> None:
    jobs = slurm.parse_squeue("12|train|RUNNING|2|node[1-2]|root|0:05\n13|x|PENDING|1|(Resources)|root|0:00\n")
    assert jobs[0]["job_id"] == "12" and jobs[0]["num_nodes"] == 2
    assert jobs[1]["nodes_or_reason"] == "(Resources)"


@pytest.mark.parametrize("out,expected", [("42\n", 42), ("42;dslurm\n", 42)])
def test_parse_parsable_job_id(out: str, expected: int) -> None:
    assert slurm.parse_parsable_job_id(out) == expected


def test_parse_parsable_job_id_rejects_garbage() -> None:
    with pytest.raises(SlurmError, match="expected a job id"):
        slurm.parse_parsable_job_id("sbatch: warning\n")


def test_failure_message_carries_reason_and_hint_when_unreachable() -> None:
    msg = slurm.failure_message(["sbatch", "x.sh"], 1, "sbatch: error: Batch job submission "
                                "failed: Unable to contact slurm controller (connect failure)\n")
    assert "Unable to contact slurm controller" in msg and "dslurm cluster up" in msg
    msg = slurm.failure_message(["sbatch", "-p", "nope"], 1,
                                "sbatch: error: invalid partition specified: nope")
    assert "invalid partition specified: nope" in msg and "cluster up" not in msg


def test_run_cmd_missing_binary_says_what_to_install() -> None:
    with pytest.raises(SlurmError, match="not installed.*slurm-client"):
        slurm.run_cmd(["dslurm-no-such-slurm-command"])


def test_sacct_json_incarnations_and_sinfo_down_nodes():
    import json

    from dslurm.slurm import parse_sacct_incarnations, parse_sinfo_down

    out = json.dumps({"jobs": [
        {"state": {"current": "CANCELLED", "reason": "None"}, "nodes": "node1", "time": {"start": 20, "end": 30}},
        {"state": {"current": "REQUEUED", "reason": "None"}, "nodes": "node[1-2]", "time": {"start": 5, "end": 9}},
        {"state": "NODE_FAIL", "nodes": "node2", "time": {"start": 10, "end": 15}}]})
    assert [r["state"] for r in parse_sacct_incarnations(out)] == ["REQUEUED", "NODE_FAIL", "CANCELLED"]
    assert parse_sacct_incarnations("garbage") == []
    nodes = json.dumps({"nodes": [{"name": "node1", "state": "idle", "state_flags": []},
                                  {"name": "node2", "state": "down", "state_flags": ["NOT_RESPONDING"]},
                                  {"name": "node3", "state": "down", "state_flags": []}]})
    assert parse_sinfo_down(nodes, ["node1", "node2"]) == {"node2": "DOWN+NOT_RESPONDING"}


# A 2+1 job with spares under --no-kill that lost node2 then node3 and finished on node1: Slurm
# 22.05 closes a RESIZING record per lost node (recorded from the local cluster, sacct -D -X -P).
SACCT_RESIZED = """6043545|spares|RESIZING|node[1-3]|0:0|None|3
6043545|spares|RESIZING|node[1,3]|0:0|None|2
6043545|spares|COMPLETED|node1|0:0|None|1
"""


def test_a_job_that_shrank_inside_its_allocation_has_no_restart() -> None:
    info = slurm.parse_sacct(SACCT_RESIZED)
    assert info is not None and (info["state"], info["restarts"], info["nodes"]) == ("COMPLETED", 0, "node1")
    recs = {"jobs": [{"state": {"current": s}, "nodes": n, "time": {"start": t, "end": t + 1}}
                     for s, n, t in (("RESIZING", "node[1-3]", 1), ("RESIZING", "node[1,3]", 2),
                                     ("COMPLETED", "node1", 3))]}
    import json

    incs = slurm.parse_sacct_incarnations(json.dumps(recs))
    assert [i["state"] for i in incs] == ["COMPLETED"]  # one start: requeue-me indexes restarts by these


def test_node_addresses_come_from_scontrol_with_the_default_port_when_none_is_named():
    from dslurm.slurm import SLURMD_PORT, parse_node_addresses

    out = ("NodeName=node1 Arch=x86_64 CoresPerSocket=1 NodeAddr=127.0.0.1 NodeHostName=node1 Port=16821 State=IDLE\n"
           "NodeName=gpu7 NodeAddr=10.0.0.7 State=ALLOCATED\n\n")
    assert parse_node_addresses(out) == {"node1": ("127.0.0.1", 16821), "gpu7": ("10.0.0.7", SLURMD_PORT)}
    # scontrol leaves the Port out where it is the cluster's SlurmdPort (the local cluster's node1: 16820)
    assert parse_node_addresses(out, 16820)["gpu7"] == ("10.0.0.7", 16820)


def test_the_slurmd_port_comes_from_the_config_else_slurms_default():
    from dslurm.slurm import SLURMD_PORT, parse_slurmd_port

    assert parse_slurmd_port("SlurmctldPort           = 16817\nSlurmdPort              = 16820\n") == 16820
    assert parse_slurmd_port("SlurmctldPort = 6817\n") == SLURMD_PORT == 6818


def test_the_array_task_that_kept_the_arrays_id_reads_only_its_own_incarnations():
    # sacct -j 6048337 of a 2-task array (recorded from the local cluster): task 1 kept the
    # array's id, task 0 got 6048338; both come back.
    import json

    recs = {"jobs": [{"job_id": 6048337, "array": {"job_id": 6048337, "task_id": 1},
                      "state": {"current": "PREEMPTED"}, "nodes": "node3", "time": {"start": 5, "end": 9}},
                     {"job_id": 6048338, "array": {"job_id": 6048337, "task_id": 0},
                      "state": {"current": "COMPLETED"}, "nodes": "node3", "time": {"start": 7, "end": 12}}]}
    incs = slurm.parse_sacct_incarnations(json.dumps(recs), 6048337)
    assert [i["state"] for i in incs] == ["PREEMPTED"]
    assert len(slurm.parse_sacct_incarnations(json.dumps(recs))) == 2  # no id: every record, as before


def test_the_own_record_of_an_array_id_is_its_own_not_a_siblings() -> None:
    """`scontrol -o show job 77` for the array task that kept the array's id lists its siblings
    too, RUNNING ones first: job_info and supervise's state read job 77's record."""
    out = ("JobId=78 ArrayJobId=77 ArrayTaskId=1 JobName=s JobState=RUNNING Reason=None NodeList=node2\n"
           "JobId=77 ArrayJobId=77 ArrayTaskId=0 JobName=s JobState=COMPLETING Reason=None NodeList=node1\n")
    rec = slurm.own_record(out, 77)
    assert rec is not None and rec["NodeList"] == "node1"
    assert slurm.parse_job_state(out, "77") == "COMPLETING" and slurm.parse_job_state(out, 79) is None
    assert slurm.own_record("", 77) is None
