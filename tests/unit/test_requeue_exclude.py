"""A requeue's exclusion never leaves the job unplaceable (dslurm/requeue/exclude.py). Pure, and
`act_on` with Slurm's commands recorded (pytest-mock on dslurm.slurm.run_cmd: what Slurm would do is
the cluster's business, tests/cluster/test_fault_matrix.py; here only what dslurm asks for)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from dslurm import endings as E
from dslurm.observe import events as ev
from dslurm.requeue import Decision, act_on
from dslurm.requeue.exclude import placeable_exclusion, schedulable
from dslurm.run import add_to_blocklist


def _nodes(*pairs: tuple[str, str], part: str = "debug") -> list[dict[str, object]]:
    return [{"name": n, "state": s, "partitions": [part]} for n, s in pairs]


def test_a_blocklist_the_partition_can_spare_is_excluded_whole() -> None:
    nodes = _nodes(("n1", "idle"), ("n2", "allocated"), ("n3", "mixed"), ("n4", "idle"))
    ex = placeable_exclusion(["n1"], nodes, "debug", need=3)
    assert ex.exclude == ["n1"] and ex.readmitted == [] and ex.reason == ""


def test_a_blocklist_that_would_keep_the_job_pending_for_ever_readmits_just_enough() -> None:
    # the chaos soak's case: 3 nodes, a 2+1 job, node1 blocklisted -> BadConstraints for ever
    nodes = _nodes(("node1", "idle"), ("node2", "idle"), ("node3", "idle"))
    ex = placeable_exclusion(["node1"], nodes, "debug", need=3)
    assert ex.exclude == [] and ex.readmitted == ["node1"]
    assert "partition debug has 3 node(s), 3 schedulable now, and the job needs 3" in ex.reason
    assert "pending for ever (BadConstraints)" in ex.reason
    # 5 nodes, 4 needed, 3 blocklisted: one stays out, the two that sort last come back
    nodes = _nodes(*[(f"n{i}", "idle") for i in range(1, 6)])
    ex = placeable_exclusion(["n5", "n1", "n3"], nodes, "debug", need=4)
    assert ex.exclude == ["n1"] and ex.readmitted == ["n3", "n5"]


def test_nodes_slurm_will_not_schedule_stay_excluded_and_do_not_count() -> None:
    nodes = _nodes(("n1", "down*"), ("n2", "idle"), ("n3", "idle"), ("n4", "drained"), ("n5", "idle"))
    # n1 and n4 are out anyway: excluding them costs the job nothing; n2 is needed back
    ex = placeable_exclusion(["n1", "n2", "n4"], nodes, "debug", need=3)
    assert ex.exclude == ["n1", "n4"] and ex.readmitted == ["n2"]
    # a node slurmctld's pings no longer reach (sinfo's '*': `responding` False) is out of use now:
    # kept excluded while the partition has a node to spare for it...
    silent = {"name": "n3", "state": "allocated", "responding": False, "partitions": ["debug"]}
    nodes = [*_nodes(("n1", "idle"), ("n2", "idle"), ("n4", "idle")), silent]
    ex = placeable_exclusion(["n2", "n3"], nodes, "debug", need=3)
    assert ex.exclude == ["n3"] and ex.readmitted == ["n2"]
    # ... and a schedulable one is readmitted while the job could not start now without it
    nodes = [*_nodes(("n1", "idle"), ("n2", "idle"), ("n4", "idle"), ("n5", "down")), silent]
    ex = placeable_exclusion(["n2", "n3"], nodes, "debug", need=3)
    assert ex.exclude == ["n3"] and ex.readmitted == ["n2"]
    assert "from starting on the nodes Slurm schedules now" in ex.reason


def test_nodes_out_of_use_now_are_readmitted_when_the_partition_cannot_spare_them() -> None:
    # chaos seed 4444: slurmctld restarted, node1 and node2 had not registered again (not responding)
    # and node3 was drained for a while; excluding node1 and node2 from the 2+1 job on 3 nodes left
    # it "never runnable" once all three were back. Slurm's never-runnable test counts every node of
    # the partition, whatever its state: no exclusion may exceed members - need.
    silent = [{"name": f"node{i}", "state": "allocated", "responding": False, "partitions": ["debug"]}
              for i in (1, 2)]
    nodes = [*silent, *_nodes(("node3", "drained"))]
    ex = placeable_exclusion(["node1", "node2"], nodes, "debug", need=3)
    assert ex.exclude == [] and ex.readmitted == ["node1", "node2"]
    # down and drained nodes likewise: the job waits for them (a reason a wait clears), never for ever
    nodes = _nodes(("n1", "down*"), ("n2", "drained"), ("n3", "idle"), ("n4", "idle"))
    ex = placeable_exclusion(["n1", "n2"], nodes, "debug", need=3)
    assert ex.exclude == ["n1"] and ex.readmitted == ["n2"]
    # a blocklisted node outside the partition is excluded and takes no room
    ex = placeable_exclusion(["n1", "x9"], nodes, "debug", need=3)
    assert ex.exclude == ["n1", "x9"] and ex.readmitted == []
    assert [schedulable(s) for s in ("idle", "mixed", "allocated+", "completing", "down*", "drain",
                                     "draining", "fail", "maint", "idle~", "unknown")] == \
        [True, True, True, True, False, False, False, False, False, True, False]


def test_nothing_known_to_cut_by_keeps_the_old_rule() -> None:
    nodes = _nodes(("n1", "idle"), ("n2", "idle"))
    assert placeable_exclusion(["n1"], nodes, None, need=2).exclude == ["n1"]  # no partition named
    assert placeable_exclusion(["n1"], [], "debug", need=2).exclude == ["n1"]  # sinfo did not answer
    assert placeable_exclusion(["n1"], nodes, "other", need=2).exclude == ["n1"]  # not its nodes
    assert placeable_exclusion(["n1"], nodes, "debug", need=0).exclude == ["n1"]  # no node count


def _slurm(mocker, sinfo: str) -> list[list[str]]:  # type: ignore[no-untyped-def]
    calls: list[list[str]] = []

    def run_cmd(args, **kw):  # type: ignore[no-untyped-def]
        calls.append(list(args))
        out = sinfo if args[0] == "sinfo" else ""
        return subprocess.CompletedProcess(args, 0, out, "")

    mocker.patch("dslurm.slurm.run_cmd", side_effect=run_cmd)
    return calls


def _requeue(tmp_path: Path) -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_PARTITION": "debug", "SLURM_JOB_NUM_NODES": "3"}
    act_on(Decision("requeue", 0, "crash: requeue"), E.Ending(E.CRASH, "rank 1 died"), env, tmp_path, [])


def test_act_on_readmits_what_the_job_needs_clears_the_old_exclusion_and_says_so(tmp_path: Path,
                                                                                 mocker) -> None:  # type: ignore[no-untyped-def]
    add_to_blocklist(tmp_path, ["node1"])
    calls = _slurm(mocker, "node1|idle|4|8000|debug*\nnode2|idle|4|8000|debug*\nnode3|idle|4|8000|debug*\n")
    _requeue(tmp_path)
    assert ["scontrol", "requeuehold", "7"] in calls
    assert ["scontrol", "update", "JobId=7", "ExcNodeList="] in calls  # an earlier exclusion cleared
    assert ["scontrol", "release", "7"] in calls
    waived = list(ev.of(ev.read(tmp_path), ev.BlocklistWaived))
    assert [(w.hosts, w.excluded) for w in waived] == [(["node1"], [])]
    assert (tmp_path / "blocklist.txt").read_text().split() == ["node1"]  # the file unchanged


def test_act_on_excludes_the_whole_blocklist_when_the_partition_has_room(tmp_path: Path,
                                                                         mocker) -> None:  # type: ignore[no-untyped-def]
    add_to_blocklist(tmp_path, ["node1"])
    calls = _slurm(mocker, "".join(f"node{i}|idle|4|8000|debug\n" for i in range(1, 5)))
    _requeue(tmp_path)
    assert ["scontrol", "update", "JobId=7", "ExcNodeList=node1"] in calls
    assert not list(ev.of(ev.read(tmp_path), ev.BlocklistWaived))
