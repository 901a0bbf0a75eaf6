"""The fault knobs (dslurm/faults.py): parsed in one place, scoped to ranks and starts."""

from __future__ import annotations

from dslurm import faults


def test_step_fault_targets_ranks_and_one_start():
    env = {"DSLURM_FAULT_CRASH": "15:0,1@0", "RANK": "1", "SLURM_RESTART_COUNT": "0"}
    assert faults.step_fault("DSLURM_FAULT_CRASH", env) == 15
    assert faults.step_fault("DSLURM_FAULT_CRASH", {**env, "RANK": "2"}) is None
    assert faults.step_fault("DSLURM_FAULT_CRASH", {**env, "SLURM_RESTART_COUNT": "1"}) is None
    assert faults.step_fault("DSLURM_FAULT_CRASH", {"DSLURM_FAULT_CRASH": "3"}) == 3  # rank 0 by default
    assert faults.step_fault("DSLURM_FAULT_STOP", env) is None


def test_exit_delay_only_for_the_named_ranks():
    assert faults.exit_delay({"DSLURM_FAULT_EXIT_DELAY": "4:2,3", "RANK": "3"}) == 4.0
    assert faults.exit_delay({"DSLURM_FAULT_EXIT_DELAY": "4:2,3", "RANK": "0"}) == 0.0


def test_before_step_raises_at_the_crash_step():
    import pytest

    faults.before_step(4, crash_at=5, kill_at=None)
    with pytest.raises(RuntimeError, match="injected crash before step 5"):
        faults.before_step(5, crash_at=5, kill_at=None)


def test_exit_delay_scoped_to_one_start():
    env = {"DSLURM_FAULT_EXIT_DELAY": "6:0,1@0", "RANK": "1", "SLURM_RESTART_COUNT": "0"}
    assert faults.exit_delay(env) == 6.0
    assert faults.exit_delay({**env, "SLURM_RESTART_COUNT": "1"}) == 0.0


def test_every_fault_knob_in_the_code_is_listed_and_documented():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    used = {m for d in ("dslurm", "train") for p in (root / d).rglob("*.py")
            for m in re.findall(r"DSLURM_FAULT_[A-Z0-9_]+", p.read_text())}
    assert used == set(faults.KNOBS), used ^ set(faults.KNOBS)
    assert all(k in faults.__doc__ for k in faults.KNOBS)


def test_a_knob_can_aim_at_one_job_step_of_a_start():
    from dslurm.faults import parse_scoped

    knob = parse_scoped("16:1@0.0")
    assert (knob.value, knob.ranks, knob.restart, knob.step) == ("16", frozenset({1}), 0, 0)
    assert knob.applies({"RANK": "1"}) and knob.applies({"RANK": "1", "DSLURM_STEP_INDEX": "0"})
    assert not knob.applies({"RANK": "1", "DSLURM_STEP_INDEX": "1"})
    assert parse_scoped("16:1@0").applies({"RANK": "1", "DSLURM_STEP_INDEX": "3"})  # any step of start 0


def test_several_values_aim_at_several_job_steps_the_first_that_applies_wins():
    knob = "9:1@0.0;15:1@0.2"
    at = [faults.step_fault("DSLURM_FAULT_KILL9", {"DSLURM_FAULT_KILL9": knob, "RANK": "1", "DSLURM_STEP_INDEX": str(s),
                                                   "SLURM_RESTART_COUNT": "0"}) for s in range(4)]
    assert at == [9, None, 15, None]
    assert faults.step_fault("DSLURM_FAULT_KILL9", {"DSLURM_FAULT_KILL9": knob, "RANK": "0",
                                                    "DSLURM_STEP_INDEX": "0"}) is None  # another rank


def test_await_waits_for_the_files_bounded(tmp_path):
    import threading

    import pytest

    from dslurm.errors import UserError

    assert faults.parse_await(f"{tmp_path}/*.ready:2") == (f"{tmp_path}/*.ready", 2, faults.AWAIT_DEFAULT_S)
    assert faults.parse_await("/a:b/*.ready:3:7.5") == ("/a:b/*.ready", 3, 7.5)
    with pytest.raises(UserError):
        faults.parse_await("/x/*.ready")
    assert faults.await_files({})  # no knob: nothing to wait for
    env = {"DSLURM_FAULT_AWAIT": f"{tmp_path}/*.ready:2:20"}
    (tmp_path / "a.ready").write_text("")
    threading.Timer(0.3, (tmp_path / "b.ready").write_text, ("",)).start()
    assert faults.await_files(env, sleep_s=0.02) and (tmp_path / "b.ready").exists()
    assert not faults.await_files({"DSLURM_FAULT_AWAIT": f"{tmp_path}/*.ready:3:0.1"}, sleep_s=0.02)


def test_every_rank_awaits_before_the_first_fault_of_its_job_step_whoever_fires_it():
    knobs = {"DSLURM_FAULT_AWAIT": "/x/*.ready:2", "DSLURM_FAULT_FREEZE": "9:1@0.0",
             "DSLURM_FAULT_KILL9": "11:1@0.1;15:1@0.3", "DSLURM_FAULT_CRASH": "13:1@0.2"}
    for rank in ("0", "1"):  # rank 0 fires nothing, and waits all the same
        assert faults.await_step({**knobs, "RANK": rank, "DSLURM_STEP_INDEX": "0"}) == 9
        assert faults.await_step({**knobs, "RANK": rank, "DSLURM_STEP_INDEX": "3"}) == 15
        assert faults.await_step({**knobs, "RANK": rank, "DSLURM_STEP_INDEX": "4"}) is None
    assert faults.await_step({**knobs, "RANK": "0", "SLURM_RESTART_COUNT": "1"}) is None  # another start
    assert faults.await_step({k: v for k, v in knobs.items() if k != "DSLURM_FAULT_AWAIT"}) is None
    both = {"DSLURM_FAULT_AWAIT": "/x/*.ready:2", "DSLURM_FAULT_KILL9": "12", "DSLURM_FAULT_CRASH": "7:3"}
    assert faults.await_step(both) == 7


def test_await_step_follows_the_value_each_rank_takes_not_a_later_one():
    """`_scoped` gives a rank the first value aimed at it: '15:1;11:1' fires at 15 on rank 1, so
    that is where everyone waits (11 never fires)."""
    env = {"DSLURM_FAULT_AWAIT": "/x/*.ready:2", "DSLURM_FAULT_KILL9": "15:1;11:1", "RANK": "1"}
    assert faults.step_fault("DSLURM_FAULT_KILL9", env) == 15
    assert faults.await_step(env) == 15
    assert faults.await_step({**env, "DSLURM_FAULT_KILL9": "15:1;11:0,1"}) == 11  # rank 0 takes 11
