"""Health during the run (dslurm/health/__init__.py and its shells): the hang bound, suspects, the
non-finite policy, their config fields, their endings, and the watchdog with a fake clock-free
run (a tiny bound, a stuck 'main thread')."""

from __future__ import annotations

import json
import time

import pytest

from dslurm import endings as E
from dslurm import exitcodes as X
from dslurm import faults, health
from dslurm.config import load_job
from dslurm.endings.facts import StartFacts
from dslurm.errors import UserError
from dslurm.observe import events as ev
from dslurm.requeue import decide
from dslurm.run import RunDir


def test_hang_bound_is_k_times_the_median_with_a_floor_and_a_ceiling():
    kw = {"k": 10, "floor_s": 120, "ceiling_s": 1800}
    assert health.hang_bound([], **kw) == 1800  # nothing measured yet: the ceiling
    assert health.hang_bound([1.0, 50.0, 2.0], **kw) == 120  # 10 x 2 s is below the floor
    assert health.hang_bound([30.0, 31.0, 29.0, 500.0], **kw) == pytest.approx(305.0)  # median, not mean
    assert health.hang_bound([400.0], **kw) == 1800  # never above the ceiling


def test_the_process_group_timeout_lets_the_watchdog_speak_first():
    assert health.pg_timeout_s(1800) == 1800 + health.PG_GRACE_S > health.hang_bound([1e6], k=10, floor_s=1,
                                                                                    ceiling_s=1800)
    assert health.poll_s(2) == 0.5 and health.poll_s(0.1) == 0.25 and health.poll_s(600) == 5.0
    assert health.gather_s(1) == 2.0 and health.gather_s(10) == 5.0 and health.gather_s(1e4) == 30.0


def note(rank, seq=5, inside=True, name="step_agree"):
    return health.RankNote(rank=rank, host=f"node{rank // 2 + 1}", step=3, seq=seq, inside=inside, collective=name)


def test_suspects_are_ranks_outside_every_collective_or_silent():
    who, why = health.suspects({0: note(0), 1: note(1, seq=4, inside=False), 2: note(2), 3: note(3)}, 4)
    assert who == [1] and "outside" in why
    who, why = health.suspects({0: note(0), 1: note(1), 3: note(3)}, 4)
    assert who == [2] and "no note" in why
    who, why = health.suspects({0: note(0, seq=6), 1: note(1, seq=5), 2: note(2, seq=6)}, 3)
    assert who == [1] and "earlier collective" in why
    who, why = health.suspects({0: note(0), 1: note(1)}, 2)
    assert who == [] and "transport" in why


def test_nonfinite_policy_is_bounded_and_stop_is_immediate():
    assert health.nonfinite_action("skip", 0, 3).action == "skip"
    assert health.nonfinite_action("rollback", 2, 3).action == "rollback"
    d = health.nonfinite_action("skip", 3, 3)
    assert d.action == "stop" and "train.nonfinite_max=3" in d.reason
    assert health.nonfinite_action("stop", 0, 3).action == "stop"
    assert health.nonfinite_action("off", 99, 3).action == "train"


def test_config_fields_are_validated_with_the_fix():
    job = load_job(data={"name": "j", "nodes": 1})
    assert job.train.nonfinite == "stop" and job.train.nonfinite_max == 3 and job.health.watchdog
    job = load_job(data={"name": "j", "nodes": 1}, overrides=["train.nonfinite=rollback", "health.hang_k=3"])
    assert job.train.nonfinite == "rollback" and job.health.hang_k == 3
    with pytest.raises(UserError, match="nonfinite"):
        load_job(data={"name": "j", "nodes": 1}, overrides=["train.nonfinite=ignore"])
    with pytest.raises(UserError, match="hang_floor_s"):
        load_job(data={"name": "j", "nodes": 1}, overrides=["health.hang_floor_s=4000"])
    with pytest.raises(UserError, match="health.*valid|hang_kk"):
        load_job(data={"name": "j", "nodes": 1, "health": {"hang_kk": 1}})


def test_fault_knobs_for_hang_and_nan():
    assert faults.step_fault("DSLURM_FAULT_HANG", {"DSLURM_FAULT_HANG": "4:1", "RANK": "1"}) == 4
    assert faults.step_fault("DSLURM_FAULT_HANG", {"DSLURM_FAULT_HANG": "4:1", "RANK": "0"}) is None
    assert faults.poisoned(24, 8, 4) and not faults.poisoned(16, 8, 4) and not faults.poisoned(24, 8, None)


def rank(r, kind, t, code, error=""):
    return {"rank": r, "kind": kind, "t": t, "host": "node1", "code": code, "step": 3, "error": error}


def test_a_hang_ends_as_a_crash_of_the_suspect_and_is_retried():
    f = StartFacts("7.0", [], [], [rank(0, "peer_lost", 10.0, X.HANG, "hang: waited"),
                                   rank(1, "crash", 10.0, X.HANG, "hang: no step progress for 2.1 s")], None)
    end = E.classify(f, E.SlurmView(state="RUNNING"))
    assert end.cls == E.CRASH and end.origin_rank == 1 and "hang" in end.reason
    d = decide(ending=end.cls, failures=0, max_restarts=2, no_progress_limit=3, start_steps=[0], pointer_step=0)
    assert d.action == "requeue"


