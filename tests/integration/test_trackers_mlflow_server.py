"""Trackers that heal, against a real MLflow tracking server (`mlflow server`, sqlite store, on
127.0.0.1, started here: tests/mlflow_server.py), frozen with SIGSTOP mid-run and thawed with
SIGCONT (issue 53). The ledger is fed as the trainer feeds it.

- frozen mid-run: the appends never wait, the lane is a tracker_failed, and once the server
  answers again it catches up from the ledger: the server holds every step the ledger has,
  once each, with the ledger's values, in a FINISHED run;
- frozen at the start's end: the close leaves at once (an exit never waits on a tracker); a
  resumed start sends what the first could not, logs only the steps after the ones the server
  holds, and `dslurm trackers sync` then adds nothing.
"""

from __future__ import annotations

import importlib.util
import time

import pytest

from dslurm.cli import main
from dslurm.config import MetricsSpec
from dslurm.observe import events as ev
from dslurm.observe.ledger import Ledger
from dslurm.trackers import attach, lane, read_state
from mlflow_server import Server, mlflow_server
from testkit import wait_for

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(importlib.util.find_spec("mlflow.server") is None,
                                 reason="the mlflow server is not installed (pip install -e '.[test]')")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow-server")) as srv:
        yield srv


@pytest.fixture(autouse=True)
def quick_backoff(monkeypatch):
    monkeypatch.setattr(lane, "BACKOFF_S", 0.3)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def loss(i: int, start: int = 0) -> float:
    return 10.0 - 0.1 * i + 0.5 * start


def steps(led: Ledger, lo: int, hi: int, start: int = 0, pause_s: float = 0.02) -> float:
    """Windows lo..hi-1 appended as the trainer does; returns the slowest append (s)."""
    worst = 0.0
    for i in range(lo, hi):
        t0 = time.monotonic()
        led.append(ev.Steps(first=i, last=i, loss=loss(i, start), lr=1e-3, tokens_per_s=1000.0))
        worst = max(worst, time.monotonic() - t0)
        time.sleep(pause_s)
    return worst


def history(server: Server, run_dir) -> tuple[dict[int, list[float]], str]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=server.url)
    run_id = read_state(run_dir)["mlflow"]["run_id"]
    got: dict[int, list[float]] = {}
    for m in client.get_metric_history(run_id, "train/loss"):
        got.setdefault(m.step, []).append(m.value)
    return got, client.get_run(run_id).info.status


def up_with(lane_, n: int) -> bool:
    """The lane is up and has sent `n` items (a loaded machine's server may answer its first calls late)."""
    return lane_.opened.is_set() and not lane_.in_outage and lane_.delivered + lane_.backfilled >= n


def of(run_dir, cls):
    return [e for e in ev.read(run_dir) if isinstance(e, cls)]


def test_frozen_mid_run_the_server_ends_with_every_ledger_step_once_in_a_finished_run(server, tmp_path):
    run = tmp_path / "run"
    spec = MetricsSpec(trackers=["mlflow"], mlflow_uri=server.url, tracker_timeout_s=2.0, tracker_close_s=10.0)
    led = Ledger(run)
    trk = attach(led, run, spec, "heal-mid-run")
    assert trk is not None
    led.append(ev.TrainStart(step=0))
    worst = steps(led, 0, 10)
    wait_for(lambda: up_with(trk.lanes["mlflow"], 11), 120, "the first steps delivered", poll=0.05)
    server.freeze()
    try:
        worst = max(worst, steps(led, 10, 40, pause_s=0.05))  # ~1.5 s of training against a frozen server
        wait_for(lambda: [f for f in of(run, ev.TrackerFailed) if f.during == "log"], 30, "the lane's tracker_failed",
                 poll=0.1)
        worst = max(worst, steps(led, 40, 50, pause_s=0.05))
    finally:
        server.thaw()
    worst = max(worst, steps(led, 50, 60))
    wait_for(lambda: not trk.lanes["mlflow"].in_outage and of(run, ev.TrackerHealed), 60, "the lane healed", poll=0.1)
    led.append(ev.Exit(reason="completed", step=60, code=0))
    assert worst < 0.25, worst  # the ledger's fsync, never the tracker
    got, status = history(server, run)
    assert sorted(got) == list(range(1, 61)), sorted(got)
    assert all(v == [pytest.approx(loss(s - 1))] for s, v in got.items()), got  # once each, the ledger's value
    assert status == "FINISHED"
    failed = [f for f in of(run, ev.TrackerFailed) if f.during == "log"]
    assert failed and "no answer within 2 s" in failed[0].error, failed
    healed = of(run, ev.TrackerHealed)[-1]
    assert healed.late >= 20 and healed.down_s > 0.5, healed
    (d,) = of(run, ev.TrackerDelivery)
    assert d.missing == 0 and d.closed and d.outages >= 1 and d.late >= 20, d


