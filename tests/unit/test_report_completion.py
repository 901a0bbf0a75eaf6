"""`dslurm report`'s first line: whether the run finished, and how to continue one that ended short.

The fixture is the shape of issue 24's frozen-rank run: 2 nodes x 2 ranks, rank 2 (on node2)
frozen at step 10, the watchdog caught it (no note from the frozen rank, so the hang event names
no host), the start ended `crash` and was requeued; the next start was stopped by a stray TERM
at step 8 and the run ended there, 8 of 40 steps.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from test_report import Ledger, two_requeues, uninterrupted

from dslurm.observe.completion import completion, target_steps
from dslurm.observe.events import JobStart, decode_all
from dslurm.observe.report import rank_host, run, summarize

TINY = Path(__file__).resolve().parents[2] / "examples/jobs/tiny-2node.yaml"
HOSTS = ["node1", "node2"]
HANG_WHY = "rank(s) [2] outside every collective while [0, 1, 3] wait inside one"
STRAY = "cancelled: a TERM reached the batch shell, sender unknown"


def frozen_rank(job_id: str = "7001") -> Ledger:
    """Issue 24's run: hang at step 10 (crash, requeued), stray TERM at step 8, job over."""
    led = Ledger(job_id)
    led.ev("submit", 0.0, job_ids=[int(job_id)])
    led.ev("job_start", 5.0, 0, hosts=HOSTS, mode="torchrun", nproc_per_node=2)
    t = led.train(led.start(5.0, 0, 0), 0, 9, 0, every=5, saves={5: 0.1})
    notes = {str(r): {"name": "forward_backward", "seq": 40, "inside": True, "host": HOSTS[r // 2]}
             for r in (0, 1, 3)}  # the frozen rank 2 wrote no note
    led.ev("hang", t + 25, 0, step=10, idle_s=21.0, bound_s=20.0, median_step_s=1.0, suspects=[2],
           suspect_hosts=[], why=HANG_WHY, collectives=notes, stacks_dir="/r/starts/7001.0")
    led.ev("ending", t + 40, 0, cls="crash", reason="crash on rank 2 at step 10: hang: no step progress")
    led.ev("requeue", t + 41, 0, decision="requeue", step_rc=1, exit_code=0, ending="crash",
           reason="crash: requeue (failure restart 1 of 3)")
    led.ev("job_start", t + 70, 1, hosts=HOSTS, mode="torchrun", nproc_per_node=2)
    t1 = led.start(t + 70, 1, 5)  # resumed from the save at step 5; steps 5..7, then the TERM
    led.ev("signal", t1 + 3, 1, signal="stop_requested", step=8)
    led.ev("ckpt_save", t1 + 3.5, 1, step=8, stall_s=0.5, total_s=0.5)
    led.ev("exit", t1 + 3.5, 1, reason="terminated", step=8, code=143)
    led.ev("ending", t1 + 5, 1, cls="cancelled", reason=STRAY.split(": ", 1)[1], step=8, saved=True)
    led.ev("requeue", t1 + 6, 1, decision="stop", step_rc=143, exit_code=143, ending="cancelled",
           reason="cancelled: Slurm ended the step and decides what comes next")
    return led


def test_a_run_that_ended_short_says_so_first_with_why_and_how_to_continue():
    c = summarize(frozen_rank().events, target_steps=40, run_dir="/runs/r").completion
    assert (c.status, c.complete, c.stopped_at, c.target_steps, c.resumes_from) == ("incomplete", False, 8, 40, 8)
    assert c.lines() == [
        f"INCOMPLETE: stopped at step 8 of 40 — {STRAY} (stop: cancelled: Slurm ended the step and decides "
        "what comes next)",
        "continue with: dslurm submit --run-dir /runs/r (resumes from the checkpoint at step 8)"]


def test_report_cli_puts_the_headline_first_and_in_the_json(tmp_path, capsys):
    (tmp_path / "ledger.jsonl").write_text("".join(json.dumps(r) + "\n" for r in frozen_rank().records))
    (tmp_path / "job.yaml").write_text(TINY.read_text().replace("steps: 60", "steps: 40"))
    assert target_steps(tmp_path) == 40
    assert run(argparse.Namespace(run_dir=tmp_path, json=False, png=None, no_png=True)) == 0
    out = capsys.readouterr().out
    assert out.startswith("INCOMPLETE: stopped at step 8 of 40 — cancelled")
    assert out.splitlines()[1].startswith(f"continue with: dslurm submit --run-dir {tmp_path}")
    assert "suspects [2] on node2" in out  # the frozen rank's host, from the start's layout
    assert run(argparse.Namespace(run_dir=tmp_path, json=True, png=None, no_png=True)) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["status"], d["complete"], d["target_steps"], d["stopped_at"]) == ("incomplete", False, 40, 8)
    assert d["why"].startswith("cancelled: ") and d["continue_with"] == f"dslurm submit --run-dir {tmp_path}"
    assert list(d)[:2] == ["status", "complete"]


def test_completed_runs_and_runs_still_going_are_not_called_incomplete():
    def status(led: Ledger, **kw) -> tuple[str, bool | None]:
        c = summarize(led.events, target_steps=100, **kw).completion
        return c.status, c.complete

    assert status(uninterrupted()) == ("completed", True)
    assert summarize(two_requeues().events, target_steps=100).completion.lines() == ["COMPLETED: step 100 of 100"]
    led = frozen_rank()
    led.records = [r for r in led.records if r["restart"] == 0 or r["event"] not in ("ending", "requeue")]
    assert status(led) == ("running", None)  # the second start has no decision yet
    assert "RUNNING: step 8 of 100 so far" in summarize(led.events, target_steps=100).completion.lines()[0]
    led = frozen_rank()
    led.records[-1]["decision"] = "requeue"
    assert status(led) == ("requeued", None)
    led = frozen_rank()
    led.ev("submit", 10_000.0, job_ids=[7002])  # resubmitted (dslurm submit --run-dir), not started yet
    assert status(led) == ("queued", None)
    chained = frozen_rank()
    chained.records[0]["job_ids"] = [7001, 7002]  # --chain 2: the next link continues
    assert status(chained) == ("queued", None)
    chained.ev("chain_cancel", 10_000.0, job_ids=[7002], reason="budget")
    assert status(chained) == ("incomplete", False)


def test_target_unknown_still_says_where_it_stopped(tmp_path):
    assert target_steps(tmp_path) is None  # no frozen job.yaml
    (tmp_path / "job.yaml").write_text("train: [not, a, mapping]\n")
    assert target_steps(tmp_path) is None
    c = completion(summarize(frozen_rank().events).starts, frozen_rank().events, None)
    assert c.lines()[0].startswith("INCOMPLETE: stopped at step 8 — cancelled")
    assert c.continue_with == "dslurm submit --run-dir RUN_DIR"


def test_rank_host_from_the_layout():
    start = JobStart(hosts=["node2", "node1"], mode="torchrun", nproc_per_node=2)
    # c10d numbers the nodes by host name (torch's rendezvous sorts its participants)
    assert [rank_host(r, start) for r in range(5)] == ["node1", "node1", "node2", "node2", None]
    assert rank_host(0, JobStart(hosts=["a"], mode="srun", nproc_per_node=1)) is None
    assert rank_host(0, JobStart(hosts=["a"])) is None and rank_host(0, None) is None


def test_a_suspect_host_named_by_the_event_is_kept_and_the_png_title_says_incomplete():
    led = frozen_rank()
    hang = next(r for r in led.records if r["event"] == "hang")
    hang.update(suspects=[2, 3], suspect_hosts=["node9"])
    sm = summarize(led.events, target_steps=40)
    line = next(x for x in sm.health if x.startswith("hang"))
    assert "suspects [2, 3] on node9, node2):" in line  # node9 named; rank 3's note says node2
    from dslurm.observe.plot import timeline_title

    assert timeline_title(sm).startswith("INCOMPLETE at step 8 of 40: goodput")


def test_json_of_a_completed_run_has_the_fields_too():
    d = summarize(decode_all(uninterrupted().records), target_steps=100).to_dict()
    assert (d["status"], d["complete"], d["stopped_at"], d["why"], d["continue_with"]) == (
        "completed", True, 100, None, None)


def test_a_hang_is_back_to_training_at_the_next_starts_first_step_even_before_a_logged_window():
    led = frozen_rank()
    t1 = next(r["t"] for r in led.records if r["event"] == "train_start" and r["restart"] == 1)
    led.ev("start_phases", t1 + 1.0, 1, t0=t1 - 8.0, phases={"first_step": 1.0}, total_s=9.0, step=5)
    led.records.sort(key=lambda r: r["t"])
    hang_t = next(r["t"] for r in led.records if r["event"] == "hang")
    line = next(x for x in summarize(led.events).health if x.startswith("hang"))
    assert f"back to training {t1 + 1.0 - hang_t:.0f} s later" in line
