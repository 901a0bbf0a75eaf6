"""`dslurm trackers sync RUN_DIR --to X` (dslurm/trackers/sync.py): a run's ledger replayed into a
tracker after the fact, with the real TensorBoard, MLflow (file store) and W&B (offline) packages.
Every ledger point arrives once, a crashed start's replaced steps are not, a second sync sends
nothing, and the ledger says what was done."""

from __future__ import annotations

import importlib.util
import json

import pytest

from dslurm.cli import main
from dslurm.observe import events as ev
from dslurm.observe.ledger import Ledger
from dslurm.trackers import STATE_FILE

needs = pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("mlflow", "wandb", "tensorboard")),
                           reason="the trackers extra is not installed (pip install -e '.[test]')")
pytestmark = needs


def loss(i: int, start: int = 0) -> float:
    return 10.0 - 0.25 * i - 0.01 * start


def write_run(run, n: int = 20, crash_at: int | None = 12, resume: int = 8) -> dict[int, float]:
    """A ledger with no tracker: a start that crashed after `crash_at` steps and one that resumed
    after `resume` and finished at `n`. Returns step -> the loss the ledger finally has."""
    led = Ledger(run)
    want: dict[int, float] = {}
    led.append(ev.TrainStart(step=0))
    for i in range(crash_at or n):
        led.append(ev.Steps(first=i, last=i, loss=loss(i), lr=1e-3))
        want[i + 1] = loss(i)
    if crash_at is not None:
        led.append(ev.TrainStart(step=resume, generation="step_8"))
        for i in range(resume, n):
            led.append(ev.Steps(first=i, last=i, loss=loss(i, 1), lr=1e-3))
            want[i + 1] = loss(i, 1)
    led.append(ev.Exit(reason="completed", step=n, code=0))
    return want


@pytest.fixture
def run(tmp_path, monkeypatch):
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "home" / var.lower()))
    for var in ("WANDB_MODE", "WANDB_PROJECT", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    d = tmp_path / "run"
    d.mkdir()
    return d


def tb_losses(run) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={SCALARS: 0})
    acc.Reload()
    return {s.step: s.value for s in acc.Scalars("train/loss")}


def test_sync_to_tensorboard_on_a_run_with_no_tracker_writes_every_ledger_loss_point_once(run, capsys):
    want = write_run(run)
    assert main(["trackers", "sync", str(run), "--to", "tensorboard"]) == 0
    got = tb_losses(run)
    assert sorted(got) == list(range(1, 21))
    assert all(abs(got[s] - want[s]) < 1e-6 for s in want)  # the resumed start's values at 9..12
    files = sorted((run / "tensorboard").iterdir())
    assert main(["trackers", "sync", str(run), "--to", "tensorboard"]) == 0  # idempotent
    assert sorted((run / "tensorboard").iterdir()) == files and tb_losses(run) == got
    out = capsys.readouterr().out
    assert "tensorboard: 0 item(s) sent (it held every ledger point already)" in out, out
    syncs = [e for e in ev.read(run) if isinstance(e, ev.TrackerDelivery)]
    assert [(e.by, e.late > 0, e.missing) for e in syncs] == [("sync", True, 0), ("sync", False, 0)]


def test_sync_to_mlflow_sends_what_is_missing_once_and_finishes_the_run(run):
    from mlflow.tracking import MlflowClient

    want = write_run(run)
    assert main(["trackers", "sync", str(run), "--to", "mlflow"]) == 0
    run_id = json.loads((run / STATE_FILE).read_text())["mlflow"]["run_id"]
    client = MlflowClient(tracking_uri=(run / "mlruns").resolve().as_uri())
    hist = client.get_metric_history(run_id, "train/loss")
    assert [m.step for m in hist] == list(range(1, 21))
    assert all(abs(m.value - want[m.step]) < 1e-6 for m in hist)
    assert client.get_run(run_id).info.status == "FINISHED"
    assert main(["trackers", "sync", str(run), "--to", "mlflow"]) == 0
    assert len(client.get_metric_history(run_id, "train/loss")) == 20  # a second sync adds nothing
    notes = sorted(v for k, v in client.get_run(run_id).data.tags.items() if k.startswith("dslurm.event."))
    assert "step 8: start: resumed after step 8 (step_8)" in notes and len(notes) == 3, notes


def test_sync_to_wandb_offline_is_one_run_and_a_second_sync_opens_nothing(run):
    write_run(run, n=6, crash_at=None)
    assert main(["trackers", "sync", str(run), "--to", "wandb"]) == 0
    state = json.loads((run / STATE_FILE).read_text())
    runs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and state["wandb"]["id"] in runs[0].name
    assert state["wandb"]["held"]["last"]["train/loss"] == 6
    data = b"".join(p.read_bytes() for p in runs[0].glob("*.wandb"))
    assert b"train/loss" in data
    assert main(["trackers", "sync", str(run), "--to", "wandb"]) == 0
    assert sorted((run / "wandb").glob("offline-run-*")) == runs


def test_sync_refuses_what_it_cannot_do_with_exit_2(run, tmp_path, capsys):
    assert main(["trackers", "sync", str(tmp_path / "nowhere"), "--to", "tensorboard"]) == 2
    write_run(run, n=3, crash_at=None)
    assert main(["trackers", "sync", str(run)]) == 2  # no job.yaml, no --to: which tracker?
    (run / STATE_FILE).write_text("{torn")
    assert main(["trackers", "sync", str(run), "--to", "tensorboard"]) == 2
    err = capsys.readouterr().err
    assert "no ledger.jsonl" in err and "--to" in err and "cannot be read" in err, err


def test_report_has_a_tracker_line_delivered_late_missing(run, capsys):
    """`dslurm report` sums the starts' and syncs' tracker_delivery events (pure lines, then the CLI)."""
    from dslurm.observe import trackerlines

    t = 1.0e9
    evs = [ev.TrackerFailed(t=t, tracker="mlflow", error="NoAnswer: ...", during="log"),
           ev.TrackerDelivery(t=t + 1, tracker="mlflow", delivered=60, late=0, missing=140, closed=False,
                              outages=1),
           ev.TrackerDelivery(t=t + 2, tracker="mlflow", delivered=20, late=140, missing=0, closed=True)]
    (line,) = trackerlines.lines(evs, "/runs/a")
    assert line == ("tracker mlflow: 80 item(s) delivered, 140 late-delivered (backfilled from the ledger after "
                    "1 outage(s)), 0 still missing"), line
    (line,) = trackerlines.lines(evs[:2], "/runs/a")
    assert "140 still missing" in line and "`dslurm trackers sync /runs/a --to mlflow`" in line, line
    write_run(run, n=5, crash_at=None)
    assert main(["trackers", "sync", str(run), "--to", "tensorboard"]) == 0
    capsys.readouterr()
    main(["report", str(run)])
    out = capsys.readouterr().out
    assert "tracker tensorboard: 0 item(s) delivered, 7 late-delivered (backfilled from the ledger), " \
           "0 still missing" in out, out