def test_frozen_at_the_end_the_exit_leaves_at_once_and_the_next_start_and_sync_complete_it(server, tmp_path):
    run = tmp_path / "run"
    spec = MetricsSpec(trackers=["mlflow"], mlflow_uri=server.url, tracker_timeout_s=2.0, tracker_close_s=10.0)
    led = Ledger(run)
    trk = attach(led, run, spec, "heal-next-start")
    assert trk is not None
    led.append(ev.TrainStart(step=0))
    steps(led, 0, 10)
    wait_for(lambda: up_with(trk.lanes["mlflow"], 11), 120, "the first steps delivered", poll=0.05)
    server.freeze()
    try:
        steps(led, 10, 20)
        led.append(ev.CkptSave(step=20, generation="step_20"))
        t0 = time.monotonic()
        led.append(ev.Exit(reason="requeue", step=20, code=75))
        closed_s = time.monotonic() - t0
    finally:
        server.thaw()
    assert closed_s < 1.0, closed_s  # the checkpoint is committed: the exit waits on no tracker
    (d,) = of(run, ev.TrackerDelivery)
    assert d.missing >= 10 and not d.closed, d
    assert read_state(run)["mlflow"]["closed"] is False

    # the next start resumes after step 8 (its checkpoint) and trains 9.. again, with other values:
    # the server holds 1..10 (it cannot delete points), the ledger's 11..20 never reached it
    led2 = Ledger(run)
    spec2 = MetricsSpec(trackers=["mlflow"], mlflow_uri=server.url, tracker_timeout_s=2.0, tracker_close_s=60.0)
    trk2 = attach(led2, run, spec2, "heal-next-start")  # a loaded machine's server may take a while to catch up
    assert trk2 is not None
    led2.append(ev.TrainStart(step=8, generation="step_8"))
    steps(led2, 8, 25, start=1)
    led2.append(ev.Exit(reason="completed", step=25, code=0))
    got, status = history(server, run)
    assert sorted(got) == list(range(1, 26)), sorted(got)
    # replayed steps are not logged twice
    assert all(len(v) == 1 for v in got.values()), {s: v for s, v in got.items() if len(v) > 1}
    # what the chart shows: 1..10 as the first start logged them, 12..25 as the second trained them;
    # 11 was in flight when the server froze, and it lands when it thaws (the process has no say)
    assert all(got[s] == [pytest.approx(loss(s - 1))] for s in range(1, 11)), got
    assert got[11][0] in (pytest.approx(loss(10)), pytest.approx(loss(10, 1))), got
    assert all(got[s] == [pytest.approx(loss(s - 1, 1))] for s in range(12, 26)), got
    assert status == "FINISHED"
    d2 = of(run, ev.TrackerDelivery)[-1]
    assert d2.missing == 0 and d2.closed, d2

    assert main(["trackers", "sync", str(run), "--to", "mlflow"]) == 0  # nothing left to send
    again, _ = history(server, run)
    assert again == got
    assert of(run, ev.TrackerDelivery)[-1].late == 0
