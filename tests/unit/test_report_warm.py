"""Warm and cold starts apart in `dslurm report` (text, --json, PNG) and in `plan simulate
--from-run` (warm in-allocation costs, cold requeue costs), from a synthetic ledger whose numbers
are worked out by hand, and from the real warm ledgers in tests/unit/data (recovery.warm,
docs/recovery.md). Pure: no Slurm, no torch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dslurm.observe import events as ev
from dslurm.observe.plot import print_summary, startup_line, timeline_figure
from dslurm.observe.report import summarize
from dslurm.plan.run_inputs import from_runs, measure

DATA = Path(__file__).parent / "data"
WARM_RESTART, WARM_SWAP = str(DATA / "warmrestart-6049507"), str(DATA / "warmswap-6049509")
SPARES, SPARESWAP = str(DATA / "spares-6043404"), str(DATA / "spareswap-6044292")


def _start(out: list[dict], t: float, mode: str, startup: float, step: int, until: int, *,
           imports: float) -> float:
    """job_start at t, a worker born 0.5 s later whose phases sum to startup - 0.5, then steps
    step..until-1 of 1 s each; returns the time of the last step."""
    base = {"job_id": "7000", "restart": 0, "host": "node1"}
    out.append({**base, "event": "job_start", "t": t, "hosts": ["node1"], "mode": mode, "nproc_per_node": 2})
    done = t + startup  # the first step is done
    rest = startup - 0.5 - imports
    out.append({**base, "event": "train_start", "t": done - 0.5, "step": step,
                "generation": None if step == 0 else f"step-{step}"})
    out.append({**base, "event": "start_phases", "t": done, "t0": t + 0.5, "step": step,
                "phases": {"imports": imports, "restore": rest / 2, "first_step": rest / 2},
                "generation": None if step == 0 else f"step-{step}"})
    for k in range(step, until):
        out.append({**base, "event": "steps", "t": done + (k - step), "first": k, "last": k, "loss": 2.0,
                    "duration_s": 1.0})
    out.append({**base, "event": "ckpt_save", "t": done + (until - step - 1) + 0.1, "step": until,
                "stall_s": 0.1, "total_s": 0.1, "generation": f"step-{until}"})
    return done + (until - step - 1)


def _recovery(out: list[dict], t: float, failed_t: float, mode: str, step: int) -> None:
    out.append({"job_id": "7000", "restart": 0, "host": "node1", "event": "recovery", "t": t, "failed_t": failed_t,
                "cause": "crash", "mode": mode, "nodes": ["node1"], "from_nodes": 1, "to_nodes": 1,
                "resume_step": step})


def warm_ledger() -> list[ev.Event]:
    """One allocation: a cold start (6 s job start -> first step, imports 4 s), a crash 1 s after
    step 9 recovered warm on the same nodes (start-up 2 s, imports 0), a crash in that start
    recovered cold (start-up 5 s). Failure -> first step: warm 1 + 2 = 3 s, cold 1 + 5 = 6 s."""
    out: list[dict] = []
    last = _start(out, 100.0, "torchrun", 6.0, 0, 10, imports=4.0)
    _recovery(out, last + 1.0, last + 0.5, "same_nodes", 10)
    last = _start(out, last + 1.5, "warm", 2.0, 10, 14, imports=0.0)
    _recovery(out, last + 1.0, last + 0.5, "same_nodes", 14)
    _start(out, last + 1.5, "torchrun", 5.0, 14, 20, imports=3.5)
    return ev.decode_all(out)


def test_the_report_labels_each_start_warm_or_cold_and_each_recovery_by_the_start_it_led_to():
    sm = summarize(warm_ledger())
    assert [s.startup for s in sm.starts] == ["cold", "warm", "cold"]
    assert [round(sum(v for _, v in s.phases), 3) for s in sm.starts] == [6.0, 2.0, 5.0]
    assert [s.startup_ratio for s in sm.starts] == [1.0, pytest.approx(2 / 6, abs=1e-3), pytest.approx(5 / 6, abs=1e-3)]
    assert [(r.startup, r.resumed_s) for r in sm.recoveries] == [("warm", 3.0), ("cold", 6.0)]
    d = json.loads(json.dumps(sm.to_dict(), default=str))
    assert [s["startup"] for s in d["starts"]] == ["cold", "warm", "cold"]
    assert [r["startup"] for r in d["recoveries"]] == ["warm", "cold"]


def test_the_text_report_shows_warm_and_cold_start_up_apart(capsys, tmp_path):
    sm = summarize(warm_ledger())
    assert startup_line(sm.starts) == ("start-up (job start -> first step, median): cold 5.5s (2 starts), "
                                       "warm 2.0s (1 start)")
    print_summary(sm, tmp_path)
    out = capsys.readouterr().out
    assert "start-up (job start -> first step, median): cold 5.5s" in out
    assert "crash: same_nodes > warm start 3.0s, crash: same_nodes > cold start 6.0s" in out
    head = next(line for line in out.splitlines() if line.strip().startswith("phase"))
    assert head.split()[1:] == ["0", "cold", "1", "warm", "2", "cold"]


def test_an_all_cold_run_has_no_warm_line_and_every_start_cold():
    cold = [e if not isinstance(e, ev.JobStart) else ev.JobStart(**{**e.__dict__, "mode": "torchrun"})
            for e in warm_ledger()]
    sm = summarize(cold)
    assert {s.startup for s in sm.starts} == {"cold"} and startup_line(sm.starts) is None


def test_the_png_labels_each_startup_band_warm_or_cold():
    import matplotlib.pyplot as plt

    fig = timeline_figure(summarize(warm_ledger()))
    try:
        texts = [t.get_text() for t in fig.axes[0].texts]
    finally:
        plt.close(fig)
    assert [t for t in texts if t.endswith(" start")] == ["cold start", "warm start", "cold start"]


def test_the_real_warm_ledger_reads_cold_warm_cold():
    sm = summarize(ev.read(WARM_RESTART))
    assert [s.startup for s in sm.starts] == ["cold", "warm", "cold"]
    assert [r.startup for r in sm.recoveries] == ["warm", "cold"]
    warm, cold = (r.resumed_s or 0 for r in sm.recoveries)
    assert warm < 0.5 * cold  # the README: 2.1 s warm, 6.6 s cold


def test_from_run_takes_warm_recoveries_for_the_in_allocation_costs_and_cold_restarts_for_the_requeue():
    got = measure(warm_ledger())
    assert got["relaunch_s"].value == 3.0 and got["relaunch_s"].count == 1 and got["relaunch_s"].warm
    assert "warm same-node recoveries" in got["relaunch_s"].how
    assert "job start -> first step, median 2 s" in got["relaunch_s"].how  # the warm start's own start-up
    assert got["restart_s"].value == 5.0 and not got["restart_s"].warm  # the cold restart only, not 2 s
    assert "cold restarts" in got["restart_s"].how


def test_without_warm_recoveries_the_in_allocation_costs_stay_cold():
    cold = [e for e in warm_ledger()]
    cold = [ev.JobStart(**{**e.__dict__, "mode": "torchrun"}) if isinstance(e, ev.JobStart) else e for e in cold]
    got = measure(cold)
    assert got["relaunch_s"].value == 4.5 and not got["relaunch_s"].warm  # median of 3 and 6
    assert got["relaunch_s"].how.startswith("cold same-node recoveries")
    assert got["restart_s"].value == 3.5  # median of 2 and 5: both restarts were cold


def test_the_real_warm_ledgers_give_warm_relaunch_and_swap_and_cold_restart():
    restart, swap = measure(ev.read(WARM_RESTART)), measure(ev.read(WARM_SWAP))
    assert restart["relaunch_s"].warm and restart["relaunch_s"].value < 3
    assert not restart["restart_s"].warm  # its third start, after the crash in the warm one
    assert swap["swap_s"].warm and swap["swap_s"].value < 0.5 * measure(ev.read(SPARESWAP))["swap_s"].value
    assert "restart_s" not in swap  # its only restart was warm


def test_a_warm_measurement_wins_over_a_cold_one_of_an_earlier_run_the_rest_stays_first_come():
    got = from_runs([SPARESWAP, SPARES, WARM_RESTART, WARM_SWAP])
    assert got["swap_s"][1].startswith(f"{WARM_SWAP}: median of 1 warm spare swaps")
    assert got["relaunch_s"][1].startswith(f"{WARM_RESTART}: median of 1 warm same-node recoveries")
    assert got["restart_s"][1].startswith(f"{SPARESWAP}: median of 1 cold restarts")  # the requeue stays cold
    cold_only = from_runs([SPARESWAP, SPARES])
    assert cold_only["swap_s"][1].startswith(SPARESWAP) and "cold spare swaps" in cold_only["swap_s"][1]


def test_a_recovery_ends_when_the_next_starts_first_step_was_done_not_when_its_window_was_logged():
    """The window of the first step is written after `train.step_sleep_s` (0.2 s here): the phase
    table, written right after the step (where a cold start's start-up ends too), dates it. Without
    a phase table the window does, and without either the train_start."""
    out: list[dict] = []
    last = _start(out, 100.0, "torchrun", 6.0, 0, 10, imports=4.0)
    _recovery(out, last + 1.0, last + 0.5, "same_nodes", 10)
    _start(out, last + 1.5, "warm", 2.0, 10, 14, imports=0.0)
    cut = next(i for i, e in enumerate(out) if e["event"] == "recovery")  # the warm start follows it
    for e in out[cut:]:
        if e["event"] == "steps":
            e["t"] += 0.2
    assert [r.resumed_s for r in summarize(ev.decode_all(out)).recoveries] == [3.0]
    no_table = [e for i, e in enumerate(out) if not (e["event"] == "start_phases" and i > cut)]
    assert [r.resumed_s for r in summarize(ev.decode_all(no_table)).recoveries] == [3.2]
    bare = [e for i, e in enumerate(no_table) if not (e["event"] == "steps" and i > cut)]
    assert [r.resumed_s for r in summarize(ev.decode_all(bare)).recoveries] == [2.5]


def test_the_report_says_whether_attempts_start_warm_and_why():
    from dslurm.observe import events as evs
    from dslurm.observe.report import summarize

    sub = evs.Submit(t=1.0, job_ids=[7], warm=False, warm_reason="no warm restart proven on site 'x'")
    assert summarize([sub]).warm == "cold (no warm restart proven on site 'x')"
    assert summarize([evs.Submit(t=1.0, job_ids=[7])]).warm is None  # no spares: nothing to say
