"""Start phases: the worker's clock, the ledger event, the phase table and the restart overhead."""

from __future__ import annotations

import time

import pytest

from dslurm.observe import events as ev
from dslurm.observe import phases as ph
from dslurm.observe.ledger import Ledger
from train.startup import StartClock, process_start_time


def _start(job: str, restart: int, t0: float, generation: str | None = None, step: int = 0,
           **phases: float) -> ev.StartPhases:
    return ev.StartPhases(job_id=job, restart=restart, t=t0 + 10, t0=t0, phases=phases,
                          total_s=sum(phases.values()), step=step, generation=generation)


def test_phases_come_in_start_order_with_spawn_from_the_launchers_job_start():
    run = [ev.JobStart(job_id="7", restart=0, t=100.0),
           # written out of order on purpose: the table follows PHASES, not the dict
           _start("7", 0, 101.5, first_step=0.5, imports=2.0, interpreter=0.1, rendezvous=0.3)]
    (t,) = ph.tables(run)
    assert t.rows == [("spawn", 1.5), ("interpreter", 0.1), ("imports", 2.0), ("rendezvous", 0.3),
                      ("first_step", 0.5)]
    assert t.cold and t.startup_s() == 4.4 and t.startup_s(spawn=False) == 2.9


def test_spawn_pairs_with_the_same_start_only():
    run = [ev.JobStart(job_id="7", restart=0, t=100.0), ev.JobStart(job_id="7", restart=1, t=200.0),
           _start("7", 1, 203.0, generation="g1", step=20, imports=1.0),
           _start("8", 0, 300.0, imports=1.0)]  # no job_start for job 8 (e.g. run without the launcher)
    restart, other = ph.tables(run)
    assert restart.rows[0] == ("spawn", 3.0) and not restart.cold and restart.step == 20
    assert other.seconds("spawn") is None


def test_restart_overhead_is_each_starts_startup_over_the_cold_starts():
    run = [ev.JobStart(job_id="7", restart=0, t=100.0), _start("7", 0, 102.0, imports=2.0, build=1.0, data=1.0),
           ev.JobStart(job_id="7", restart=1, t=200.0),
           _start("7", 1, 201.0, generation="g", step=20, imports=2.0, build=1.0, restore=1.0)]
    (cold, r0), (restart, r1) = ph.restart_overhead(ph.tables(run))
    assert r0 == 1.0 and r1 == pytest.approx(5 / 6, abs=1e-3)
    text = ph.format_table([cold, restart])
    assert "start 0 (cold)" in text and "restore" in text and "0.83" in text


def test_overhead_compares_like_with_like_when_one_start_has_no_spawn():
    cold = ph.table(_start("7", 0, 100.0, imports=2.0))
    restart = ph.table(_start("7", 1, 200.0, generation="g", imports=2.0, restore=0.4),
                       [ev.JobStart(job_id="7", restart=1, t=190.0)])  # 10 s of spawn: left out here
    assert [r for _, r in ph.restart_overhead([cold, restart])] == [1.0, 1.2]


def test_no_cold_start_gives_no_ratio_and_garbled_phases_are_dropped():
    t = ph.table(ev.StartPhases(t0=1.0, generation="g", phases={"imports": 1.0, "build": "x", "data": -1,
                                                                "new_phase": 0.25}))
    assert t.rows == [("imports", 1.0), ("new_phase", 0.25)]  # an unknown name goes last, kept
    assert ph.restart_overhead([t]) == [(t, None)]
    assert ph.format_table([]) == "no start_phases events"


def test_the_event_round_trips_through_the_ledger_in_order(tmp_path):
    Ledger(tmp_path).append(_start("7", 0, 5.0, interpreter=0.1, config=0.05, imports=2.0, first_step=0.3))
    (back,) = ev.read(tmp_path)
    assert isinstance(back, ev.StartPhases) and list(back.phases) == ["interpreter", "config", "imports",
                                                                      "first_step"]


def test_the_clock_adds_phases_up_to_the_first_step_and_then_stops(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(time, "time", lambda: now[0])
    clock = StartClock(t_entry=100.0, born=99.9)
    assert clock.t0 == 99.9 and clock.phases == {"interpreter": pytest.approx(0.1)}
    now[0] = 101.0
    clock.mark("imports")
    now[0] = 101.5
    clock.mark("build")
    now[0] = 101.75
    clock.mark("build")  # a phase marked twice adds up
    e = clock.event(step=0, generation=None)
    assert e.phases == {"interpreter": pytest.approx(0.1), "imports": 1.0, "build": 0.75}
    assert e.total_s == pytest.approx(1.85) and e.t0 == 99.9 and clock.finished
    now[0] = 200.0
    assert clock.mark("first_step") == 0.0 and "first_step" not in clock.phases


def test_the_clock_refuses_a_phase_the_reader_does_not_know():
    clock = StartClock()
    clock.mark("imprts")
    with pytest.raises(ValueError, match="imprts"):
        clock.event(step=0, generation=None)


def test_the_process_birth_is_before_now_and_ignored_when_implausible():
    born = process_start_time()
    assert born is None or born <= time.time()
    assert StartClock(t_entry=5000.0, born=1000.0).t0 == 5000.0  # 4000 s earlier: not this process's entry
