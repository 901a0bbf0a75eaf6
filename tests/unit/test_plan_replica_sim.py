"""`plan simulate`'s replica mode (dslurm/plan/replica_sim.py): its arithmetic against numbers worked
by hand, and the CLI's refusals and output."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dslurm.cli import main
from dslurm.plan.recovery_sim import Draws
from dslurm.plan.replica_sim import batch_node_lost, epochs, replica_timeline
from dslurm.plan.simulate import SimConfig, draw_failures, goodput_per_trial, simulate

# 4 nodes of 8 GPUs, one group per node; horizon 2,000 s; sync saves of 10 s.
HAND = dict(gpus=32, mechanism="replica", save="sync", save_s=10, restart_s=600, requeue_s=300, quorum_s=5,
            step_s=6, group_restart_s=20, heal_s=10, horizon_h=2000 / 3600, trials=1)


def _draws(which: list[float]) -> Draws:
    # Failures after 100 s of training each, then a long stretch past the horizon; every one a node loss.
    return Draws(runs=np.array([[100.0, 100.0, 100.0, 10_000.0]]), node_loss=np.ones((1, 4), dtype=bool),
                 which=np.array([which]))


def test_epochs_sum_training_between_whole_job_failures():
    got = epochs(np.array([[1.0, 2.0, 3.0, 4.0]]), np.array([[False, True, False, True]]))
    assert got.tolist() == [[0.0, 3.0, 0.0, 7.0]]


def test_the_batch_node_is_one_node_in_nodes():
    d = Draws(runs=np.ones((1, 3)), node_loss=np.array([[True, True, False]]), which=np.array([[0.2, 0.3, 0.1]]))
    assert batch_node_lost(d, 4).tolist() == [[True, False, False]]  # 0.2 < 1/4; a crash is never the node
    with pytest.raises(ValueError, match="which"):
        batch_node_lost(Draws(runs=d.runs, node_loss=d.node_loss), 4)


def test_a_group_loss_costs_the_pause_and_a_share_a_batch_node_loss_rolls_back():
    # Failures at 100, 211 (after 100 + the 11 s pause), 322 (the batch node: which 0.1 < 1/4): the
    # job requeues (900 s) and resumes at 1,222 with 778 s to the horizon.
    cfg = SimConfig(**HAND, spares=10, repair_h=1000)
    line = replica_timeline(_draws([0.9, 0.9, 0.1, 0.9]), cfg.costs())
    assert line.failed.tolist() == [[True, True, True, False]]
    assert line.queued.tolist() == [[False, False, True, False]]
    assert line.run_times.tolist() == [[0.0, 0.0, 300.0, 778.0]]  # the group losses roll nothing back
    assert line.absent_s.tolist() == [(30 + 30) / 4]  # each group out 20 + 10 s, a quarter of the job
    # Interval 50 s + stall 10 s: floor(300/60) + floor(778/60) = 5 + 12 cycles of 50 s, less the
    # groups' absence at the useful share 50/60: (850 - 15 * 50/60) / 2000.
    assert goodput_per_trial(cfg, 50.0, line).tolist() == [pytest.approx((850 - 12.5) / 2000)]


@pytest.mark.parametrize("spares, out", [(0, 390 + 390), (1, 30 + 390), (2, 30 + 30)])
def test_a_group_without_a_spare_waits_for_its_node(spares, out):
    # Repairs of 360 s: with no spare free, a group is out 360 + 30 s (the first from 100 to 490, the
    # second from 211 to 601); the third failure is the batch node (no group out).
    cfg = SimConfig(**HAND, spares=spares, repair_h=0.1)
    line = replica_timeline(_draws([0.9, 0.9, 0.1, 0.9]), cfg.costs())
    assert line.absent_s.tolist() == [out / 4]


def test_absence_is_cut_at_the_horizon():
    cfg = SimConfig(**{**HAND, "horizon_h": 250 / 3600}, spares=0, repair_h=0.1)
    line = replica_timeline(_draws([0.9, 0.9, 0.9, 0.9]), cfg.costs())
    # Failures at 100 and 211 (inside 250 s): out to 250 each.
    assert line.absent_s.tolist() == [(150 + 39) / 4]
    assert line.run_times.tolist() == [[0.0, 0.0, 228.0, 0.0]]  # trained through both losses to the horizon


def test_young_daly_counts_only_the_failures_that_roll_back():
    base = dict(gpus=32, gpu_mtbf_h=1000.0, save_s=100)
    requeue, replica = SimConfig(**base), SimConfig(**base, mechanism="replica", node_loss_fraction=0.5)
    assert replica.rollback_mtbf_s == pytest.approx(requeue.mtbf_s * 4 / 0.5)
    assert replica.young_daly_s == pytest.approx(requeue.young_daly_s * 8 ** 0.5)


def test_replica_draws_add_which_and_keep_the_other_draws():
    cfg = SimConfig(gpus=64, trials=20, quorum_s=600, step_s=0, relaunch_s=600, swap_s=600)
    rep = SimConfig(**{**{k: getattr(cfg, k) for k in ("gpus", "trials", "quorum_s", "step_s", "relaunch_s",
                                                           "swap_s")}, "mechanism": "replica"})
    a, b = draw_failures(cfg), draw_failures(rep)  # the same shortest recovery: the same shape
    assert a.which is None and b.which.shape == b.runs.shape
    assert np.array_equal(a.runs, b.runs) and np.array_equal(a.node_loss, b.node_loss)


def test_replica_beats_requeue_on_the_same_failures():
    common = dict(gpus=16_384, trials=100, save="async", spares=30)
    req = simulate(SimConfig(**common, mechanism="requeue"), [3600])
    rep = simulate(SimConfig(**common, mechanism="replica", group_nodes=16), [3600])
    # ~246 failures a month: requeue pays 900 s each plus the lost half interval; replica 11 s and a
    # 660 s absence of 1 group in 128.
    assert rep.mean[0] - req.mean[0] > 0.1 and rep.mean[0] > 0.98


def test_cli_replica_row_and_its_inputs(capsys):
    assert main(["plan", "simulate", "--gpus", "256", "--mechanism", "replica", "--save", "async", "--trials", "20",
                 "--group-nodes", "4", "--heal-s", "7", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (row,) = out["results"]
    assert row["mechanism"] == "replica" and row["groups"] == 8
    assert out["inputs"]["heal_s"] == {"value": 7.0, "source": "flag --heal-s"}
    assert out["inputs"]["group_restart_s"]["source"] == "default, as --relaunch-s"
    assert out["assumed"]["group_nodes"] == 4


def test_cli_without_replica_shows_no_replica_inputs(capsys):
    assert main(["plan", "simulate", "--gpus", "64", "--mechanism", "requeue", "--trials", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "heal_s" not in out["inputs"] and "group_nodes" not in out["assumed"]


def test_cli_refuses_groups_that_do_not_divide_the_nodes(capsys):
    assert main(["plan", "simulate", "--gpus", "256", "--mechanism", "replica", "--group-nodes", "3"]) == 2
    err = capsys.readouterr().err
    assert "group_nodes=3" in err and "32 nodes" in err


# ---------------------------------------------------------------- --from-run: the replica costs of a real run

RUN = "tests/unit/data/replicas-6083894"  # tests/cluster/test_replica_groups.py: group 2 killed -9 at step 15


def _raw(name: str) -> list[dict]:
    from pathlib import Path

    lines = (json.loads(x) for x in (Path(RUN) / "ledger.jsonl").read_text().splitlines())
    return [x for x in lines if x["event"] == name]


def test_from_run_reads_the_heal_the_group_restart_and_the_survivors_pause():
    from statistics import median

    from dslurm.plan.run_inputs import from_runs

    got = {k: v for k, (v, _) in from_runs([RUN]).items()}
    (lost,) = _raw("replica_lost")
    heal = next(h for h in _raw("replica_healed") if h["group"] == 2 and h["step"] > 15)
    pace = median(w["step_time_s"] for w in _raw("steps"))
    # Group 0's first step without group 2 is step 16 (participants [2]); one step per window here.
    first_short = next(w for w in _raw("replica_steps") if w["group"] == 0 and w["first"] == 16)
    assert first_short["participants"] == [2] and first_short["discarded"] == 0
    assert got["heal_s"] == heal["heal_s"] == 0.406
    assert got["group_restart_s"] == pytest.approx(heal["t"] - lost["failed_t"] - heal["heal_s"], abs=1e-4)
    assert got["step_s"] == pytest.approx(pace, abs=1e-4)
    assert got["quorum_s"] == pytest.approx(first_short["t"] - lost["failed_t"] - pace, abs=1e-4)
    assert 4.0 < got["quorum_s"] < 5.0  # torchft's 5 s heartbeat timeout, less what had passed at the kill


def test_survivors_pause_inside_a_window_of_several_steps_less_the_discarded_attempts():
    from dslurm.observe import events as ev
    from dslurm.plan.run_inputs import replica_costs

    events = [
        ev.Steps(t=t, first=f, last=f + 3, step_time_s=1.0, duration_s=4.0) for t, f in ((4.0, 0), (8.0, 4))
    ] + [
        ev.ReplicaSteps(t=8.0, group=0, first=1, participants=[2] * 8),
        # Group 1 lost at t=9.5 during step 9; group 0's window 9-12 ends at t=20: step 10, the first
        # without group 1, ended at 20 - 2 steps = 18, one attempt of it discarded.
        ev.ReplicaLost(t=10.0, group=1, step=9, cause="crash", failed_t=9.5),
        ev.ReplicaSteps(t=20.0, group=0, first=9, participants=[2, 1, 1, 1], discarded=1),
        ev.ReplicaHealed(t=30.0, group=1, step=14, heal_s=2.0, missed_steps=5),
        ev.Steps(t=20.0, first=8, last=11, step_time_s=1.0, duration_s=12.0),
    ]
    got = {k: m.value for k, m in replica_costs(events).items() if m is not None}
    assert got == {"step_s": 1.0, "heal_s": 2.0, "group_restart_s": 30.0 - 9.5 - 2.0,
                   "quorum_s": 18.0 - 9.5 - 1.0 * (1 + 1)}
