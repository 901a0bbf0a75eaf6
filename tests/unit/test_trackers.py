"""Experiment trackers (dslurm/trackers/) fed from the ledger, with the real packages, offline.

The scenario: start 0 trains steps 0-9 and crashes (no exit event, nothing closed cleanly);
start 1 resumes after step 6 and trains steps 6-12 with other numbers, then completes. Read
back with each package's own reader: one tracker run, each step once, the replayed steps with
start 1's values, the starts and the ending annotated; a failing tracker is reported once and
the others go on; no credential from the environment lands in the run directory.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from dslurm.config import MetricsSpec
from dslurm.config.schema import build
from dslurm.observe import events as ev
from dslurm.observe.ledger import Ledger
from dslurm.trackers import STATE_FILE, Trackers, attach, read_state
from dslurm.trackers.feed import feed, purge_from

SECRETS = {"WANDB_API_KEY": "wbkey0123456789abcdefSECRET", "MLFLOW_TRACKING_TOKEN": "mltokSECRET9876543210"}
ALL = ["tensorboard", "wandb", "mlflow"]


def _have(*mods: str) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in mods)


needs_all = pytest.mark.skipif(not _have("tensorboard", "wandb", "mlflow"),
                               reason="the trackers extra is not installed (pip install -e '.[test]')")


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """W&B offline and quiet, its caches in tmp; MLflow from the run dir's file store; secrets set."""
    home = tmp_path / "home"
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(home / var.lower()))
    for var in ("WANDB_MODE", "WANDB_PROJECT", "MLFLOW_TRACKING_URI", "MLFLOW_ALLOW_FILE_STORE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    run = tmp_path / "run"
    run.mkdir()
    return run


def loss0(i: int) -> float:
    return 10.0 - 0.5 * i


def loss1(i: int) -> float:
    return 100.0 + i  # the second start's numbers: any zigzag would show


def _steps(i: int, loss: float) -> ev.Steps:
    return ev.Steps(first=i, last=i, loss=loss, grad_norm=1.0 + i, lr=1e-3, tokens_per_s=5000.0 + i, mfu=0.4)


def two_starts(run: Path, names: list[str]) -> tuple[Trackers, Trackers]:
    spec = MetricsSpec(trackers=names)  # type: ignore[arg-type]
    led0 = Ledger(run)
    t0 = attach(led0, run, spec, "tiny")
    assert t0 is not None
    led0.append(ev.TrainStart(step=0))
    for i in range(10):
        led0.append(_steps(i, loss0(i)))
        if i == 4:
            led0.append(ev.CkptSave(step=5, generation="g5", stall_s=0.25, total_s=0.5))
    t0.close()  # the crash: no exit event; the trackers' files are whatever was flushed
    led1 = Ledger(run)
    t1 = attach(led1, run, spec, "tiny")
    assert t1 is not None
    led1.append(ev.TrainStart(step=6, generation="g6"))
    for i in range(6, 13):
        led1.append(_steps(i, loss1(i)))
        if i == 9:
            led1.append(ev.Eval(step=10, loss=3.5, ppl=math.exp(3.5)))
    led1.append(ev.Exit(reason="completed", step=13, code=0))
    return t0, t1


def expected_loss() -> dict[int, float]:
    """tracker step (completed steps) -> loss: start 0 up to step 6, start 1 after."""
    return {i + 1: (loss0(i) if i < 6 else loss1(i)) for i in range(13)}


# ------------------------------------------------------------------ pure parts


def test_the_feed_maps_ledger_numbers_to_completed_steps():
    f = feed(ev.Steps(first=4, last=7, loss=2.0, grad_norm=math.nan, lr=1e-3, values={"acc": 0.5}))
    assert f is not None and f.step == 8 and f.opens
    assert f.values == {"train/loss": 2.0, "train/lr": 1e-3, "train/acc": 0.5}  # NaN is left out
    assert feed(ev.Eval(step=10, loss=3.0)).values == {"eval/loss": 3.0}  # type: ignore[union-attr]
    end = feed(ev.Exit(reason="requeue", step=13, code=75))
    assert end is not None and end.closes and end.note is not None and "requeue" in end.note
    assert feed(ev.Submit()) is None
    assert purge_from(6) == 7  # resumed after 6 completed steps: the points from 7 on are replaced


def test_metrics_section_is_validated():
    spec = build(MetricsSpec, {"trackers": ["tensorboard", "mlflow"], "wandb_mode": "online"}, "job.yaml")
    assert spec.trackers == ["tensorboard", "mlflow"] and spec.wandb_mode == "online"
    for bad, word in (({"trackers": ["tb"]}, "tensorboard"), ({"trackers": ["wandb", "wandb"]}, "twice"),
                      ({"wandb_mode": "cloud"}, "offline")):
        with pytest.raises(Exception, match=word):
            build(MetricsSpec, bad, "job.yaml")


def test_no_trackers_configured_attaches_nothing(tmp_path):
    assert attach(Ledger(tmp_path), tmp_path, MetricsSpec(), "tiny") is None
    assert attach(None, tmp_path, MetricsSpec(trackers=["tensorboard"]), "tiny") is None


# ------------------------------------------------------------------ the real backends


@pytest.mark.skipif(not _have("tensorboard"), reason="tensorboard not installed")
def test_tensorboard_one_curve_across_a_crash_and_resume(offline):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    two_starts(offline, ["tensorboard"])
    acc = EventAccumulator(str(offline / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0},
                           purge_orphaned_data=True)
    acc.Reload()
    loss = {s.step: s.value for s in acc.Scalars("train/loss")}
    assert [s.step for s in acc.Scalars("train/loss")] == list(range(1, 14))  # each step once, in order
    assert loss == pytest.approx(expected_loss())
    assert {s.step: s.value for s in acc.Scalars("eval/loss")} == {10: 3.5}
    assert {s.step: s.value for s in acc.Scalars("ckpt/stall_s")} == {5: 0.25}
    assert {s.step: s.value for s in acc.Scalars("run/restarts")} == {6: 1.0}
    notes = [(t.step, t.tensor_proto.string_val[0].decode()) for t in acc.Tensors("dslurm/events")]
    assert notes == [(0, "start: fresh start"), (6, "start: resumed after step 6 (g6)"),
                     (13, "exit: completed at step 13 (code 0)")]
    assert len(list((offline / "tensorboard").iterdir())) == 2  # one event file per start
    assert read_state(offline)["starts"] == 2


@pytest.mark.skipif(not _have("mlflow"), reason="mlflow not installed")
def test_mlflow_one_run_across_a_crash_and_resume(offline):
    from mlflow.tracking import MlflowClient

    two_starts(offline, ["mlflow"])
    run_id = read_state(offline)["mlflow"]["run_id"]
    client = MlflowClient(tracking_uri=(offline / "mlruns").as_uri())
    exp = client.get_experiment_by_name("tiny")
    runs = client.search_runs([exp.experiment_id])
    assert [r.info.run_id for r in runs] == [run_id]  # one run, the id kept in trackers.json
    hist = client.get_metric_history(run_id, "train/loss")
    assert sorted(m.step for m in hist) == list(range(1, 14))  # the replayed steps were purged
    assert {m.step: m.value for m in hist} == pytest.approx(expected_loss())
    run = runs[0]
    assert run.info.status == "FINISHED"
    notes = sorted(v for k, v in run.data.tags.items() if k.startswith("dslurm.event."))
    assert notes == ["step 0: start: fresh start", "step 13: exit: completed at step 13 (code 0)",
                     "step 6: start: resumed after step 6 (g6)"]
    assert run.data.metrics["eval/loss"] == 3.5


@pytest.mark.skipif(not _have("wandb"), reason="wandb not installed")
def test_wandb_offline_reuses_the_run_id(offline):
    two_starts(offline, ["wandb"])
    run_id = read_state(offline)["wandb"]["id"]
    runs = sorted((offline / "wandb").glob("offline-run-*"))
    # both starts, one run id (wandb adds "-1" to the second directory's name within one second)
    assert len(runs) == 2 and all(f"-{run_id}" in r.name for r in runs)
    for r in runs:
        data = b"".join(p.read_bytes() for p in r.glob("*.wandb"))
        assert b"train/loss" in data and run_id.encode() in data


@pytest.mark.skipif(not _have("wandb"), reason="wandb not installed")
def test_a_hung_wandb_close_is_bounded_and_reported_once(offline, monkeypatch):
    import threading
    import time

    import wandb

    release, real = threading.Event(), wandb.teardown

    def hung_teardown(*a, **kw):
        release.wait(60)  # a W&B service that does not answer
        real(*a, **kw)

    monkeypatch.setattr(wandb, "teardown", hung_teardown)
    led = Ledger(offline)
    t = attach(led, offline, MetricsSpec(trackers=["wandb"], tracker_close_s=0.5), "tiny")  # type: ignore[list-item]
    assert t is not None
    led.append(ev.TrainStart(step=0))
    led.append(_steps(0, 1.0))
    assert t.lanes["wandb"].opened.wait(60)  # W&B's service is up and has the points: what hangs is its close
    deadline = time.monotonic() + 60
    while t.lanes["wandb"].delivered < 2 and time.monotonic() < deadline:  # the start note and step 1
        time.sleep(0.05)
    t0 = time.monotonic()
    try:
        led.append(ev.Exit(reason="completed", step=1, code=0))
        waited = time.monotonic() - t0
    finally:
        release.set()  # let the real teardown end W&B's service before the next test
        for th in threading.enumerate():
            if th.name == "dslurm-tracker-wandb":
                th.join(30)
    assert waited < 3  # tracker_close_s, not W&B's 60 s
    failed = [e for e in ev.read(offline) if isinstance(e, ev.TrackerFailed)]
    assert [(e.tracker, e.during) for e in failed] == [("wandb", "close")]
    # Two interleavings, one fact: the close's bound ran out while W&B's call was waited for ("no answer
    # within 0.5 s ... left unfinished"), or the start's end found the call already waiting and left it
    # at once ("left at the start's end after 0.5 s ... stays in the ledger"; a loaded machine).
    err = failed[0].error
    assert "0.5 s" in err and ("left unfinished" in err or "stays in the ledger" in err), err
    assert read_state(offline)["wandb"]["closed"] is False  # the next start or a sync finishes it


@needs_all
def test_all_three_together_and_no_credentials_in_the_run_dir(offline):
    two_starts(offline, ALL)
    state = json.loads((offline / STATE_FILE).read_text())
    assert set(state) == {"starts", *ALL} and state["starts"] == 2
    assert [e.NAME for e in ev.read(offline) if isinstance(e, ev.TrackerFailed)] == []
    leaked = [str(p.relative_to(offline)) for p in offline.rglob("*") if p.is_file()
              for v in SECRETS.values() if v.encode() in p.read_bytes()]
    assert leaked == []


# ------------------------------------------------------------------ failures


@pytest.mark.skipif(not _have("tensorboard", "mlflow"), reason="tensorboard/mlflow not installed")
def test_a_missing_package_is_reported_once_and_the_others_go_on(offline, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "wandb", None)  # import wandb -> ImportError
    t0, t1 = two_starts(offline, ALL)
    failed = [e for e in ev.read(offline) if isinstance(e, ev.TrackerFailed)]
    assert [(e.tracker, e.during) for e in failed] == [("wandb", "open"), ("wandb", "open")]  # once per start
    assert "dslurm[trackers]" in failed[0].error
    assert "wandb" not in read_state(offline) or "id" not in read_state(offline)["wandb"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(offline / "tensorboard"), purge_orphaned_data=True)
    acc.Reload()
    assert len(acc.Scalars("train/loss")) == 13


@pytest.mark.skipif(not _have("tensorboard", "mlflow"), reason="tensorboard/mlflow not installed")
def test_a_tracker_whose_write_raises_is_reported_once_retries_and_catches_up(offline, monkeypatch):
    """A full disk under MLflow's file store: one tracker_failed, training goes on, the lane retries
    with backoff; once the disk has room it catches up from the ledger, in order, and the start
    ends with nothing missing and the run FINISHED."""
    import threading
    import time

    from dslurm.trackers import lane, to_mlflow

    monkeypatch.setattr(lane, "BACKOFF_S", 0.2)
    calls, full = [], threading.Event()
    real, real_many = to_mlflow.MlflowTracker.log, to_mlflow.MlflowTracker.log_many
    full.set()

    def full_disk(self, step, values, t=0.0):
        calls.append(step)
        if full.is_set():
            raise OSError(28, "No space left on device")
        return real(self, step, values, t)

    def full_disk_many(self, items):  # a catch-up's batch
        calls.append(items[0].step)
        if full.is_set():
            raise OSError(28, "No space left on device")
        return real_many(self, items)

    monkeypatch.setattr(to_mlflow.MlflowTracker, "log", full_disk)
    monkeypatch.setattr(to_mlflow.MlflowTracker, "log_many", full_disk_many)
    spec = MetricsSpec(trackers=["tensorboard", "mlflow"])
    led = Ledger(offline)
    trk = attach(led, offline, spec, "tiny")
    assert trk is not None
    led.append(ev.TrainStart(step=0))
    for i in range(5):
        led.append(_steps(i, loss0(i)))  # the ledger write and the step go on
    deadline = time.monotonic() + 60
    while len(calls) < 2 and time.monotonic() < deadline:  # it failed, and retried (and failed) again
        time.sleep(0.05)
    full.clear()  # room again
    while not [e for e in ev.read(offline) if isinstance(e, ev.TrackerHealed)] and time.monotonic() < deadline:
        time.sleep(0.05)
    for i in range(5, 8):
        led.append(_steps(i, loss0(i)))
    led.append(ev.Exit(reason="completed", step=8, code=0))
    evs = ev.read(offline)
    failed = [e for e in evs if isinstance(e, ev.TrackerFailed)]
    # once for the outage (during its opening catch-up or a log, as the lane's race with the feed falls)
    assert [e.tracker for e in failed] == ["mlflow"] and failed[0].during in ("log", "catch-up"), failed
    assert "No space" in failed[0].error
    (healed,) = [e for e in evs if isinstance(e, ev.TrackerHealed)]
    assert healed.tracker == "mlflow" and healed.late >= 5, healed
    deliveries = {e.tracker: e for e in evs if isinstance(e, ev.TrackerDelivery)}
    d = deliveries["mlflow"]
    assert d.missing == 0 and d.closed and d.outages == 1 and d.late + d.delivered >= 9, d
    assert deliveries["tensorboard"].missing == 0 and deliveries["tensorboard"].late == 0
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(offline / "mlruns").resolve().as_uri())
    run_id = read_state(offline)["mlflow"]["run_id"]
    history = client.get_metric_history(run_id, "train/loss")
    assert [m.step for m in history] == list(range(1, 9))  # every point, once, in order
    assert [m.value for m in history] == [loss0(i) for i in range(8)]
    assert client.get_run(run_id).info.status == "FINISHED"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(offline / "tensorboard"), purge_orphaned_data=True)
    acc.Reload()
    assert [s.step for s in acc.Scalars("train/loss")] == list(range(1, 9))


@pytest.mark.skipif(not _have("tensorboard"), reason="tensorboard not installed")
def test_own_scripts_feed_the_trackers_through_log_metrics(offline):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dslurm.runtime import Runtime

    rt = Runtime(run_dir=offline, site=None, job=None, t_start=0.0)
    rt.ledger = Ledger(offline)
    trk = attach(rt.ledger, offline, MetricsSpec(trackers=["tensorboard"]), "mine")
    assert trk is not None
    rt.started(0)
    for step in range(3):
        rt.log_metrics(step, loss=1.0 / (step + 1), acc=0.25 * step)
    trk.close()  # the points are written off the caller's thread (dslurm/trackers/lane.py)
    acc = EventAccumulator(str(offline / "tensorboard"), purge_orphaned_data=True)
    acc.Reload()
    assert {s.step: s.value for s in acc.Scalars("train/loss")} == pytest.approx({1: 1.0, 2: 0.5, 3: 1 / 3})
    assert [s.value for s in acc.Scalars("train/acc")] == [0.0, 0.25, 0.5]
