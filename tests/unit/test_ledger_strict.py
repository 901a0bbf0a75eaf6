"""The ledger is strict JSON lines, and a torn line never costs the next event."""

from __future__ import annotations

import json
import math

from dslurm.observe import events
from dslurm.observe.ledger import FILENAME, Ledger, read_events


def test_non_finite_numbers_are_strict_json_and_read_back_as_floats(tmp_path):
    Ledger(tmp_path).append(events.Steps(loss=math.nan, grad_norm=math.inf, lr=-math.inf, tokens_per_s=1.5))
    raw = (tmp_path / FILENAME).read_text()

    def refuse(name):
        raise ValueError(f"non-standard JSON constant {name}")

    rec = json.loads(raw, parse_constant=refuse)  # a strict parser accepts the line
    assert rec["loss"] == "NaN" and rec["grad_norm"] == "Infinity"
    ev = next(read_events(tmp_path))
    assert math.isnan(ev["loss"]) and ev["grad_norm"] == math.inf and ev["lr"] == -math.inf
    steps = next(events.of(events.read(tmp_path), events.Steps))
    assert math.isnan(steps.loss) and steps.grad_norm == math.inf and steps.tokens_per_s == 1.5
    Ledger(tmp_path).append(events.Stragglers(step_times_s=[1.0, math.inf], slow=[{"ratio": math.nan}]))
    ev = [e for e in read_events(tmp_path) if e["event"] == "stragglers"][0]
    assert ev["step_times_s"] == [1.0, math.inf] and math.isnan(ev["slow"][0]["ratio"])


def test_an_append_after_a_torn_line_starts_on_a_fresh_line(tmp_path):
    led = Ledger(tmp_path)
    led.append(events.Submit(job_ids=[1]))
    with open(tmp_path / FILENAME, "ab") as fh:
        fh.write(b'{"event":"steps","t":1,"lo')  # kill -9 in the middle of a write
    led.append(events.TrainStart(step=0))
    names = [e["event"] for e in read_events(tmp_path)]
    assert names == ["submit", "train_start"]
    lines = (tmp_path / FILENAME).read_text().splitlines()
    assert json.loads(lines[-1])["event"] == "train_start"


def test_a_full_disk_does_not_raise_into_the_writer(tmp_path, monkeypatch):
    import errno
    import os

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    rec = Ledger(tmp_path).append(events.Steps(loss=1.0))
    assert rec.NAME == "steps" and rec.loss == 1.0


def _short_writes(monkeypatch, then=None):
    """os.write of the ledger writing half a line (a disk that fills mid-write), for real;
    `then(fd)` runs after it, before the writer looks again (another process appending)."""
    import os

    real = os.write

    def half(fd, data):
        n = real(fd, data[:len(data) // 2])
        if then is not None:
            then(fd)
        return n

    monkeypatch.setattr(os, "write", half)


def test_a_line_a_full_disk_cut_short_is_taken_back(tmp_path, monkeypatch):
    """`dslurm selftest chaos` seed 4444: a disk full mid-write left the head of a line in the ledger
    (3 garbled lines in 30 minutes). The writer cuts the file back to where its line began."""
    led = Ledger(tmp_path)
    led.append(events.Submit(job_ids=[1]))
    before = (tmp_path / FILENAME).read_bytes()
    with monkeypatch.context() as m:
        _short_writes(m)
        led.append(events.Steps(loss=1.0))  # does not raise, leaves nothing behind
    assert (tmp_path / FILENAME).read_bytes() == before
    led.append(events.TrainStart(step=0))
    lines = (tmp_path / FILENAME).read_text().splitlines()
    assert [json.loads(ln)["event"] for ln in lines] == ["submit", "train_start"]  # every line whole


def test_a_torn_line_another_writer_appended_after_is_left_to_the_readers(tmp_path, monkeypatch):
    """The other order: a second process appended its line right after the cut one. Cutting back
    would take that line too, so the torn head stays (the next append starts on a fresh line, the
    readers skip it) and the other writer's line is kept."""
    import os

    led = Ledger(tmp_path)
    led.append(events.Submit(job_ids=[1]))
    # a Ledger in the other process finds the torn head and starts its line on a fresh one
    other = b'\n{"event":"job_start","t":2,"job_id":"1","restart":0,"host":"n2"}\n'
    with monkeypatch.context() as m:
        _short_writes(m, then=lambda fd: os.pwrite(fd, other, os.fstat(fd).st_size))
        led.append(events.Steps(loss=1.0))
    led.append(events.TrainStart(step=0))
    assert [e["event"] for e in read_events(tmp_path)] == ["submit", "job_start", "train_start"]
    assert other in (tmp_path / FILENAME).read_bytes()
