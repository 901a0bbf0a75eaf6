"""`dslurm report`: goodput, lost steps, restart overhead and exit reasons from synthetic ledgers.

The fixtures copy the shape of real ledgers (a 2-node run under the local Slurm): the same
event names and fields, with round times so every expected number can be worked out by hand.
"""

from __future__ import annotations

import argparse
import json
import math

import pytest

from dslurm.errors import UserError
from dslurm.observe.events import Event, Steps, TrainStart, decode_all
from dslurm.observe.plot import plot_timeline
from dslurm.observe.report import load, run, summarize
from dslurm.observe.starts import DIED, split_starts


class Ledger:
    """Builds events the way the producers write them (t, job_id, restart, host + fields)."""

    def __init__(self, job_id: str | None = "6034286") -> None:
        self.records: list[dict] = []
        self.job_id = job_id

    @property
    def events(self) -> list[Event]:
        """Typed, as dslurm.observe.events.read gives them (a field a producer got wrong is dropped)."""
        return decode_all(self.records)

    def ev(self, name: str, t: float, restart: int = 0, **fields) -> None:
        self.records.append({"event": name, "t": t, "job_id": None if name == "submit" else self.job_id,
                             "restart": restart, "host": "node1", **fields})

    def start(self, t: float, restart: int, resume: int, burnin: float = 20.0, startup: float = 8.0) -> float:
        """Burn-in from t, then the trainer starts; returns the time of the first step."""
        self.ev("preflight", t + burnin, restart, passed=True, bad_nodes=[], duration_s=burnin)
        t_first = t + burnin + 2.0 + startup  # 2 s: torchrun launch between burn-in and trainer
        self.ev("ckpt_restore" if resume else "ckpt_fresh_start", t_first - 0.01, restart, step=resume)
        self.ev("train_start", t_first, restart, step=resume, startup_s=startup,
                layout={"pp": 1, "dp_replicate": 1, "dp_shard": 2, "tp": 2, "cp": 1})
        return t_first

    def train(self, t: float, first: int, last: int, restart: int, step_s: float = 1.0, every: int = 10,
              saves: dict[int, float] | None = None, mfu: float | None = None) -> float:
        """Windows of `every` steps from step `first` to `last` (inclusive); a save at step k
        stalls the window that starts at k (the trainer bills it to the checkpoint phase)."""
        saves = saves or {}
        for a in range(first, last + 1, every):
            b = min(last, a + every - 1)
            n, stall = b - a + 1, saves.get(a, 0.0)
            if stall:
                self.ev("ckpt_save", t + stall, restart, step=a, stall_s=stall, total_s=stall)
            t += n * step_s + stall
            self.ev("steps", t, restart, first=a, last=b, loss=6.0 - b / 100, tokens_per_s=1000.0, mfu=mfu,
                    mfu_label="cpu: no peak" if mfu is None else "bf16", step_time_s=step_s + stall / n,
                    breakdown={"compute": step_s, "checkpoint": stall / n}, duration_s=n * step_s + stall)
        return t


def uninterrupted() -> Ledger:
    led = Ledger()
    led.ev("submit", 0.0, job_ids=[6034286])
    t = led.start(10.0, 0, 0)  # queue 10 s, burn-in 20 s, first step at 40
    t = led.train(t, 0, 99, 0, saves={50: 0.5})  # 100 steps of 1 s + 0.5 s stall
    led.ev("ckpt_save", t + 0.2, 0, step=100, stall_s=0.2, total_s=0.2)
    led.ev("exit", t + 0.2, 0, reason="completed", step=100, code=0)
    led.ev("requeue", t + 1.0, 0, decision="end", step_rc=0, exit_code=0, reason="completed")
    return led


def two_requeues() -> Ledger:
    """Start 0 crashes after step 59 (last save at 30); start 1 is preempted at 80 (saved);
    start 2 completes at 100. Queue waits: 10 s, then 25 s, then 40 s."""
    led = Ledger()
    led.ev("submit", 0.0, job_ids=[6034286])
    t = led.start(10.0, 0, 0)
    t = led.train(t, 0, 59, 0, saves={30: 0.5})
    led.ev("requeue", t + 5.0, 0, decision="requeue", step_rc=1, exit_code=0, reason="crash (exit 1)")
    t1 = led.start(t + 5.0 + 25.0, 1, 30)
    t = led.train(t1, 30, 79, 1)
    led.ev("signal", t, 1, signal="stop_requested", step=80)
    led.ev("ckpt_save", t + 0.5, 1, step=80, stall_s=0.5, total_s=0.5)
    led.ev("exit", t + 0.5, 1, reason="requeue", step=80, code=75)
    led.ev("requeue", t + 3.0, 1, decision="requeue", step_rc=75, exit_code=0, reason="save-and-requeue")
    t2 = led.start(t + 3.0 + 40.0, 2, 80)
    t = led.train(t2, 80, 99, 2)
    led.ev("exit", t, 2, reason="completed", step=100, code=0)
    led.ev("requeue", t + 1.0, 2, decision="end", step_rc=0, exit_code=0, reason="completed")
    return led


