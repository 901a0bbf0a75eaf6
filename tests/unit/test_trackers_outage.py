"""Trackers off the training path (dslurm/trackers/lane.py), with the real MLflow and W&B clients
(W&B online) against servers on 127.0.0.1 that the test starts (tests/outage_servers.py): one that
accepts and never answers, one that answers slowly. The ledger is fed as the trainer feeds it; every
append must return at once, the silent tracker is a `tracker_failed` naming what it waited for, and
the start's close is bounded. Also: an unreadable trackers.json is refused by name (issue 38).
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest

from dslurm.config import MetricsSpec
from dslurm.observe import events as ev
from dslurm.observe.ledger import Ledger
from dslurm.trackers import STATE_FILE, attach
from outage_servers import logged_steps, silent_server, slow_mlflow_server

needs = pytest.mark.skipif(not all(importlib.util.find_spec(m) for m in ("mlflow", "wandb", "tensorboard")),
                           reason="the trackers extra is not installed (pip install -e '.[test]')")
pytestmark = needs


@pytest.fixture(scope="module", autouse=True)
def imported():
    """The packages imported once: an import alone takes seconds on this loaded machine, inside the
    open's bound, and the tests' short bounds are meant for the servers."""
    import mlflow.tracking  # noqa: F401
    import tensorboard.summary.writer.event_file_writer  # noqa: F401
    import wandb  # noqa: F401


@pytest.fixture
def run(tmp_path, monkeypatch):
    home = tmp_path / "home"
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(home / var.lower()))
    for var in ("WANDB_MODE", "WANDB_PROJECT", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)  # online mode needs a key; the server never checks it
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "7")  # MLflow's own default: retries for minutes
    d = tmp_path / "run"
    d.mkdir()
    return d


def _steps(i: int) -> ev.Steps:
    return ev.Steps(first=i, last=i, loss=10.0 - 0.1 * i, grad_norm=1.0, lr=1e-3, tokens_per_s=5000.0, mfu=0.4)


def feed_start(led: Ledger, n: int = 12) -> float:
    """A start's events as the trainer appends them; returns the slowest append (s)."""
    worst = 0.0
    for e in [ev.TrainStart(step=0), *(_steps(i) for i in range(n))]:
        t0 = time.monotonic()
        led.append(e)
        worst = max(worst, time.monotonic() - t0)
    return worst


def failed(run: Path) -> list[ev.TrackerFailed]:
    return [e for e in ev.read(run) if isinstance(e, ev.TrackerFailed)]


def test_a_silent_server_never_holds_a_step_and_is_named_within_the_bound(run, monkeypatch):
    """MLflow and W&B (online) against a server that accepts and never answers; TensorBoard beside
    them works. Appends return at once; both are tracker_failed naming the server and the call."""
    with silent_server() as url:
        spec = MetricsSpec(trackers=["tensorboard", "mlflow", "wandb"], mlflow_uri=url, wandb_mode="online",
                           tracker_timeout_s=3.0, tracker_close_s=2.0)
        monkeypatch.setenv("WANDB_BASE_URL", url)
        led = Ledger(run)
        assert attach(led, run, spec, "tiny") is not None
        worst = feed_start(led)
        deadline = time.monotonic() + 20  # past the open bound (3 s): both failures are on record before the end
        while len(failed(run)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        mid = {e.tracker: e for e in failed(run)}
        t0 = time.monotonic()
        led.append(ev.Exit(reason="completed", step=12, code=0))
        closed_s = time.monotonic() - t0
    assert worst < 0.25, worst  # the ledger's fsync, never a tracker's wait
    assert closed_s < 1.0, closed_s  # an exit never waits on a tracker that is down
    assert set(mid) == {"mlflow", "wandb"}, mid
    port = url.rsplit(":", 1)[1]
    for name in ("mlflow", "wandb"):
        e = mid[name]
        assert e.during == "open" and port in e.error and "no answer within 3 s" in e.error, e
    assert "create_run" in mid["mlflow"].error or "get_experiment_by_name" in mid["mlflow"].error
    assert "wandb.init" in mid["wandb"].error
    account = {e.tracker: e for e in ev.read(run) if isinstance(e, ev.TrackerDelivery)}
    assert account["mlflow"].missing >= 13 and not account["mlflow"].closed, account  # 12 steps + a note
    assert account["wandb"].missing >= 13 and not account["wandb"].closed, account
    assert account["tensorboard"].missing == 0 and account["tensorboard"].closed, account
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run / "tensorboard"))
    acc.Reload()
    assert [s.step for s in acc.Scalars("train/loss")] == list(range(1, 13))  # the healthy one got everything
    assert sorted(e.tracker for e in failed(run)) == ["mlflow", "wandb"]  # once each


def test_a_slow_mlflow_server_gets_every_point_and_the_step_never_waits(run):
    """0.15 s per request (12 steps of points, a few calls to open and close): the appends still
    return at once, the close sends what was queued, no failure."""
    with slow_mlflow_server(0.15) as srv:
        spec = MetricsSpec(trackers=["mlflow"], mlflow_uri=srv.url, tracker_timeout_s=5.0, tracker_close_s=10.0)
        led = Ledger(run)
        trk = attach(led, run, spec, "tiny")
        assert trk is not None
        worst = feed_start(led)
        assert trk.lanes["mlflow"].opened.wait(20)  # a run lasts longer than a slow open
        t0 = time.monotonic()
        led.append(ev.Exit(reason="completed", step=12, code=0))
        closed_s = time.monotonic() - t0
    assert worst < 0.25, worst
    assert failed(run) == [] and closed_s < 10.0
    assert logged_steps(srv.calls) == list(range(1, 13))
    assert srv.run_ids and (run / STATE_FILE).exists()
    updates = [b for p, b in srv.calls if p.endswith("/runs/update")]
    assert updates and updates[-1]["status"] == "FINISHED"


