"""`dslurm watch` (the view's text from a ledger) and `dslurm ctl` (the request file protocol)."""

from __future__ import annotations

import json

import pytest

from dslurm.cli import main
from dslurm.errors import UserError
from dslurm.observe import ctl
from dslurm.observe import events as ev
from dslurm.observe.ledger import Ledger
from dslurm.observe.watch import eta_s, view

NOW = 1_000_000.0


def _ev(cls, t, **kw):
    return cls(t=t, **kw)


def test_the_view_says_step_loss_pace_eta_and_last_save():
    events = [_ev(ev.TrainStart, NOW - 100, step=0),
              _ev(ev.CkptSave, NOW - 30, step=50, stall_s=0.5),
              _ev(ev.Steps, NOW - 5, first=90, last=99, loss=2.3456, tokens_per_s=12345.0, mfu=0.41, step_time_s=0.5),
              _ev(ev.Eval, NOW - 4, step=100, loss=2.5),
              _ev(ev.TrackerFailed, NOW - 3, tracker="wandb", error="ImportError"),
              _ev(ev.TrackerFailed, NOW - 2, tracker="wandb", error="ImportError")]
    lines = view(events, target=1000, state="running: start 1", now=NOW)
    assert lines == [
        "state     running: start 1",
        "step      100 of 1000 (10.0%)",
        "loss      2.3456   tokens/s 12,345   mfu 41.0%   (5s ago)",
        "eta       7m30s   (0.500 s/step)",
        "eval      loss 2.5000 at step 100",
        "last save step 50 (30s ago, stall 0.50s)",
        "trackers  failed: wandb (see `dslurm doctor`; training goes on)",
    ]


def test_the_view_of_a_resumed_run_before_its_first_window_and_an_operator_stop():
    events = [_ev(ev.TrainStart, NOW - 900, step=0), _ev(ev.TrainStart, NOW - 10, step=60),
              _ev(ev.OperatorRequest, NOW - 1, action="stop", user="ana", step=61)]
    lines = view(events, target=None, state="running", now=NOW)
    assert "step      60" in lines and "last save none yet" in lines
    assert "starts    2 (1 restart(s))" in lines and "operator  stop by ana at step 61 (1s ago)" in lines
    ended = view([*events, _ev(ev.Steps, NOW - 1, first=60, last=60, step_time_s=1.0),
                  _ev(ev.Exit, NOW, reason="terminated", step=61, code=143)], target=100, state="running", now=NOW)
    assert "exited    terminated at step 61 (code 143, 0s ago)" in ended and "eta       -   (1.000 s/step)" in ended


def test_eta_is_pure_arithmetic():
    assert eta_s(100, 1000, 0.5) == 450.0
    assert eta_s(1000, 1000, 0.5) == 0.0
    assert eta_s(10, None, 0.5) is None and eta_s(10, 100, None) is None


def test_watch_once_prints_the_view(tmp_path, capsys):
    led = Ledger(tmp_path)
    led.append(ev.TrainStart(step=0))
    led.append(ev.Steps(first=0, last=9, loss=3.0, tokens_per_s=100.0, step_time_s=0.1))
    (tmp_path / "job.yaml").write_text("name: x\nnodes: 1\n")
    ctl.write_request(tmp_path, "save", user="bo")
    assert main(["watch", str(tmp_path), "--once"]) == 0
    out = capsys.readouterr().out
    assert "step      10" in out and "loss      3.0000" in out
    assert "pending   save requested by bo (not taken yet)" in out


def test_a_request_is_taken_once_and_only_when_the_poll_is_due(tmp_path):
    (tmp_path / "job.yaml").write_text("name: x\n")
    clock = [0.0]
    poller = ctl.Poller(tmp_path, every_s=5.0, clock=lambda: clock[0])
    assert poller.take() is None  # nothing waiting
    req = ctl.write_request(tmp_path, "stop", user="ana")
    clock[0] = 1.0
    assert poller.take() is None  # not due yet: no stat on every step
    clock[0] = 5.0
    got = poller.take()
    assert got == req and got.action == "stop" and got.user == "ana"
    assert not (tmp_path / ctl.REQUEST).exists() and (tmp_path / ctl.TAKEN).exists()
    clock[0] = 10.0
    assert poller.take() is None  # acted on once


def test_the_newest_request_wins_and_garbage_is_no_request(tmp_path):
    (tmp_path / "job.yaml").write_text("name: x\n")
    ctl.write_request(tmp_path, "save")
    ctl.write_request(tmp_path, "stop")
    assert ctl.Poller(tmp_path, every_s=0).take().action == "stop"
    assert ctl.parse("{not json") is None and ctl.parse(json.dumps({"action": "reboot"})) is None


def test_ctl_refuses_what_is_not_a_run_or_an_action(tmp_path, capsys):
    with pytest.raises(UserError, match="not a run directory"):
        ctl.write_request(tmp_path, "save")
    (tmp_path / "job.yaml").write_text("name: x\n")
    with pytest.raises(UserError, match="save, stop"):
        ctl.write_request(tmp_path, "pause")
    assert main(["ctl", str(tmp_path), "save"]) == 0
    assert "save requested" in capsys.readouterr().out
    assert json.loads((tmp_path / ctl.REQUEST).read_text())["action"] == "save"


def test_a_stop_is_put_on_record_for_requeue_me(tmp_path, monkeypatch):
    from dslurm.endings.facts import CANCEL

    facts = tmp_path / "starts" / "77.0"
    facts.mkdir(parents=True)
    monkeypatch.setenv("DSLURM_FACTS_DIR", str(facts))
    assert ctl.record_stop(ctl.Request(action="stop", id="1", user="ana"), tmp_path)
    rec = json.loads((facts / CANCEL).read_text())
    assert rec["save"] is True and "ana" in rec["user"] and "ctl" in rec["user"]
