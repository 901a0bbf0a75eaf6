"""The after-the-step policy: requeue within budget, stop on no progress, end chains."""

from __future__ import annotations

import pytest

from dslurm import endings as E
from dslurm import exitcodes as X
from dslurm.observe import events as ev
from dslurm.requeue import chain_of, decide, failures_of, job_ref, starts_without_progress, stray_stops_of

BASE = dict(failures=0, max_restarts=3, no_progress_limit=2, start_steps=[0], pointer_step=10)


def test_completion_and_non_retryable_endings_never_requeue():
    assert decide(ending=E.COMPLETED, **BASE).action == "end"
    for ending, code in ((E.USER_ERROR, X.USER_ERROR), (E.REFUSED, X.REFUSED), (E.SAVE_FAILED, X.SAVE_FAILED)):
        d = decide(ending=ending, **BASE)
        assert (d.action, d.exit_code) == ("stop", code), ending
    for ending in E.SLURM_STOPS:  # Slurm ended the step: it decides what comes next
        assert (decide(ending=ending, **BASE).action, decide(ending=ending, **BASE).exit_code) == ("stop", 143)


def test_a_refused_run_says_why_and_a_failed_save_names_the_fix():
    d = decide(ending=E.REFUSED, **BASE, detail="run dir locked by job 12")
    assert "lock" in d.reason and "job 12" in d.reason
    assert "not durable" in decide(ending=E.SAVE_FAILED, **BASE).reason


def test_crash_budget_counts_failures_only():
    d = decide(ending=E.CRASH, **BASE)
    assert (d.action, d.exit_code) == ("requeue", 0) and "failure restart 1 of 3" in d.reason
    spent = decide(ending=E.CRASH, **{**BASE, "failures": 3})
    assert (spent.action, spent.exit_code) == ("stop", X.BUDGET) and "3 of 3" in spent.reason
    # Preemptions and time-limit stops spend nothing: four of them earlier do not matter.
    warned = decide(ending=E.WARNED_STOP, **{**BASE, "failures": 3})
    assert warned.action == "requeue" and "no restart budget" in warned.reason
    for ending in (E.NODE_FAILURE, E.BURNIN_REJECTED):
        assert decide(ending=ending, **BASE).action == "requeue"
        assert decide(ending=ending, **{**BASE, "failures": 3}).exit_code == X.BUDGET


def test_failures_are_counted_from_this_jobs_failure_endings():
    events = [ev.Ending(job_id="7", cls=c) for c in ("warned_stop", "warned_stop", "preempted", "warned_stop",
                                                     "crash")]
    events += [ev.Ending(job_id="8", cls="crash"), ev.Requeue(job_id="7", ending="crash")]
    assert failures_of(events, "7") == 1


def test_crash_is_retried_but_the_same_crash_stops_on_no_progress():
    # Start 1 (fresh) saved step 10 and crashed at 15; start 2 resumed from 10 and crashed again.
    assert decide(ending=E.CRASH, **{**BASE, "start_steps": [0, 10]}).action == "requeue"
    d = decide(ending=E.CRASH, **{**BASE, "start_steps": [0, 10, 10]})
    assert (d.action, d.exit_code) == ("stop", X.NO_PROGRESS)
    assert "last 2 starts all began at step 10" in d.reason


def test_progress_counter():
    assert starts_without_progress([0, 10, 10], 10) == 2
    assert starts_without_progress([0, 10, 20], 20) == 1
    assert starts_without_progress([], 0) == 0


def test_chain_links_end_instead_of_requeueing():
    d = decide(ending=E.WARNED_STOP, **BASE, in_chain=True)
    assert (d.action, d.exit_code) == ("end", 0)
    events = [ev.Submit(job_ids=[5, 6, 7])]
    assert chain_of(events, "6") == [5, 6, 7] and chain_of(events, "9") == []


def test_array_tasks_requeue_by_array_id():
    assert job_ref({"SLURM_JOB_ID": "101"}) == "101"
    assert job_ref({"SLURM_JOB_ID": "101", "SLURM_ARRAY_JOB_ID": "100", "SLURM_ARRAY_TASK_ID": "1"}) == "100_1"


