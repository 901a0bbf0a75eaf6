"""The after-the-step policy: requeue within budget, stop on no progress, end chains."""

from __future__ import annotations

from dslurm import exitcodes as X
from dslurm.requeue import chain_of, decide, job_ref, starts_without_progress

BASE = dict(restart_count=0, max_restarts=3, no_progress_limit=2, start_steps=[0], pointer_step=10)


def test_completion_and_user_error_never_requeue():
    assert decide(rc=0, **BASE).action == "end"
    d = decide(rc=2, **BASE)
    assert (d.action, d.exit_code) == ("stop", 2)
    assert decide(rc=X.TERMINATED, **BASE).action == "stop"


def test_save_and_requeue_within_budget():
    d = decide(rc=X.REQUEUE, **BASE)
    assert (d.action, d.exit_code) == ("requeue", 0) and "restart 1 of 3" in d.reason
    spent = decide(rc=X.REQUEUE, **{**BASE, "restart_count": 3})
    assert (spent.action, spent.exit_code) == ("stop", X.BUDGET) and "3 of 3" in spent.reason


def test_crash_is_retried_but_the_same_crash_stops_on_no_progress():
    # Start 1 (fresh) saved step 10 and crashed at 15; start 2 resumed from 10 and crashed again.
    assert decide(rc=1, **{**BASE, "start_steps": [0, 10]}).action == "requeue"
    d = decide(rc=1, **{**BASE, "start_steps": [0, 10, 10]})
    assert (d.action, d.exit_code) == ("stop", X.NO_PROGRESS)
    assert "last 2 starts all began at step 10" in d.reason


def test_progress_counter():
    assert starts_without_progress([0, 10, 10], 10) == 2
    assert starts_without_progress([0, 10, 20], 20) == 1
    assert starts_without_progress([], 0) == 0


def test_chain_links_end_instead_of_requeueing():
    d = decide(rc=X.REQUEUE, **BASE, in_chain=True)
    assert (d.action, d.exit_code) == ("end", 0)
    events = [{"event": "submit", "job_ids": [5, 6, 7]}]
    assert chain_of(events, "6") == [5, 6, 7] and chain_of(events, "9") == []


def test_array_tasks_requeue_by_array_id():
    assert job_ref({"SLURM_JOB_ID": "101"}) == "101"
    assert job_ref({"SLURM_JOB_ID": "101", "SLURM_ARRAY_JOB_ID": "100", "SLURM_ARRAY_TASK_ID": "1"}) == "100_1"


def test_auto_signal_lead_from_measurements_with_a_floor():
    from dslurm.requeue import auto_signal_lead

    lead, how = auto_signal_lead([], default_s=300)
    assert lead == 300 and "site default" in how
    ev = [{"event": "steps", "step_time_s": 20.0}, {"event": "steps", "step_time_s": 35.0},
          {"event": "ckpt_save", "total_s": 50.0, "stall_s": 50.0}]
    lead, how = auto_signal_lead(ev, default_s=300)
    assert lead == 170 and "step 35.00s + save 50.00s" in how  # 2 x (35 + 50)
    fast = [{"event": "steps", "step_time_s": 0.5}, {"event": "ckpt_save", "total_s": 1.0}]
    assert auto_signal_lead(fast, default_s=300)[0] == 60  # never below Slurm's granularity


def test_requeue_off_stops_with_the_steps_code():
    d = decide(rc=X.PREFLIGHT_FAILED, **BASE, requeue_enabled=False)
    assert (d.action, d.exit_code) == ("stop", X.PREFLIGHT_FAILED) and "requeue is off" in d.reason