def test_a_divergence_stop_is_its_own_ending_and_not_retried():
    f = StartFacts("7.0", [], [], [rank(0, "diverged", 10.0, X.NONFINITE), rank(1, "diverged", 10.1, X.NONFINITE)],
                   None)
    end = E.classify(f, E.SlurmView(state="RUNNING"))
    assert end.cls == E.DIVERGED
    d = decide(ending=end.cls, failures=0, max_restarts=2, no_progress_limit=3, start_steps=[0], pointer_step=2)
    assert d.action == "stop" and d.exit_code == X.NONFINITE and "finite generation" in d.reason
    assert X.KIND_OF_CODE[X.NONFINITE] == "diverged" and X.KIND_OF_CODE[X.HANG] == "crash"


class Spec:
    hang_k, hang_floor_s, hang_ceiling_s = 3.0, 0.3, 0.6


def test_watchdog_fires_dumps_stacks_and_names_itself_when_alone(tmp_path):
    """World of one, the loop never beats again: it fires within the ceiling, writes the stacks,
    its note, the Hang event, and hands a crash verdict to on_hang."""
    from train.watchdog import Watchdog

    got = []
    wd = Watchdog(Spec, rank=0, world=1, start_dir=tmp_path / "s", run=RunDir(tmp_path), on_hang=got.append)
    wd.start()
    wd.beat(1)
    wd.beat(2)  # one step time of ~0 s: the bound is the floor (0.3 s)
    with wd.collective("step_agree"):
        pass
    deadline = time.time() + 10
    while not got and time.time() < deadline:
        time.sleep(0.05)
    wd.close()
    (v,) = got
    assert v.kind == "crash" and v.step == 2 and "hang: no step progress" in v.error and "[0]" in v.error
    assert "test_health" in (tmp_path / "s" / "hang-rank-00000.txt").read_text()  # this test's frame
    n = json.loads((tmp_path / "s" / "hang-rank-00000.json").read_text())
    assert n["seq"] == 1 and n["inside"] is False and n["collective"] == "step_agree"
    (h,) = ev.of(ev.read(tmp_path), ev.Hang)
    assert h.suspects == [0] and h.bound_s == pytest.approx(0.3) and h.step == 2


def test_closing_while_the_watchdog_names_suspects_waits_for_its_verdict(tmp_path):
    """Both orders of the main thread leaving (a peer's exit broke its collective) and the
    watchdog firing. Fired first: this rank may be the lowest that fired, the one to write the
    ledger's hang event; close() must let it finish (under load the event was lost). Closed
    first: it never fires."""
    from train.watchdog import Watchdog

    got = []
    wd = Watchdog(Spec, rank=0, world=2, start_dir=tmp_path / "s", run=RunDir(tmp_path), on_hang=got.append)
    wd.start()
    wd.beat(1)
    wd.beat(2)
    note = tmp_path / "s" / "hang-rank-00000.json"
    deadline = time.time() + 10
    while not note.exists() and time.time() < deadline:  # fired: now gathering rank 1's note (2 s)
        time.sleep(0.02)
    assert note.exists() and not got
    wd.close()
    assert [v.kind for v in got] == ["crash"]
    (h,) = ev.of(ev.read(tmp_path), ev.Hang)
    assert h.suspects == [0, 1] and sorted(h.collectives) == ["0"]  # rank 1 left no note: a suspect too

    quiet = []
    wd = Watchdog(Spec, rank=0, world=2, start_dir=tmp_path / "q", run=RunDir(tmp_path / "q"), on_hang=quiet.append)
    wd.start()
    wd.close()  # before any bound could pass
    time.sleep(1.0)
    assert quiet == [] and not (tmp_path / "q" / "hang-rank-00000.json").exists()


def test_a_save_raises_the_bound_to_the_ceiling():
    from train.watchdog import Watchdog

    wd = Watchdog(Spec, rank=0, world=1, start_dir=None, run=RunDir("."), on_hang=lambda v: None)
    assert wd.bound() == 0.6  # before the first beat
    wd.beat(1)
    wd.beat(2)
    assert wd.bound() == pytest.approx(0.3)
    wd.expect_long()
    assert wd.bound() == 0.6
    wd.beat(3)  # the interval holding the save is not a step time
    assert len(wd.times) == 1 and wd.bound() == pytest.approx(0.3)


@pytest.mark.parametrize("first", [False, True])
def test_a_paused_wait_is_neither_a_step_time_nor_a_hang_and_leaves_the_state_as_it_was(first):
    """DSLURM_FAULT_AWAIT's wait: the ceiling while it lasts; after it the step's own interval is
    recorded (or not, before the first beat) and the bound is what it was."""
    from train.watchdog import Watchdog

    wd = Watchdog(Spec, rank=0, world=1, start_dir=None, run=RunDir("."), on_hang=lambda v: None)
    if not first:
        wd.beat(1)
        wd.beat(2)
    before, n = wd.bound(), len(wd.times)
    with wd.paused():
        assert wd.bound() == 0.6
        time.sleep(0.2)
    assert wd.bound() == before and len(wd.times) == n
    wd.beat(3)  # the step after the wait: recorded only if the state said so, never the wait's 0.2 s
    assert len(wd.times) == n + (0 if first else 1) and all(t < 0.1 for t in wd.times)