def test_uninterrupted_goodput_is_step_time_over_wall():
    sm = summarize(uninterrupted().events)
    # begin = preflight t - duration = 10; end = the requeue decision at 40 + 100.5 + 1 = 141.5
    assert sm.wall_s == pytest.approx(131.5)
    assert sm.queue_wait_s == pytest.approx(10.0)
    assert sm.productive_s == pytest.approx(100.0)  # the 0.5 s stall is not training
    assert sm.goodput == pytest.approx(100.0 / 131.5)
    assert sm.restarts == 0 and sm.lost_steps == 0 and sm.lost_s == 0
    assert sm.checkpoint_overhead_s == pytest.approx(0.7) and sm.saves == 2
    assert sm.startup_overhead_s == pytest.approx(30.0)  # burn-in 20 + launch 2 + startup 8
    assert sm.final_step == 100 and sm.starts[0].exit_reason == "completed"
    assert sm.starts[0].world_size == 4
    assert sm.mfu is None and sm.mfu_label == "n/a (cpu: no peak)"
    assert sm.tokens_per_s == pytest.approx(1000.0, rel=0.01)


def test_two_requeues_lost_steps_overhead_and_queue_wait():
    sm = summarize(two_requeues().events)
    s0, s1, s2 = sm.starts
    assert [s.restart for s in sm.starts] == [0, 1, 2]
    assert [s.resumed_from for s in sm.starts] == [0, 30, 80]
    assert [s.discarded_steps for s in sm.starts] == [30, 0, 0]  # steps 30..59 of start 0
    assert sm.lost_steps == 30 and sm.lost_s == pytest.approx(30.0)
    assert [s.queue_wait_s for s in sm.starts] == pytest.approx([10.0, 25.0, 40.0])
    assert sm.queue_wait_s == pytest.approx(75.0)
    # kept steps: 30 of start 0, 50 of start 1, 20 of start 2, 1 s each
    assert sm.productive_s == pytest.approx(100.0)
    # each start: burn-in 20 + launch 2 + startup 8 before its first step
    assert sm.restarts == 2 and sm.restart_overhead_s == pytest.approx(60.0)
    wall = sum(s.end - s.begin for s in sm.starts)
    assert sm.wall_s == pytest.approx(wall)
    span = sm.starts[-1].end - sm.starts[0].begin
    assert sm.wall_s == pytest.approx(span - 25.0 - 40.0)  # the waits between starts are not wall
    assert sm.goodput == pytest.approx(100.0 / wall)
    assert [s.exit_reason for s in sm.starts] == ["failed (exit 1)", "requeue", "completed"]
    assert [s.decision for s in sm.starts] == ["requeue", "requeue", "end"]
    assert s0.windows[2].kept == 10 and s0.windows[3].kept == 0  # 20..29 kept, 30..39 redone


def test_nested_fallback_counts_each_redone_step_once():
    """Start 0 reaches 100, start 1 resumes at 80 and reaches 90, start 2 falls back to 70:
    redone = 70..99 of start 0 (30) + 80..89 of start 1 (10), not 20 + 30."""
    led = Ledger()
    t = led.train(led.start(0.0, 0, 0), 0, 99, 0)
    t = led.train(led.start(t + 10, 1, 80), 80, 89, 1)
    t = led.train(led.start(t + 10, 2, 70), 70, 119, 2)
    led.ev("exit", t, 2, reason="completed", step=120, code=0)
    sm = summarize(led.events)
    assert [s.discarded_steps for s in sm.starts] == [30, 10, 0]
    assert sm.lost_steps == 40 and sm.productive_s == pytest.approx(120.0)


def test_crash_without_exit_event_and_no_requeue():
    led = two_requeues()
    cut = max(i for i, e in enumerate(led.events) if e.NAME == "steps" and e.restart == 2)
    sm = summarize(led.events[:cut + 1])  # killed: no exit, no requeue-me
    assert sm.starts[-1].exit_reason == DIED and sm.starts[-1].decision is None
    assert sm.final_step == 100 and sm.lost_steps == 30


