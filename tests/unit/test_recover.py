"""In-allocation recovery, the pure part: which node is at fault, which spare comes in, when the
spares run out, and the gradient accumulation of a shrink (dslurm/recover/__init__.py)."""

from __future__ import annotations

import pytest

from dslurm import endings as E
from dslurm.config import load_job, load_site
from dslurm.config.layout import Layout
from dslurm.config.resolve import resolve
from dslurm.errors import UserError
from dslurm.recover import Nodes, initial_nodes, nodes_at_fault, plan_recovery, shrink_grad_accum

THREE = Nodes(training=("node1", "node2"), spares=("node3",))


def test_the_first_nodes_train_and_blocklisted_hosts_are_neither_training_nor_spare():
    assert initial_nodes(["node1", "node2", "node3"], 2) == THREE
    got = initial_nodes(["node1", "node2", "node3", "node4"], 2, blocked=["node2"])
    assert got == Nodes(training=("node1", "node3"), spares=("node4",), bad=("node2",))


def test_a_crash_with_every_node_up_is_nobodys_node():
    crash = E.Ending(E.CRASH, "rank 1 crashed", origin_rank=1, origin_host="node1")
    assert nodes_at_fault(crash, THREE.training) == []
    plan = plan_recovery(THREE, [], wanted=2, on_exhausted="requeue")
    assert plan.action == "same_nodes" and plan.nodes == THREE and not plan.removed


def test_a_lost_node_is_named_by_the_node_failure_and_by_slurms_down_state():
    lost = E.Ending(E.NODE_FAILURE, "node2 down", origin_host="node2")
    assert nodes_at_fault(lost, THREE.training) == ["node2"]
    # a crash whose node Slurm reports down meanwhile: that node is out too
    assert nodes_at_fault(E.Ending(E.CRASH, "x"), THREE.training, down=["node1"]) == ["node1"]
    # a down node outside the training set is not this step's fault
    assert nodes_at_fault(E.Ending(E.CRASH, "x"), THREE.training, down=["node3"]) == []


def test_a_burnin_rejection_takes_out_the_nodes_it_blocklisted():
    rejected = E.Ending(E.BURNIN_REJECTED, "bad gemm", origin_rank=0, origin_host="node1")
    assert nodes_at_fault(rejected, THREE.training, blocklist=["node2", "node9"]) == ["node2"]
    # the blocklist says nothing about a crash
    assert nodes_at_fault(E.Ending(E.CRASH, "x"), THREE.training, blocklist=["node2"]) == []


def test_a_spare_takes_the_lost_nodes_place():
    plan = plan_recovery(THREE, ["node2"], wanted=2, on_exhausted="requeue")
    assert plan.action == "spare" and plan.removed == ("node2",) and plan.added == ("node3",)
    assert plan.nodes == Nodes(training=("node1", "node3"), spares=(), bad=("node2",))


def test_a_spare_that_slurm_reports_down_is_skipped_and_taken_out():
    cur = Nodes(training=("a", "b"), spares=("c", "d"))
    plan = plan_recovery(cur, ["a"], wanted=2, on_exhausted="requeue", spares_down=["c"])
    assert plan.action == "spare" and plan.added == ("d",)
    assert plan.nodes == Nodes(training=("b", "d"), spares=(), bad=("a", "c"))


def test_spares_exhausted_requeue_or_shrink():
    after_swap = Nodes(training=("node1", "node3"), spares=(), bad=("node2",))
    req = plan_recovery(after_swap, ["node3"], wanted=2, on_exhausted="requeue")
    assert req.action == "requeue" and "node2, node3" in req.reason
    shrink = plan_recovery(after_swap, ["node3"], wanted=2, on_exhausted="shrink")
    assert shrink.action == "shrink" and shrink.nodes.training == ("node1",) and shrink.removed == ("node3",)
    # nothing left to shrink onto: requeue whatever the policy
    assert plan_recovery(Nodes(training=("a",)), ["a"], wanted=1, on_exhausted="shrink").action == "requeue"
    # partly covered: one spare for two lost nodes, shrink keeps the healthy one and the spare
    part = plan_recovery(Nodes(training=("a", "b", "c"), spares=("d",)), ["a", "b"], wanted=3,
                         on_exhausted="shrink")
    assert part.action == "shrink" and part.nodes.training == ("c", "d") and part.added == ("d",)


def test_a_crash_after_a_shrink_retries_on_the_same_fewer_nodes():
    shrunk = Nodes(training=("node1",), spares=(), bad=("node2", "node3"))
    plan = plan_recovery(shrunk, [], wanted=2, on_exhausted="shrink")
    assert plan.action == "same_nodes" and plan.nodes.training == ("node1",)


def _resolved(**job):
    site = load_site("site-configs/local.yaml")
    data = {"name": "t", "nodes": 2, "model": {"preset": "tiny"}, "parallel": {"tp": 2}, "train": {"global_batch": 8},
            **job}
    return resolve(site, load_job(data=data))


def test_shrink_keeps_the_global_batch_and_the_micro_batch():
    r = _resolved()  # 2 nodes x 2 procs, tp 2: dp 2, micro-batch 8 / 2 = 4
    assert r.layout.dp == 2 and r.layout.micro_batch(8, 1) == 4
    assert shrink_grad_accum(r, 1) == 2  # dp 1: 2 passes of 4
    r4 = _resolved(nodes=4, train={"global_batch": 16, "grad_accum": 2}, parallel={"tp": 1})
    # dp 8, grad_accum 2 -> micro 1; on 3 nodes dp 6 does not divide 16: no accumulation keeps it
    with pytest.raises(UserError, match="dp\\(6\\)"):
        shrink_grad_accum(r4, 3)
    assert shrink_grad_accum(r4, 2) == 4


def test_a_fixed_data_parallel_degree_cannot_shrink():
    r = _resolved(parallel={"tp": 2, "dp_shard": 2})
    with pytest.raises(UserError):
        shrink_grad_accum(r, 1)


def test_the_batch_rule_solved_for_grad_accum():
    lay = Layout.for_world(4, tp=2)
    assert lay.grad_accum_for(8, 4) == 1 and lay.grad_accum_for(16, 4) == 2
    with pytest.raises(UserError, match="global_batch\\(10\\)"):
        lay.grad_accum_for(10, 4)
