"""Health during the run (issue 18) with real torchrun + gloo: an injected hang is caught within
the bound, stacks dumped, suspects named, the step ends as a crash that requeue-me would retry
(started again, the run completes, and the report's timeline covers its every second once);
an injected NaN under each `train.nonfinite` policy."""

from __future__ import annotations

import json
import time

import pytest

from dslurm import endings as E
from dslurm import exitcodes as X
from dslurm.checkpoint import read_pointer
from dslurm.endings.facts import list_starts, read_start
from dslurm.observe import events as ev
from dslurm.observe.bands import HUNG, timeline
from dslurm.observe.report import summarize
from dslurm.requeue import decide
from train_helpers import run_train, step_records, write_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

FAST_WATCHDOG = ("health.hang_k=3", "health.hang_floor_s=2", "health.hang_ceiling_s=30")


def test_hang_on_one_rank_is_caught_stacks_dumped_and_ends_as_a_crash(tmp_path):
    job = write_job(tmp_path, "hang", steps=8)
    t0 = time.time()
    proc = run_train(2, job, *FAST_WATCHDOG, env={"DSLURM_FAULT_HANG": "4:1"}, timeout=150)
    wall = time.time() - t0
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "exitcode  : 80" in proc.stderr, proc.stderr[-3000:]
    run = tmp_path / "hang"
    hangs = list(ev.of(ev.read(run), ev.Hang))
    assert len(hangs) == 1, proc.stderr[-3000:]
    h = hangs[0]
    assert h.suspects == [1] and h.step == 3, h
    assert h.idle_s <= h.bound_s + 2.0 and h.bound_s <= 30, h  # caught within the bound (+ a poll)
    assert h.collectives["0"]["inside"] and not h.collectives["1"]["inside"], h.collectives
    assert wall < 120, wall  # not the process-group timeout (90 s) plus teardown
    (start,) = list_starts(run)
    stacks1 = (start / "hang-rank-00001.txt").read_text()
    stacks0 = (start / "hang-rank-00000.txt").read_text()
    assert "faults.py" in stacks1 and "before_step" in stacks1, stacks1  # where rank 1 hangs
    assert "train_step" in stacks0 and "Thread" in stacks0, stacks0  # rank 0 waits in the step
    facts = read_start(start)
    kinds = {r["rank"]: (r["kind"], r["code"]) for r in facts.ranks}
    assert kinds == {0: ("peer_lost", X.HANG), 1: ("crash", X.HANG)}, facts.ranks
    ending = E.classify(facts, E.SlurmView(state="RUNNING"))
    assert ending.cls == E.CRASH and ending.origin_rank == 1 and "hang" in ending.reason, ending
    d = decide(ending=ending.cls, failures=0, max_restarts=3, no_progress_limit=3, start_steps=[0],
               pointer_step=0)
    assert d.action == "requeue", d
    # Requeued (here: started again by hand), it completes; the report's timeline covers every
    # second of the hung run once, the hang's idle time as the hung band (issue 54).
    again = run_train(2, job, *FAST_WATCHDOG, "checkpoint.interval=2", timeout=150)
    assert again.returncode == 0, again.stderr[-3000:]
    sm = summarize(ev.read(run))
    tl = timeline(sm)
    assert len(sm.starts) == 2 and sm.completion.complete, [s.exit_reason for s in sm.starts]
    assert sum(b.width for b in tl.bands) == pytest.approx(tl.t_end - tl.t0, abs=1e-6)
    assert all(b.t0 + b.width == pytest.approx(c.t0, abs=1e-6) for b, c in zip(tl.bands, tl.bands[1:]))
    assert tl.width_of(HUNG) == pytest.approx(h.idle_s, rel=1e-6) and "hang" in {m.kind for m in tl.marks}


def _nonfinite(run) -> list[ev.NonFinite]:
    return list(ev.of(ev.read(run), ev.NonFinite))