def test_runs_outside_slurm_split_on_a_second_train_start():
    """No job id and restart 0 everywhere (python -m train twice): still two starts."""
    led = Ledger(job_id=None)
    t = led.train(led.start(0.0, 0, 0, burnin=0.0), 0, 9, 0)
    led.ev("exit", t, 0, reason="requeue", step=10, code=75)
    t = led.train(led.start(t + 5, 0, 10, burnin=0.0), 10, 19, 0)
    assert len(split_starts(led.events)) == 2
    assert summarize(led.events).starts[1].resumed_from == 10


def test_stop_decisions_name_no_progress_and_budget():
    led = Ledger()
    led.start(0.0, 0, 40)
    led.ev("requeue", 40.0, 0, decision="stop", step_rc=1, exit_code=76, reason="no progress: ...")
    led.start(100.0, 1, 40)
    led.ev("exit", 131.0, 1, reason="requeue", step=40, code=75)
    led.ev("requeue", 132.0, 1, decision="stop", step_rc=75, exit_code=77, reason="budget spent")
    sm = summarize(led.events)
    assert [s.exit_reason for s in sm.starts] == ["no_progress", "budget"]
    assert sm.goodput == 0.0


def test_mfu_mean_and_stragglers_by_host():
    led = Ledger()
    t = led.train(led.start(0.0, 0, 0), 0, 19, 0, mfu=0.4)
    led.ev("stragglers", t, 0, step=20, slow=[{"rank": 3, "host": "node2", "ratio": 2.0}])
    led.ev("stragglers", t + 1, 0, step=40, slow=[{"rank": 3, "host": "node2", "ratio": 1.9}])
    led.ev("stragglers", t + 2, 0, step=60, slow=[])
    sm = summarize(led.events)
    assert sm.mfu == pytest.approx(0.4) and sm.mfu_label == "40.0%"
    assert sm.stragglers == {"node2": 2} and sm.straggler_checks == 3


def _write(tmp_path, events, tail: bytes = b"") -> None:
    data = b"".join(json.dumps(e).encode() + b"\n" for e in events) + tail
    (tmp_path / "ledger.jsonl").write_bytes(data)


def test_torn_last_line_and_garbage_are_skipped(tmp_path):
    led = uninterrupted()
    _write(tmp_path, led.records[:-1], tail=b'{"event":"requeue","t":14')  # kill -9 mid-write
    events, skipped = load(tmp_path)
    assert skipped == 1 and len(events) == len(led.events) - 1
    sm = summarize(events, skipped)
    assert sm.starts[0].exit_reason == "completed" and sm.skipped_lines == 1


def test_missing_or_empty_ledger_is_a_user_error_naming_the_path(tmp_path):
    with pytest.raises(UserError, match=str(tmp_path / "ledger.jsonl")):
        load(tmp_path)
    (tmp_path / "ledger.jsonl").write_bytes(b'{"event": "steps", "t"\n\n')
    with pytest.raises(UserError, match="no readable event"):
        load(tmp_path)


def test_a_file_given_for_the_run_directory_is_named_as_such_and_nothing_is_removed(tmp_path, capsys):
    """`dslurm report some.yaml` (issue 54) said to "remove the file": the file is the user's job
    file. Report, doctor and watch say it is a file and where the run directory is named."""
    from dslurm.cli import main

    job = tmp_path / "some.yaml"
    job.write_text("name: x\n")
    for cmd in ("report", "doctor", "watch"):
        assert main([cmd, str(job)]) == 2
        err = capsys.readouterr().err
        assert "some.yaml: a file, not a run directory" in err and "checkpoint.run_dir" in err, err
        assert "remove" not in err
    assert job.read_text() == "name: x\n"


def test_summary_of_no_events_is_empty_not_a_crash():
    sm = summarize([])
    assert sm.starts == [] and sm.goodput is None and sm.wall_s == 0