def test_auto_signal_lead_from_measurements_with_a_floor():
    from dslurm.config.resolve import auto_signal_lead
    from dslurm.observe.lead import sample

    lead, how = auto_signal_lead(None, default_s=300)
    assert lead == 300 and "site default" in how
    assert auto_signal_lead(sample([]), default_s=300) == (lead, how)
    history = [ev.Steps(step_time_s=20.0), ev.Steps(step_time_s=35.0), ev.CkptSave(total_s=50.0, stall_s=50.0)]
    lead, how = auto_signal_lead(sample(history), default_s=300)
    assert lead == 170 and "step 35.00s + save 50.00s" in how  # 2 x (35 + 50)
    fast = [ev.Steps(step_time_s=0.5), ev.CkptSave(total_s=1.0)]
    assert auto_signal_lead(sample(fast), default_s=300)[0] == 60  # never below Slurm's granularity


def test_requeue_off_stops_with_the_steps_code():
    d = decide(ending=E.WARNED_STOP, **BASE, requeue_enabled=False)
    assert (d.action, d.exit_code) == ("stop", X.REQUEUE) and "requeue is off" in d.reason
    d = decide(ending=E.CRASH, **BASE, requeue_enabled=False)
    assert (d.action, d.exit_code) == ("stop", 1) and "requeue is off" in d.reason


def test_a_stray_stop_is_requeued_within_its_own_budget_and_spends_no_crash_budget():
    stray = {**BASE, "max_stray_stops": 3}
    d = decide(ending=E.STRAY_STOP, **{**stray, "failures": 3})  # the crash budget spent: no matter
    assert (d.action, d.exit_code) == ("requeue", X.OK), d
    assert "stray stop 1 of 3" in d.reason and "no restart budget" in d.reason and "not a cancel" in d.reason
    spent = decide(ending=E.STRAY_STOP, **stray, stray_stops=3, detail="node2 at 12.0")
    assert (spent.action, spent.exit_code) == ("stop", X.BUDGET), spent
    assert "3 of 3" in spent.reason and "max_stray_stops" in spent.reason and "dslurm cancel" in spent.reason
    assert "node2 at 12.0" in spent.reason
    # The no-progress guard still applies; a chain's link ends; requeue off stops with 143.
    d = decide(ending=E.STRAY_STOP, **{**stray, "start_steps": [0, 10, 10]})
    assert (d.action, d.exit_code) == ("stop", X.NO_PROGRESS)
    assert decide(ending=E.STRAY_STOP, **stray, in_chain=True).action == "end"
    d = decide(ending=E.STRAY_STOP, **stray, requeue_enabled=False)
    assert (d.action, d.exit_code) == ("stop", X.TERMINATED) and "requeue is off" in d.reason
    # a crash still counts its own budget only
    assert decide(ending=E.CRASH, **stray, stray_stops=3).action == "requeue"


def test_stray_stops_are_counted_from_this_jobs_stray_endings_apart_from_failures():
    events = [ev.Ending(job_id="7", cls=c) for c in ("stray_stop", "crash", "stray_stop", "cancelled")]
    events += [ev.Ending(job_id="8", cls="stray_stop"), ev.Requeue(job_id="7", ending="stray_stop")]
    assert (stray_stops_of(events, "7"), failures_of(events, "7")) == (2, 1)


def test_dslurm_cancel_records_the_request_then_signals(tmp_path, monkeypatch):
    """`dslurm cancel JOB [--save]`: the request lands in the running start's facts dir before the
    signal (so the ending says the user cancelled); --save TERMs the job step, kills nothing; with
    no running start to record it in, --save is a plain scancel (a step-only TERM would be stray)."""
    import subprocess

    from dslurm import slurm
    from dslurm.endings.facts import read_start
    from dslurm.errors import UserError
    from dslurm.requeue import cancel as C

    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "job.yaml").write_text("{}")
    (run / "starts" / "41.2").mkdir(parents=True)
    calls: list[list[str]] = []

    def run_cmd(args, **k):
        calls.append(list(args))
        out = f"JobId=41 JobState=RUNNING Restarts=2 StdOut={run}/logs/x-41.out\n" if args[0] == "scontrol" else ""
        return subprocess.CompletedProcess(args, 0, out, "")

    monkeypatch.setattr(slurm, "run_cmd", run_cmd)
    said = C.cancel("41", save=True)
    assert calls[-1] == ["scancel", "--signal=TERM", "41"] and "cancel.json" in said[0], (calls, said)
    req = read_start(run / "starts" / "41.2").cancel
    assert req and req["save"] is True and req["t"] > 0
    C.cancel("41", save=False)
    assert calls[-1] == ["scancel", "41"]
    (run / "job.yaml").unlink()  # not a dslurm run: nothing to record the request in
    assert "nothing recorded" in C.cancel("41", save=True)[0] and calls[-1] == ["scancel", "41"]
    with pytest.raises(UserError, match="neither a job id nor a run directory"):
        C.cancel(str(tmp_path / "nothing"), save=False)
