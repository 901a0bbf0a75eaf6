"""Stop flag -> agreed step -> synchronous save -> exit 75; the next start resumes there and
finishes with exit 0, with the same losses as a run that was never stopped."""

from __future__ import annotations

import pytest

from dslurm.observe.ledger import read_events
from train_helpers import run_train, step_records, write_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_stop_on_one_rank_saves_and_exits_75_then_resume_completes(tmp_path):
    job = write_job(tmp_path, "rq")
    # Rank 1 alone "receives the signal" after step 2; rank 0 learns it from the all-reduce.
    first = run_train(2, job, env={"DSLURM_FAULT_STOP": "2:1"})
    # torchrun turns any non-zero worker exit into its own 1; the workers' 75 is in its report.
    assert first.returncode == 1 and "exitcode  : 75" in first.stderr, first.stderr[-3000:]
    events = list(read_events(tmp_path / "rq"))
    kinds = [e["event"] for e in events]
    assert [e["step"] for e in events if e["event"] == "signal"] == [2]
    assert [e["step"] for e in events if e["event"] == "ckpt_save"] == [2]
    assert events[-1]["event"] == "exit" and events[-1]["reason"] == "requeue" and events[-1]["code"] == 75
    assert kinds.index("ckpt_save") < kinds.index("exit")

    second = run_train(2, job)
    assert second.returncode == 0, second.stderr[-3000:]
    events = list(read_events(tmp_path / "rq"))
    starts = [e for e in events if e["event"] == "train_start"]
    assert [s["step"] for s in starts] == [0, 2] and starts[1]["generation"].startswith("step-00000002")
    assert events[-1]["event"] == "exit" and events[-1]["reason"] == "completed" and events[-1]["step"] == 4
    resumed = [(e["first"], e["loss"]) for e in step_records(tmp_path / "rq")]
    assert [s for s, _ in resumed] == [0, 1, 2, 3]

    straight = run_train(None, write_job(tmp_path, "straight"))  # one plain process, never stopped
    assert straight.returncode == 0, straight.stderr[-3000:]
    ref = [e["loss"] for e in step_records(tmp_path / "straight")]
    assert [loss for _, loss in resumed] == pytest.approx(ref, abs=1e-4)


def test_plain_process_exits_75_itself(tmp_path):
    proc = run_train(None, write_job(tmp_path, "one", steps=3), env={"DSLURM_FAULT_STOP": "1"})
    assert proc.returncode == 75, proc.stderr[-3000:]
    exits = [e for e in read_events(tmp_path / "one") if e["event"] == "exit"]
    assert [(e["reason"], e["step"]) for e in exits] == [("requeue", 1)]
