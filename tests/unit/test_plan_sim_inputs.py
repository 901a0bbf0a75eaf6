"""`dslurm plan simulate --from-run`: cost inputs from real ledgers, their sources, and CLI errors."""

import json
from pathlib import Path

import pytest

from dslurm.cli import main
from dslurm.observe import events as ev
from dslurm.plan.run_inputs import from_runs, measure

DATA = Path(__file__).parent / "data"
DEMO, SPARES, TWOTIER = (str(DATA / d) for d in ("demo-6043780", "spares-6043404", "twotier-6043401"))


def test_spare_run_gives_the_recovery_times_the_report_measures():
    got = measure(ev.read(SPARES))
    # failed_t -> the next start's first step: kill -9 recovered on the same nodes, node2 lost -> node3.
    assert got["relaunch_s"].value == pytest.approx(1796124516.565 - 1796124505.755, abs=0.5)
    # The swap's next start wrote its phase table when its first step was done, 48.14 s after the
    # failure; its first window came 0.40 s later, after the job's 0.4 s step sleep.
    assert got["swap_s"].value == pytest.approx(48.14, abs=0.01) and got["swap_s"].count == 1
    assert got["save_s"].count == 5 and got["save_s"].value == pytest.approx(0.4205)
    assert "requeue_s" not in got and "async_stall_s" not in got  # never requeued; every save was sync


def test_two_tier_run_gives_stall_and_durable_lag():
    got = measure(ev.read(TWOTIER))
    # median of the four stalls 0.1006, 0.4405, 0.7372, 1.077
    assert got["local_stall_s"].value == pytest.approx((0.4405 + 0.7372) / 2, abs=1e-3)
    assert got["durable_lag_s"].value == pytest.approx((0.0678 + 0.0339) / 2, abs=1e-3)
    assert "save_s" not in got and got["requeue_s"].count == 2


def test_demo_run_gives_restart_requeue_and_async_stall():
    got = measure(ev.read(DEMO))
    # docs/startup.md's phase table of this run: warm starts 13.99 s and 15.91 s.
    assert got["restart_s"].value == pytest.approx((13.99 + 15.91) / 2, abs=0.02)
    assert 5 < got["requeue_s"].value < 30
    assert got["async_stall_s"].value < got["save_s"].value  # the async saves stalled less than they took


def test_an_older_ledger_without_start_phases_falls_back_to_the_report_overhead():
    got = measure(ev.read(DATA / "demo-6042242"))
    assert "train_start" in got["restart_s"].how and got["restart_s"].count == 2


def test_each_input_comes_from_the_first_run_that_has_it():
    got = from_runs([SPARES, TWOTIER])
    assert SPARES in got["restart_s"][1] and TWOTIER in got["requeue_s"][1] and TWOTIER in got["durable_lag_s"][1]


def _run(capsys, *argv):
    code = main(["plan", "simulate", "--gpus", "16384", "--trials", "40", *argv])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_cli_names_the_source_of_every_input(capsys):
    code, out, _ = _run(capsys, "--from-run", SPARES, "--from-run", TWOTIER, "--save-s", "240", "--json")
    data = json.loads(out)
    src = {k: v["source"] for k, v in data["inputs"].items()}
    assert code == 0 and src["save_s"] == "flag --save-s" and data["inputs"]["save_s"]["value"] == 240
    assert src["swap_s"].startswith(SPARES) and src["local_stall_s"].startswith(TWOTIER)
    assert src["async_stall_s"] == "default"
    assert {(r["mechanism"], r["save"]) for r in data["results"]} == {
        (m, s) for m in ("requeue", "spare", "shrink") for s in ("sync", "async", "two_tier", "partner")}
    assert data["spares"]["used"] == data["spares"]["spares"] > 0
    by = {(r["mechanism"], r["save"]): r for r in data["results"]}
    assert by["requeue", "async"]["requeues_per_run"] == by["requeue", "async"]["failures_per_run"] > 200
    assert by["spare", "async"]["requeues_per_run"] < 1


def test_cli_table_and_chosen_spares(capsys):
    code, out, _ = _run(capsys, "--mechanism", "spare", "--save", "sync", "--spares", "3", "--save-s", "60")
    assert code == 0 and "simulated with 3" in out and "goodput at the best checkpoint interval" in out


@pytest.mark.parametrize("argv, message", [
    (["--from-run", "/nonexistent/run"], "/nonexistent/run/ledger.jsonl: no ledger"),
    (["--mechanism", "requeue", "--node-loss-fraction", "2"], "node_loss_fraction=2.0 must be in [0, 1]"),
    (["--probability", "1"], "probability=1.0 must be between 0 and 1"),
    (["--spares", "-2"], "spares=-2 must be at least 0"),
    (["--swap-s", "-5"], "swap_s=-5.0 must not be negative"),
    (["--gpus-per-node", "5"], "gpus=16384 is not a whole number of nodes"),
])
def test_cli_bad_input_exits_2_without_traceback(capsys, argv, message):
    code, _, err = _run(capsys, *argv)
    assert code == 2 and message in err and "Traceback" not in err


def test_a_run_dir_with_an_empty_ledger_is_refused(capsys, tmp_path):
    (tmp_path / "ledger.jsonl").write_text("")
    code, _, err = _run(capsys, "--from-run", str(tmp_path))
    assert code == 2 and "holds no readable event" in err


def test_an_input_left_to_its_default_says_which_input_it_follows():
    import argparse

    from dslurm.plan import sim_cli
    from dslurm.plan.simulate import SimConfig

    p = argparse.ArgumentParser()
    sim_cli.add_arguments(p)
    values, sources = sim_cli.inputs(p.parse_args(["--gpus", "8", "--save-s", "100"]))
    assert sources["durable_lag_s"] == "default, as --save-s" and sources["swap_s"] == "default, as --restart-s"
    assert sources["save_s"] == "flag --save-s" and sources["requeue_s"] == "default"
    cfg = SimConfig(gpus=8, save="two_tier", **values)
    assert cfg.lag_s == cfg.cost_inputs()["durable_lag_s"] == 100  # the lag follows the save time it names