def test_png_is_written_and_valid(tmp_path):
    png = plot_timeline(summarize(two_requeues().events), tmp_path / "t.png")
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_cli_json_and_default_png(tmp_path, capsys):
    _write(tmp_path, two_requeues().records)
    args = argparse.Namespace(run_dir=tmp_path, json=True, png=None, no_png=False)
    assert run(args) == 0
    out = json.loads(capsys.readouterr().out)  # stdout holds only the JSON
    assert out["lost_steps"] == 30 and out["restarts"] == 2 and "events" not in out["starts"][0]
    assert math.isclose(out["queue_wait_s"], 75.0)
    assert (tmp_path / "report.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_text_names_exit_reasons(tmp_path, capsys):
    led = two_requeues()
    _write(tmp_path, led.records[:-2])  # the last start is killed before its exit event
    assert run(argparse.Namespace(run_dir=tmp_path, json=False, png=None, no_png=True)) == 0
    out = capsys.readouterr().out
    assert "died without exit event" in out and "failed (exit 1)" in out and "goodput" in out
    assert not (tmp_path / "report.png").exists()


def test_cli_missing_ledger_exits_2(cli, tmp_path):
    res = cli("report", str(tmp_path))
    assert res.returncode == 2 and str(tmp_path / "ledger.jsonl") in res.stderr
    assert "Traceback" not in res.stderr


def test_a_run_that_ended_on_a_failed_save_counts_the_steps_in_no_checkpoint():
    # Disk full with on_error: continue: every save failed; the run ended save_failed at 25.
    led = Ledger()
    led.ev("submit", 0.0, job_ids=[7])
    t = led.start(10.0, 0, 0)
    t = led.train(t, 0, 24, 0)
    led.ev("ckpt_save_failed", t, 0, step=25, reason="No space left on device")
    led.ev("exit", t, 0, reason="save_failed", step=25, code=74)
    led.ev("ending", t + 1, 0, cls="save_failed", reason="save failed on rank 0: ENOSPC")
    led.ev("requeue", t + 1, 0, decision="stop", step_rc=74, exit_code=74, reason="not durable")
    sm = summarize(led.events)
    assert sm.undurable_steps == 25 and sm.lost_steps == 25
    assert sm.starts[0].ending == "save_failed" and sm.endings == {"save_failed": 1}


def test_report_json_is_strict_json_with_a_nan_loss(tmp_path, capsys):
    import json
    import math

    from dslurm.cli import main
    from dslurm.observe.ledger import Ledger as RealLedger

    led = RealLedger(tmp_path)
    led.append(TrainStart(step=0, startup_s=1.0))
    led.append(Steps(first=0, last=0, loss=math.nan, step_time_s=0.1, duration_s=0.1))
    assert main(["report", str(tmp_path), "--json", "--no-png"]) == 0

    def refuse(name):
        raise ValueError(name)

    out = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert out["starts"][0]["job_id"] is None


# ---------------------------------------------------------------- what happened after each start

def _demo_summary():
    from pathlib import Path

    from dslurm.observe.events import read

    return summarize(read(Path(__file__).parent / "data" / "demo-6042242"))


def test_a_slurm_stop_followed_by_a_start_of_the_same_job_was_requeued_by_slurm(capsys):
    from pathlib import Path

    sm = _demo_summary()  # a real demo run: preempted (decision stop), USR2 (requeue), completed
    assert [s.decision for s in sm.starts] == ["stop", "requeue", "end"]
    assert [s.outcome for s in sm.starts] == ["requeued by Slurm", "requeued by dslurm", "ended"]
    run_dir = Path(__file__).parent / "data" / "demo-6042242"
    assert run(argparse.Namespace(run_dir=run_dir, json=False, png=None, no_png=True)) == 0
    out = capsys.readouterr().out
    assert "preempted > requeued by Slurm" in out and "> stop" not in out


def test_outcome_names_what_came_next():
    from dslurm.observe.starts import outcome

    assert outcome("stop", requeued_by_slurm=False) == "stopped"  # cancelled, or no budget left
    assert outcome("stop", requeued_by_slurm=True) == "requeued by Slurm"
    assert outcome(None, requeued_by_slurm=True) == "requeued by Slurm"  # killed with its batch shell
    assert outcome(None, requeued_by_slurm=False) is None  # still running, or died: the exit says so
    assert outcome("requeue", requeued_by_slurm=True) == "requeued by dslurm"
    assert outcome("end", requeued_by_slurm=False) == "ended"
    sm = summarize(two_requeues().events)
    assert [s.outcome for s in sm.starts] == ["requeued by dslurm", "requeued by dslurm", "ended"]
    led = two_requeues()  # a stop with no later start of that job: it stopped
    sm = summarize(decode_all([{**r, "decision": "stop"} if r["event"] == "requeue" else r
                               for r in led.records if r["restart"] == 0]))
    assert sm.starts[-1].outcome == "stopped"


def test_png_labels_name_what_came_next_and_the_legend_names_the_markers():
    import matplotlib.pyplot as plt

    from dslurm.observe.plot import timeline_figure

    fig = timeline_figure(_demo_summary())
    try:
        top = fig.axes[0]
        labels = [t.get_text() for t in top.get_yticklabels()]
        assert labels[0] == "0: preempted > requeued by Slurm" and labels[2] == "2: completed > ended"
        legend = [t.get_text() for t in top.get_legend().get_texts()]
        assert "interruption (stop signal)" in legend and "outcome (what happened next)" in legend
        assert {"save", "no exit event", "training", "queue wait"} <= set(legend)
    finally:
        plt.close(fig)


def _phased() -> Ledger:
    """two_requeues with the launcher's job_start and the trainer's start_phases per start:
    the cold start took 8 s to its first step, the restarts 9 s (1.125x) and 6 s (0.75x)."""
    led = two_requeues()
    out, k = [], 0
    for rec in led.records:
        if rec["event"] == "preflight":
            out.append({**rec, "event": "job_start", "t": rec["t"] - rec["duration_s"] - 1.0, "hosts": ["node1"]})
        out.append(rec)
        if rec["event"] == "train_start":
            first = (8.0, 9.0, 6.0)[k]
            born = rec["t"] - first + 0.5
            out.append({**{x: rec[x] for x in ("job_id", "restart", "host")}, "event": "start_phases",
                        "t": rec["t"] + 0.5, "t0": born,
                        "phases": {"imports": first - 3.0, "rendezvous": 1.0, "restore": 1.0, "first_step": 1.0},
                        "step": rec["step"], "generation": None if k == 0 else f"step-{rec['step']}"})
            k += 1
    led.records = out
    return led


def test_report_shows_each_starts_phases_and_its_ratio_to_the_cold_start(capsys, tmp_path):
    from dslurm.observe.plot import print_summary, timeline_figure

    sm = summarize(_phased().events)
    phased = [s for s in sm.starts if s.phases]
    assert len(phased) == 3 and phased[0].phases[0][0] == "spawn"  # job_start -> the worker's birth
    spawn = [dict(s.phases)["spawn"] for s in phased]
    totals = [sum(v for _, v in s.phases) for s in phased]
    assert [round(t - sp, 3) for t, sp in zip(totals, spawn)] == [8.0, 9.0, 6.0]
    assert phased[0].startup_ratio == 1.0
    assert phased[1].startup_ratio == pytest.approx(totals[1] / totals[0], rel=1e-3)
    print_summary(sm, tmp_path)
    out = capsys.readouterr().out
    assert "start-up by phase" in out and "x cold start" in out and "rendezvous" in out
    import matplotlib.pyplot as plt

    fig = timeline_figure(sm)
    try:
        legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    finally:
        plt.close(fig)
    assert {"startup: imports", "startup: restore", "startup: spawn"} <= set(legend)
    assert "startup: build" not in legend  # only the phases this run measured


def test_a_start_without_exit_event_takes_its_reason_from_the_classified_ending():
    """A burn-in-only start whose rejection srun tore down (step rc 143) is the burn-in's
    verdict, not a kill; a crash torchrun folded into 1 names the class; old ledgers keep the code."""
    from dslurm.observe.doctor import diagnose

    led = Ledger()
    led.ev("submit", 0.0, job_ids=[6034286])
    t = led.start(10.0, 0, 0)
    led.ev("requeue", t + 1.0, 0, decision="requeue", step_rc=143, exit_code=0, ending="burnin_rejected",
           reason="bad nodes found by burn-in")
    t = led.start(t + 20.0, 1, 0)
    t = led.train(t, 0, 9, 1)
    led.ev("requeue", t + 1.0, 1, decision="requeue", step_rc=1, exit_code=0, ending="node_failure",
           reason="node failure")
    t = led.start(t + 20.0, 2, 0)
    t = led.train(t, 0, 19, 2)
    led.ev("requeue", t + 1.0, 2, decision="end", step_rc=143, exit_code=0, ending="completed", reason="completed")
    sm = summarize(led.events)
    assert [s.exit_reason for s in sm.starts] == ["preflight_failed", "failed (node_failure, exit 1)",
                                                  "completed (no exit event)"]
    (died,) = [f for f in diagnose(led.events, []) if f.symptom == "starts that died"]
    assert len(died.evidence) == 1 and "node_failure" in died.evidence[0]  # the rejection is no death


def test_a_stray_stop_is_named_as_such_not_as_terminated():
    led = Ledger()
    led.ev("submit", 0.0, job_ids=[7])
    t = led.start(10.0, 0, 0)
    t = led.train(t, 0, 7, 0)
    led.ev("exit", t, 0, reason="terminated", step=8, code=143)  # the ranks' own exit on the TERM
    led.ev("ending", t + 1, 0, cls="stray_stop", reason="stray stop: a TERM reached the job step only")
    led.ev("requeue", t + 1, 0, decision="requeue", step_rc=143, exit_code=0, reason="stray stop: requeue",
           ending="stray_stop")
    (start,) = summarize(led.events).starts
    assert start.exit_reason.startswith("stray stop") and start.decision == "requeue"