def test_nan_under_skip_skips_the_step_and_completes(tmp_path):
    job = write_job(tmp_path, "skip", steps=5)
    proc = run_train(2, job, "train.nonfinite=skip", env={"DSLURM_FAULT_NAN": "3"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    (nf,) = _nonfinite(tmp_path / "skip")
    assert nf.action == "skip" and nf.step == 2 and nf.skipped_position == 16, nf
    losses = [e["loss"] for e in step_records(tmp_path / "skip")]
    assert len(losses) == 5 and losses[2] != losses[2] and all(x == x for i, x in enumerate(losses) if i != 2)
    ptr = read_pointer(tmp_path / "skip")
    assert ptr is not None and ptr.step == 5


def test_nan_under_rollback_restores_skips_the_batch_and_completes(tmp_path):
    job = write_job(tmp_path, "rb", steps=6)
    proc = run_train(2, job, "train.nonfinite=rollback", "checkpoint.interval=2",
                     env={"DSLURM_FAULT_NAN": "4"})  # batch 3 (samples 24..31) is poisoned
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "rb"
    (nf,) = _nonfinite(run)  # a replay that read the batch again would NaN (and roll back) again
    assert nf.action == "rollback" and nf.step == 3 and nf.resumed_step == 2, nf
    assert nf.generation is not None and nf.generation.startswith("step-00000002") and nf.skipped_position == 24
    steps = [e["first"] for e in step_records(run)]
    assert steps == [0, 1, 2, 3, 2, 3, 4, 5], steps  # step 3 failed, 2..5 again
    events = ev.read(run)
    assert isinstance(events[-1], ev.Exit) and events[-1].reason == "completed" and events[-1].step == 6
    gen = run / "generations" / read_pointer(run).generation  # the final generation's data position
    meta = json.loads((gen / "meta.json").read_text())
    assert meta["extra"]["skip_positions"] == [24]
    assert meta["extra"]["data"]["position"] + 0 == 7 * 8  # 6 steps trained + the skipped batch


def test_nan_under_stop_exits_81_with_the_pointer_on_a_finite_generation(tmp_path):
    job = write_job(tmp_path, "stop", steps=6)
    proc = run_train(2, job, "train.nonfinite=stop", "checkpoint.interval=2", env={"DSLURM_FAULT_NAN": "4"})
    assert proc.returncode != 0 and f"exitcode  : {X.NONFINITE}" in proc.stderr, proc.stderr[-3000:]
    assert "the loss is not finite" in proc.stderr and "step-00000002" in proc.stderr, proc.stderr[-3000:]
    run = tmp_path / "stop"
    (nf,) = _nonfinite(run)
    events = ev.read(run)
    assert nf.action == "stop" and nf.step == 3 and nf.generation.startswith("step-00000002"), nf
    assert read_pointer(run).step == 2
    (start,) = list_starts(run)
    facts = read_start(start)
    ending = E.classify(facts, E.SlurmView(state="RUNNING"))
    assert ending.cls == E.DIVERGED, ending
    # Every rank's report is stamped when the stop was decided (the error it carries is set only
    # there), not after the cleanup: a scancel/preemption TERM arriving during the cleanup cannot
    # outrank it. Rank 0 decided before it wrote the exit event; the other ranks decide on their
    # own clocks, a moment apart.
    exit_t = max(e.t for e in events if isinstance(e, ev.Exit))
    assert all("non-finite loss at step 3" in r["error"] for r in facts.ranks), facts.ranks
    assert [r["t"] <= exit_t + 0.001 for r in facts.ranks if r["rank"] == 0] == [True], facts.ranks  # ledger: ms
    during_cleanup = exit_t + 0.002  # after the exit event (past the ledger's ms rounding), before the exit
    late_term = E.classify(type(facts)(facts.name, [("TERM", during_cleanup)], facts.launchers, facts.ranks, None),
                           E.SlurmView(state="CANCELLED"))
    assert late_term.cls == E.DIVERGED, late_term
    d = decide(ending=ending.cls, failures=0, max_restarts=3, no_progress_limit=3, start_steps=[0],
               pointer_step=2)
    assert d.action == "stop" and d.exit_code == X.NONFINITE, d
