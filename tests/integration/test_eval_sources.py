"""Evaluation in the built-in trainer: eval losses in the ledger, training losses bit-identical
with and without evaluation, and a stop during evaluation that exits within one eval batch and
resumes to the same losses (torchrun + gloo, tiny model; train/evaluate.py)."""

from __future__ import annotations

import pytest

from dslurm.observe.ledger import read_events
from train_helpers import run_train, step_records, write_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

HELD_OUT = ("data.val_fraction=0.1",)
EVAL = (*HELD_OUT, "train.eval_every=2", "train.eval_batches=3")


def evals(run_dir):
    return [e for e in read_events(run_dir) if e["event"] == "eval"]


def test_eval_is_logged_leaves_training_untouched_and_a_stop_during_it_is_honoured_at_once(tmp_path):
    ref = run_train(None, write_job(tmp_path, "ref"), *HELD_OUT)  # no evaluation
    assert ref.returncode == 0, ref.stderr[-3000:]
    ref_losses = [e["loss"] for e in step_records(tmp_path / "ref")]

    with_eval = run_train(None, write_job(tmp_path, "ev"), *EVAL)
    assert with_eval.returncode == 0, with_eval.stderr[-3000:]
    assert [e["loss"] for e in step_records(tmp_path / "ev")] == ref_losses  # bit-identical
    done = evals(tmp_path / "ev")
    assert [(e["step"], e["batches"], e["interrupted"], e["source"]) for e in done] == [
        (2, 3, False, "held_out"), (4, 3, False, "held_out")]
    assert all(0 < e["loss"] < 7 and e["ppl"] > 1 for e in done) and "eval step 2: loss" in with_eval.stdout

    # Rank 1 alone "receives USR2" during the first eval batch after step 2: all ranks leave after it.
    job = write_job(tmp_path, "stop")
    first = run_train(2, job, *EVAL, env={"DSLURM_FAULT_STOP_IN_EVAL": "2:1"})
    assert first.returncode == 1 and "exitcode  : 75" in first.stderr, first.stderr[-3000:]
    events = list(read_events(tmp_path / "stop"))
    cut = evals(tmp_path / "stop")
    assert [(e["step"], e["batches"], e["eval_batches"], e["interrupted"]) for e in cut] == [(2, 1, 3, True)]
    assert [e["step"] for e in events if e["event"] == "signal"] == [2]
    assert [e["step"] for e in events if e["event"] == "ckpt_save"] == [2]
    assert events[-1]["event"] == "exit" and events[-1]["code"] == 75

    second = run_train(2, job, *EVAL)
    assert second.returncode == 0, second.stderr[-3000:]
    resumed = step_records(tmp_path / "stop")
    assert [e["first"] for e in resumed] == [0, 1, 2, 3]
    assert [e["loss"] for e in resumed] == pytest.approx(ref_losses, abs=1e-4)  # dp 2 vs 1 process
    after = evals(tmp_path / "stop")[1:]
    assert [(e["step"], e["interrupted"]) for e in after] == [(4, False)]
    assert after[0]["loss"] == pytest.approx(done[1]["loss"], abs=1e-4)  # the same eval batches
