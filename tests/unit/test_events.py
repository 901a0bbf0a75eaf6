"""Typed ledger events: what producers write is what readers get, and odd records are tolerated."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from dslurm.observe import events as ev
from dslurm.observe.ledger import FILENAME, Ledger


def test_every_event_round_trips_through_the_ledger(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "41")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    led = Ledger(tmp_path)
    written = [led.append(cls()) for cls in ev.CATALOGUE.values()]
    back = ev.read(tmp_path)
    assert [type(e) for e in back] == list(ev.CATALOGUE.values())
    assert back == written  # envelope and fields, as written
    assert all(e.job_id == "41" and e.restart == 2 and e.host and e.t > 0 for e in back)


def test_fields_come_back_typed(tmp_path):
    led = Ledger(tmp_path)
    led.append(ev.Steps(first=0, last=9, loss=math.nan, tokens_per_s=12, breakdown={"data": 0.5}))
    led.append(ev.Submit(job_ids=[5, 6], signal_lead_s=90, signal_lead_setting="auto", checkpoint_interval=50))
    steps, sub = ev.read(tmp_path)
    assert isinstance(steps, ev.Steps) and math.isnan(steps.loss) and steps.phase_s("data") == 0.5
    assert isinstance(steps.tokens_per_s, float) and steps.tokens_per_s == 12.0  # an int written as a float
    assert isinstance(sub, ev.Submit) and sub.job_ids == [5, 6] and sub.signal_lead_setting == "auto"


def test_a_late_ending_keeps_the_start_it_describes(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "9")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "3")
    Ledger(tmp_path).append(ev.Ending(cls="node_failure", job_id="7", restart=0, late=True))
    (end,) = ev.read(tmp_path)
    assert (end.job_id, end.restart, end.late) == ("7", 0, True)  # restart 0 is not "unset"


def test_odd_records_are_tolerated():
    assert ev.decode({"event": "from_a_newer_version", "t": 1.0}) is None
    assert ev.decode({"event": "steps"}) is None  # no time: not an event
    assert ev.decode(["not", "a", "dict"]) is None
    garbled = ev.decode({"event": "steps", "t": 1, "job_id": 7, "first": "zero", "loss": True, "extra": 1})
    assert garbled == ev.Steps(t=1.0, job_id="7")  # wrong types read as defaults, unknown fields ignored
    old = ev.decode({"event": "local_start", "t": 2.0, "hosts": ["h"]})
    assert isinstance(old, ev.JobStart) and old.hosts == ["h"]  # older ledgers' name
    assert ev.decode({"event": "ckpt_fallback", "t": 1, "step": "x", "rejected": ["a", 1]}) == ev.CkptFallback(t=1.0)


def test_a_producer_cannot_write_a_field_the_catalogue_does_not_know():
    with pytest.raises(TypeError):
        ev.Steps(losss=1.0)  # type: ignore[call-arg]


def test_the_file_format_is_the_documented_one(tmp_path):
    Ledger(tmp_path).append(ev.Exit(reason="completed", step=10, code=0))
    rec = json.loads((tmp_path / FILENAME).read_text())
    assert set(rec) == {"event", "t", "job_id", "restart", "host", "reason", "step", "code"}
    assert rec["event"] == "exit" and rec["step"] == 10


def test_of_selects_by_kind_including_subclasses():
    history = [ev.CkptRestore(step=1), ev.CkptFallback(step=2), ev.Steps()]
    assert [e.step for e in ev.of(history, ev.CkptRestore)] == [1, 2]
    assert dataclasses.is_dataclass(history[0]) and ev.CkptFallback.NAME == "ckpt_fallback"