def test_a_server_slower_than_the_bound_fails_the_lane_which_heals_and_sends_every_step_once(run, monkeypatch):
    """Under load (5 s a request, bound 1 s) the lane is a tracker_failed during log and training
    goes on; once the server answers again the lane catches up from the ledger: every step reaches
    the server once, in order, and the run ends FINISHED."""
    from dslurm.trackers import lane

    monkeypatch.setattr(lane, "BACKOFF_S", 0.2)
    with slow_mlflow_server(0.0) as srv:
        spec = MetricsSpec(trackers=["mlflow"], mlflow_uri=srv.url, tracker_timeout_s=1.0, tracker_close_s=10.0)
        led = Ledger(run)
        attach(led, run, spec, "tiny")
        led.append(ev.TrainStart(step=0))
        led.append(_steps(0))
        deadline = time.monotonic() + 10
        while not logged_steps(srv.calls) and time.monotonic() < deadline:
            time.sleep(0.05)
        srv.delay_s = 5.0  # now under load: each request answers after 5 s
        worst = max(0.0, *(_timed(led.append, _steps(i)) for i in range(1, 6)))
        deadline = time.monotonic() + 20
        while not failed(run) and time.monotonic() < deadline:
            time.sleep(0.05)
        srv.delay_s = 0.0  # the load is gone (the request it holds still answers after its 5 s)
        worst = max(worst, *(_timed(led.append, _steps(i)) for i in range(6, 12)))
        while not [e for e in ev.read(run) if isinstance(e, ev.TrackerHealed)] and time.monotonic() < deadline:
            time.sleep(0.05)
        led.append(ev.Exit(reason="completed", step=12, code=0))
    assert worst < 0.25, worst
    (e,) = failed(run)
    assert e.tracker == "mlflow" and e.during == "log" and "no answer within 1 s" in e.error, e
    (h,) = [x for x in ev.read(run) if isinstance(x, ev.TrackerHealed)]
    assert h.tracker == "mlflow" and h.late >= 1 and h.down_s > 0, h
    steps = logged_steps(srv.calls)
    assert steps == list(range(1, 13)), steps  # each once
    (d,) = [x for x in ev.read(run) if isinstance(x, ev.TrackerDelivery)]
    assert d.missing == 0 and d.closed and d.outages == 1 and d.late >= 1, d
    updates = [b for p, b in srv.calls if p.endswith("/runs/update")]
    assert updates and updates[-1]["status"] == "FINISHED"


def _timed(fn, *a) -> float:
    t0 = time.monotonic()
    fn(*a)
    return time.monotonic() - t0


def test_a_full_queue_never_blocks_and_what_it_missed_comes_from_the_ledger(run, monkeypatch):
    from dslurm.trackers import lane

    monkeypatch.setattr(lane, "QUEUE_MAX", 3)
    with slow_mlflow_server(0.1) as srv:
        spec = MetricsSpec(trackers=["mlflow"], mlflow_uri=srv.url, tracker_timeout_s=5.0, tracker_close_s=30.0)
        led = Ledger(run)
        trk = attach(led, run, spec, "tiny")
        assert trk is not None
        led.append(ev.TrainStart(step=0))
        assert trk.lanes["mlflow"].opened.wait(20)
        worst = max(_timed(led.append, _steps(i)) for i in range(20))
        missed = trk.lanes["mlflow"].missed_full
        led.append(ev.Exit(reason="completed", step=20, code=0))
    assert worst < 0.25
    assert missed >= 5, missed  # the queue was full: those points were not queued
    assert logged_steps(srv.calls) == list(range(1, 21))  # the lane caught up from the ledger, each once
    (d,) = [x for x in ev.read(run) if isinstance(x, ev.TrackerDelivery)]
    assert d.missing == 0 and d.late >= 1 and d.closed and d.outages == 0, d


def test_an_unreadable_trackers_json_is_refused_by_name_and_kept(run):
    """Issue 38: a corrupt trackers.json used to read as {} and open second tracker runs silently."""
    (run / STATE_FILE).write_text('{"starts": 2, "mlflow": {"run_id": "abc"')  # torn by hand
    before = (run / STATE_FILE).read_bytes()
    led = Ledger(run)
    attach(led, run, MetricsSpec(trackers=["tensorboard", "mlflow"]), "tiny")
    feed_start(led, 3)
    led.append(ev.Exit(reason="completed", step=3, code=0))
    fails = failed(run)
    assert sorted(e.tracker for e in fails) == ["mlflow", "tensorboard"]
    for e in fails:
        assert e.during == "open" and str(run / STATE_FILE) in e.error, e
        assert "cannot be read" in e.error and "Fix:" in e.error, e.error
    assert (run / STATE_FILE).read_bytes() == before  # left for the user to restore
    assert not (run / "tensorboard").exists() and not (run / "mlruns").exists()  # no new tracker runs
