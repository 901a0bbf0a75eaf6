"""`dslurm doctor`: one synthetic ledger per symptom, and a healthy run that yields nothing."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from test_report import Ledger, two_requeues, uninterrupted

from dslurm.observe.doctor import LogLine, diagnose, read_logs, run
from dslurm.observe.events import decode_all


def healthy() -> Ledger:
    """An uninterrupted run with async saves (small stall) and one preemption saved in time."""
    led = Ledger()
    t = led.train(led.start(0.0, 0, 0), 0, 49, 0, saves={20: 0.05, 40: 0.05})
    led.ev("signal", t, 0, signal="stop_requested", step=50)
    led.ev("ckpt_save", t + 0.1, 0, step=50, stall_s=0.1, total_s=0.4)
    led.ev("exit", t + 0.1, 0, reason="requeue", step=50, code=75)
    led.ev("requeue", t + 1, 0, decision="requeue", step_rc=75, exit_code=0, reason="save-and-requeue")
    t = led.train(led.start(t + 30, 1, 50), 50, 99, 1)
    led.ev("stragglers", t, 1, step=100, slow=[{"rank": 1, "host": "node2", "ratio": 1.6}])  # once: noise
    led.ev("exit", t, 1, reason="completed", step=100, code=0)
    return led


def symptoms(events, logs=()) -> list[str]:
    return [f.symptom for f in diagnose(events, logs)]


def test_healthy_run_has_no_finding():
    assert diagnose(healthy().events, [LogLine("x.out", 1, "step 10/100 loss 5.9")]) == []


def test_hang_before_first_step_with_rendezvous_log_lines():
    led = Ledger()
    led.ev("preflight", 20.0, 0, passed=True, bad_nodes=[], duration_s=20.0)
    led.ev("ckpt_fresh_start", 30.0, 0)  # then nothing: killed at the time limit
    logs = [LogLine("/r/logs/j-1.err", 7, "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError")]
    f, died = diagnose(led.events, logs)
    assert f.symptom == "hang before the first step" and died.symptom == "starts that died"
    assert "no train_start" in f.evidence[0] and "j-1.err:7" in f.evidence[1]
    assert "rendezvous" in f.cause


def test_train_start_without_steps_for_long_is_a_hang():
    led = Ledger()
    t = led.start(0.0, 0, 0)
    led.ev("requeue", t + 900, 0, decision="requeue", step_rc=1, exit_code=0, reason="crash (exit 1)")
    found = symptoms(led.events)
    assert found[0] == "hang before the first step" and "starts that died" in found


def test_throughput_stops_scaling_with_more_ranks():
    led = Ledger()
    t = led.train(led.start(0.0, 0, 0), 0, 29, 0)  # 4 ranks, 1000 tok/s = 250 per rank
    led.ev("exit", t, 0, reason="requeue", step=30, code=75)
    t = led.start(t + 10, 1, 30)
    led.records[-1]["layout"] = {"pp": 1, "dp_replicate": 1, "dp_shard": 4, "tp": 2, "cp": 1}
    t = led.train(t, 30, 59, 1)  # 8 ranks, still 1000 tok/s = 125 per rank
    led.ev("exit", t, 1, reason="completed", step=60, code=0)
    (f,) = diagnose(led.events)
    assert f.symptom == "throughput stops scaling" and "50.0% of 4 ranks" in f.evidence[-1]


def test_sync_save_stalls_are_periodic_idle_stages():
    led = Ledger()
    t = led.train(led.start(0.0, 0, 0), 0, 59, 0, saves={20: 3.0, 40: 3.0})  # 6 s of 60 s
    led.ev("exit", t, 0, reason="completed", step=60, code=0)
    (f,) = diagnose(led.events)
    assert f.symptom.startswith("periodic idle stages") and "async_save" in f.action
    assert "10.0% of 60.0 s" in f.evidence[0] and any("window holding a save" in e for e in f.evidence)


def test_input_bound_steps():
    led = uninterrupted()
    for e in led.records:
        if e["event"] == "steps":
            e["breakdown"]["data"] = 0.5 * e["step_time_s"]
    assert symptoms(led.events) == ["steps wait for input data"]


def test_nan_loss_and_loss_spike_after_resume():
    led = two_requeues()
    steps = [e for e in led.records if e["event"] == "steps"]
    steps[-1]["loss"] = float("nan")
    json.loads(json.dumps(steps[-1]))  # the ledger's json round-trips NaN
    first_after_resume = next(e for e in steps if e["restart"] == 1)
    first_after_resume["loss"] = 9.0
    found = {f.symptom: f for f in diagnose(led.events)}
    assert "loss is NaN or inf" in found
    spike = found["loss spikes"]
    assert "after a resume" in spike.evidence[0] and "did not restore" in spike.cause


def test_resume_failures_from_fallback_restore_failed_and_no_progress():
    led = Ledger()
    t = led.start(0.0, 0, 30)
    led.records[-2].update(event="ckpt_fallback", generation="step-30", reason="step-40 REJECTED")
    t = led.train(t, 30, 39, 0)
    led.ev("exit", t, 0, reason="requeue", step=40, code=75)
    led.ev("ckpt_restore_failed", t + 60, 1, reason="shard count 4 != 8")
    led.ev("requeue", t + 61, 1, decision="stop", step_rc=1, exit_code=76, reason="no progress")
    found = {f.symptom: f for f in diagnose(led.events, [LogLine("j.err", 3, "step-40 REJECTED: crc32")])}
    assert list(found) == ["resume fails or falls back"]  # the fallback start trained: no hang
    f = found["resume fails or falls back"]
    joined = "\n".join(f.evidence)
    assert "ckpt_fallback" in joined and "ckpt_restore_failed" in joined and "no progress" in joined
    assert "j.err:3" in joined


def test_same_straggler_twice_and_preflight_bad_nodes():
    led = healthy()
    led.ev("stragglers", 500.0, 1, step=120, slow=[{"rank": 1, "host": "node2", "ratio": 2.1}])
    led.ev("preflight", 501.0, 2, passed=False, bad_nodes=["node3"], duration_s=20.0, report="r.json")
    found = symptoms(led.events)
    assert "straggler: node2 slow in 2 checks" in found and "burn-in found bad nodes" in found


def test_killed_start_is_reported_with_crash_log_lines():
    led = two_requeues()
    logs = [LogLine("j.err", 9, "torch.OutOfMemoryError: CUDA out of memory"), LogLine("j.out", 1, "ok")]
    (f,) = [f for f in diagnose(led.events, logs) if f.symptom == "starts that died"]
    assert "failed (exit 1)" in f.evidence[0] and f.evidence[1].startswith("j.err:9")


def test_cli_exit_codes_and_log_reading(tmp_path, capsys):
    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps(e) + "\n" for e in healthy().records))
    args = argparse.Namespace(run_dir=tmp_path)
    assert run(args) == 0 and "no symptom" in capsys.readouterr().out
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "j-5.err").write_bytes(b"W1130 09:54:02.491 RendezvousTimeoutError \xff\n")
    assert read_logs(tmp_path)[0].where().startswith("j-5.err:1 [1130 09:54:02]")
    assert run(args) == 0 and "no symptom" in capsys.readouterr().out  # every start trained: teardown noise
    never = Ledger()
    never.ev("job_start", 900.0, 2, hosts=["node1", "node2"], mode="torchrun", nproc_per_node=2)
    never.ev("ckpt_restore", 930.0, 2, step=100)  # then nothing: the ranks never all joined
    with (tmp_path / "ledger.jsonl").open("a") as fh:
        fh.write("".join(json.dumps(e) + "\n" for e in never.records))
    out = (run(args), capsys.readouterr().out)
    assert out[0] == 1 and "hang before the first step" in out[1] and "j-5.err:1" in out[1]
    assert out[1].startswith("RUNNING: step 100")  # no decision yet: not called incomplete


def test_cli_missing_ledger_is_user_error(tmp_path):
    from dslurm.errors import UserError

    with pytest.raises(UserError, match="ledger.jsonl"):
        run(argparse.Namespace(run_dir=tmp_path))


# ---------------------------------------------------------------- the shipped demo's own run

DEMO = Path(__file__).parent / "data" / "demo-6042242"
"""The ledger of a real `scripts/demo.sh` run on the local Slurm cluster (job 6042242: 2 nodes x 2
processes, preempted at step 23 by `scontrol requeue`, stopped by USR2 at step 42, completed at
60; async interval saves every 20 steps, synchronous saves at each stop and at the end)."""


def demo_records() -> list[dict]:
    return [json.loads(line) for line in (DEMO / "ledger.jsonl").read_text().splitlines()]


def test_the_demo_run_has_no_finding_and_doctor_exits_0(capsys):
    assert diagnose(decode_all(demo_records())) == []
    assert run(argparse.Namespace(run_dir=DEMO)) == 0
    assert "no symptom found" in capsys.readouterr().out


def test_saves_at_a_stop_are_not_periodic_stalls():
    # Slow storage at the stops: 3 x 1.2 s of synchronous stop/final saves against ~43 s of steps
    # (8 %) is the exit getting slower, not training stalling at every interval.
    recs = demo_records()
    for r in recs:
        if r["event"] == "ckpt_save" and r["step"] in (23, 42, 60):
            r["stall_s"] = r["total_s"] = 1.2
    assert diagnose(decode_all(recs)) == []
    for r in recs:  # the interval saves (20, 40) blocking for their whole write: that is the symptom
        if r["event"] == "ckpt_save" and r["step"] in (20, 40):
            r["stall_s"] = r["total_s"] = 1.5
    (f,) = diagnose(decode_all(recs))
    assert f.symptom.startswith("periodic idle stages") and "async_save: true" in f.action
    assert "2 of 2 saves blocked" in f.evidence[0] and "3 save(s) at a stop or the end not counted" in f.evidence[0]


def _stall_share(stall: float) -> list:
    """100 steps of 1 s (100 s of training) with one interval save stalling `stall` seconds."""
    led = Ledger()
    t = led.train(led.start(0.0, 0, 0), 0, 99, 0, saves={20: stall})
    led.ev("ckpt_save", t + 0.3, 0, step=100, stall_s=0.3, total_s=0.3)  # the final save: not counted
    led.ev("exit", t + 0.3, 0, reason="completed", step=100, code=0)
    return diagnose(led.events)


def test_a_share_shown_as_the_threshold_is_not_over_it():
    assert _stall_share(5.04) == []  # 5.04 % is shown as 5.0 %: not over a 5.0 % threshold
    (f,) = _stall_share(5.06)
    assert "= 5.1% of 100.0 s of training (threshold 5.0%)" in f.evidence[0]


def test_scaling_and_data_shares_compare_what_they_show():
    led = uninterrupted()
    for e in led.records:
        if e["event"] == "steps":
            e["breakdown"]["data"] = 0.2004 * e["step_time_s"]  # shown 20.0 %: at the threshold
    assert symptoms(led.events) == []
    for e in led.records:
        if e["event"] == "steps":
            e["breakdown"]["data"] = 0.2006 * e["step_time_s"]
    (f,) = diagnose(led.events)
    assert f.evidence[0] == "median data wait 20.1% of the step time (threshold 20.0%)"


def test_evidence_lines_are_in_time_order():
    led = Ledger()
    t = led.train(led.start(0.0, 0, 0), 0, 59, 0, saves={10: 3.0, 30: 3.0, 50: 3.0})
    led.ev("exit", t, 0, reason="completed", step=60, code=0)
    (f,) = diagnose(led.events)
    timed = f.evidence[1:]  # after the headline: saves and the windows holding them, interleaved
    assert timed == sorted(timed) and len(timed) == 6
    assert "ckpt_save" in timed[0] and "window holding a save" in timed[1] and "ckpt_save" in timed[2]

    led = Ledger()
    t = led.start(0.0, 0, 30)
    led.records[-2].update(event="ckpt_fallback", generation="step-30", reason="step-40 REJECTED")
    t = led.train(t, 30, 39, 0)
    led.ev("requeue", t, 0, decision="stop", step_rc=1, exit_code=76, reason="no progress")
    led.ev("ckpt_save_failed", t + 50, 1, step=40, reason="ENOSPC")
    (f,) = [f for f in diagnose(led.events) if f.symptom == "resume fails or falls back"]
    assert [e.split(" restart")[0] for e in f.evidence] == sorted(e.split(" restart")[0] for e in f.evidence)
    assert "no progress" in f.evidence[1] and "ckpt_save_failed" in f.evidence[2]


def test_a_hang_caught_by_the_watchdog_names_the_suspect_its_stacks_and_cost():
    led = Ledger()
    t = led.train(led.start(0.0, 0, 0), 0, 29, 0)
    led.ev("hang", t + 25, 0, step=30, idle_s=21.0, bound_s=20.0, median_step_s=1.0, suspects=[1],
           suspect_hosts=["node1"], why="rank(s) [1] outside every collective while [0] wait inside one",
           collectives={"0": {"name": "forward_backward", "seq": 91, "inside": True, "host": "node1"},
                        "1": {"name": "step_agree", "seq": 90, "inside": False, "host": "node1"}},
           stacks_dir="/r/starts/7.0")
    led.ev("ending", t + 40, 0, cls="crash", reason="crash on rank 1 (node1) at step 30: hang: no step progress")
    t = led.train(led.start(t + 60, 1, 20), 20, 49, 1)
    led.ev("exit", t, 1, reason="completed", step=50, code=0)
    found = diagnose(led.events)
    hang = next(f for f in found if f.symptom.startswith("hang during training"))
    assert "suspect rank(s) [1] on node1" in hang.symptom
    text = "\n".join(hang.evidence)
    assert "/r/starts/7.0/hang-rank-*.txt" in text and "21 s without progress" in text
    assert "rank 0: last collective forward_backward #91 (inside)" in text
    assert "collective wait" in hang.cause and "burnin` on node1" in hang.action
    assert "ended by crash" in [f.symptom for f in found]


def test_non_finite_steps_handled_by_the_policy_are_evidence_of_nan():
    led = Ledger()
    t = led.train(led.start(0.0, 0, 0), 0, 9, 0)
    led.ev("nonfinite", t, 0, step=10, loss=float("nan"), grad_norm=float("nan"), action="rollback", handled=1,
           generation="step-00000008-x", resumed_step=8, skipped_position=80)
    led.ev("nonfinite", t + 1, 0, step=12, loss=float("inf"), grad_norm=float("nan"), action="stop", handled=1,
           generation="step-00000008-x")
    led.ev("exit", t + 2, 0, reason="nonfinite", step=13, code=81)
    led.ev("ending", t + 3, 0, cls="diverged", reason="diverged on rank 0")
    found = diagnose(led.events)
    nan = next(f for f in found if f.symptom == "loss is NaN or inf")
    assert "action=rollback" in nan.evidence[0] and "skipped_position=80" in nan.evidence[0]
    assert "action=stop" in nan.evidence[1] and "stopped on it" in nan.cause
    assert "ended by diverged" in [f.symptom for f in found]


# ---------------------------------------------------------------- issue 24: a hung start torn down

TEARDOWN = [  # what torchrun printed while srun tore down the start the watchdog had caught
    "[W1130 10:02:11.123 socket.cpp:464] [c10d] The client socket has failed to connect to [node1]:29500 "
    "(errno: 111 - Connection refused).",
    "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d store has "
    "failed. See inner exception for details.",
    "torch.distributed.DistNetworkError: Connection reset by peer",
]


def test_rendezvous_errors_of_a_start_that_trained_are_teardown_noise_not_a_startup_hang():
    from test_report_completion import frozen_rank

    logs = [LogLine("/r/logs/t-7001.err", i, text) for i, text in enumerate(TEARDOWN, 1)]
    found = {f.symptom: f for f in diagnose(frozen_rank().events, logs)}
    assert "hang before the first step" not in found  # both starts trained: the ledger says so
    hang = found["hang during training at step 10 (suspect rank(s) [2] on node2)"]
    assert "burnin` on node2" in hang.action  # the frozen rank left no note: its host from the layout


def test_rendezvous_errors_still_count_for_a_start_that_never_stepped():
    from test_report_completion import frozen_rank

    led = frozen_rank()
    led.ev("job_start", 2000.0, 2, hosts=["node1", "node2"], mode="torchrun", nproc_per_node=2)
    led.ev("ckpt_restore", 2010.0, 2, step=8)
    led.ev("requeue", 2100.0, 2, decision="requeue", step_rc=1, exit_code=0, ending="crash", reason="crash")
    logs = [LogLine("/r/logs/t-7001.err", 2, TEARDOWN[1])]
    (f,) = [f for f in diagnose(led.events, logs) if f.symptom == "hang before the first step"]
    assert f.evidence[0].startswith("start 2 (7001.2)") and "t-7001.err:2" in f.evidence[1]
    assert "hang before the first step" not in symptoms(led.events)  # 90 s and a recorded crash: a crash


def test_doctor_says_first_that_the_run_ended_short(tmp_path, capsys):
    from test_report_completion import TINY, frozen_rank

    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps(e) + "\n" for e in frozen_rank().records))
    (tmp_path / "job.yaml").write_text(TINY.read_text().replace("steps: 60", "steps: 40"))
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "t-7001.err").write_text("\n".join(TEARDOWN) + "\n")
    assert run(argparse.Namespace(run_dir=tmp_path)) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("INCOMPLETE: stopped at step 8 of 40 — cancelled: ")
    assert out[1] == f"continue with: dslurm submit --run-dir {tmp_path} (resumes from the checkpoint at step 8)"
    assert not any("hang before the first step" in x for x in out)
    assert any("suspect rank(s) [2] on node2" in x for x in out)
