"""Each replica group's lane through its faults (dslurm/observe/replica_spans.py) and the PNG's panel,
on the real ledger of tests/cluster/test_replica_groups.py (tests/unit/data/replicas-6083894) and on
hand-made sequences for what that run did not do (a group lost twice before it healed, never healed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dslurm.observe import events as ev
from dslurm.observe.plot import REPLICA_OUT, timeline_figure
from dslurm.observe.replica_spans import JOINED_LATE, group_lanes
from dslurm.observe.report import load, summarize

RUN = Path(__file__).parent / "data" / "replicas-6083894"


def _raw(name: str) -> list[dict]:
    lines = (json.loads(x) for x in (RUN / "ledger.jsonl").read_text().splitlines())
    return [x for x in lines if x["event"] == name]


def test_the_lost_group_is_out_from_its_failure_to_its_heal_on_a_real_ledger():
    events, _ = load(RUN)
    lanes = {lane.group: lane for lane in group_lanes(events)}
    (lost,) = _raw("replica_lost")
    heal = [h for h in _raw("replica_healed") if h["group"] == lost["group"] and h["step"] > lost["step"]]
    start = _raw("train_start")[0]["t"]
    assert sorted(lanes) == [0, 1, 2]
    assert lanes[0].outs == [] and lanes[0].t0 == start
    assert lanes[0].t1 == next(e["t"] for e in _raw("replica_end") if e["group"] == 0)
    crash = [o for o in lanes[2].outs if o.losses]
    assert [(o.t0, o.t1, o.step, o.cause, o.healed_step) for o in crash] == \
        [(lost["failed_t"], heal[0]["t"], 15, "crash", 26)]
    # 11.0 s out (kill -9 at 814.876, healed at 825.875); groups 1 and 2 joined after group 0's first steps.
    assert crash[0].t1 - crash[0].t0 == pytest.approx(10.999, abs=1e-3)
    late = {g: [o for o in lanes[g].outs if o.cause == JOINED_LATE] for g in (1, 2)}
    assert [(o.t0, o.healed_step) for o in late[1]] == [(start, 3)]
    assert [(o.t0, o.healed_step) for o in late[2]] == [(start, 2)]


def _e(cls, t, **kw):
    return cls(t=t, **kw)


def test_a_group_lost_again_before_it_healed_is_one_stretch_and_one_never_back_runs_to_its_end():
    events = [
        _e(ev.TrainStart, 0.0),
        _e(ev.ReplicaSteps, 5.0, group=0, first=1, participants=[2, 2]),
        _e(ev.ReplicaLost, 11.0, group=1, step=4, cause="crash", failed_t=10.0),
        _e(ev.ReplicaLost, 21.0, group=1, step=None, cause="node_failure", failed_t=20.0),  # its restart died
        _e(ev.ReplicaHealed, 30.0, group=1, step=9, heal_s=0.5, missed_steps=5),
        _e(ev.ReplicaLost, 40.0, group=1, step=12, cause="hang"),  # no failed_t: the record's time
        _e(ev.ReplicaEnd, 50.0, group=0, step=20),
        _e(ev.ReplicaEnd, 45.0, group=1, step=12),
    ]
    lanes = {lane.group: lane for lane in group_lanes(events)}
    outs = [(o.t0, o.t1, o.step, o.cause, o.losses, o.healed_step) for o in lanes[1].outs]
    assert outs == [(10.0, 30.0, 4, "crash", 2, 9), (40.0, 45.0, 12, "hang", 1, None)]
    assert lanes[1].out_s() == 25.0 and lanes[0].t1 == 50.0


def test_no_replica_events_no_lanes_and_no_panel():
    assert group_lanes([_e(ev.TrainStart, 0.0)]) == []


def test_the_png_has_one_lane_per_group_with_the_shaded_stretches():
    events, _ = load(RUN)
    sm = summarize(events)
    fig = timeline_figure(sm)
    try:
        panel = fig.axes[1]
        assert [t.get_text() for t in panel.get_yticklabels()] == ["group 0", "group 1", "group 2"]
        red = [c for c in panel.collections if tuple(c.get_facecolor()[0][:3]) ==
               pytest.approx(tuple(int(REPLICA_OUT[i:i + 2], 16) / 255 for i in (1, 3, 5)))]
        assert len(red) == sum(len(lane.outs) for lane in sm.replica_lanes) == 3
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_a_requeue_gap_is_not_drawn_as_time_in_the_quorum():
    events = [_e(ev.TrainStart, 0.0), _e(ev.ReplicaSteps, 5.0, group=0, first=1, participants=[1]),
              _e(ev.TrainStart, 100.0), _e(ev.ReplicaEnd, 150.0, group=0, step=20)]
    (lane,) = group_lanes(events, [(0.0, 40.0), (100.0, 160.0)])
    assert (lane.t0, lane.t1, lane.trained) == (0.0, 150.0, [(0.0, 40.0), (100.0, 150.0)])
    assert group_lanes(events)[0].trained == [(0.0, 150.0)]
