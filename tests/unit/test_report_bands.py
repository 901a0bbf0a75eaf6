"""The report's timeline covers every second once (issue 54): a rank hung for 121 s showed as
white space and the legend had no hang. `dslurm.observe.bands.timeline` is pure: the bands of a
hung-then-requeued run (synthetic, with hand-worked numbers, and a real one's ledger kept in
tests/unit/data) add up to the run's span, each kind where it belongs; the PNG draws them."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_report import Ledger, two_requeues

from dslurm.observe import bands as B
from dslurm.observe.events import read
from dslurm.observe.report import summarize

DATA = Path(__file__).parent / "data"


def hung_then_requeued() -> Ledger:
    """Start 0 trains steps 0-11 (1 s each, a save at 10), its last progress at step 12's
    start; the watchdog fires 121 s later; the requeue decision 9 s after that; 20 s in the
    queue; start 1 resumes from 10 and completes at 20."""
    led = Ledger()
    led.ev("submit", 0.0, job_ids=[6034286])
    t = led.start(5.0, 0, 0)  # burn-in 5-25, first step at 35
    t = led.train(t, 0, 11, 0, every=4, saves={8: 0.5})  # 35 -> 47.5
    led.ev("hang", t + 121.0, 0, step=12, idle_s=121.0, bound_s=120.0, suspects=[1])
    led.ev("requeue", t + 130.0, 0, decision="requeue", step_rc=80, exit_code=0, ending="crash",
           reason="hang")
    t1 = led.start(t + 150.0, 1, 8)
    t = led.train(t1, 8, 19, 1, every=4)
    led.ev("exit", t, 1, reason="completed", step=20, code=0)
    led.ev("requeue", t + 1.0, 1, decision="end", step_rc=0, exit_code=0, ending="completed", reason="completed")
    return led


def assert_partition(tl: B.Timeline) -> None:
    """Back to back from t0 to t_end: no overlap, no gap, widths adding up to the span."""
    t = tl.t0
    for b in tl.bands:
        assert b.width > 0 and b.t0 == pytest.approx(t, abs=1e-9), (b, t)
        t = b.t0 + b.width
    assert t == pytest.approx(tl.t_end, abs=1e-9)
    assert sum(b.width for b in tl.bands) == pytest.approx(tl.t_end - tl.t0, abs=1e-9)


def test_a_hung_run_is_covered_second_by_second_with_the_hang_where_it_was():
    sm = summarize(hung_then_requeued().events)
    tl = B.timeline(sm, phases=False)
    assert_partition(tl)
    assert tl.t0 == 0.0 and tl.t_end == sm.starts[-1].end
    # The bands of the starts are the report's wall time; the rest is waiting for Slurm.
    assert tl.t_end - tl.width_of(B.QUEUE) - tl.width_of(B.IDLE) == pytest.approx(sm.wall_s)
    assert tl.width_of(B.HUNG) == pytest.approx(121.0)  # the hang's idle time, all of it
    assert tl.width_of(B.TEARDOWN) == pytest.approx(9.0 + 1.0)  # detection -> decision; the last exit -> end
    assert tl.width_of(B.QUEUE) == pytest.approx(5.0 + 20.0)
    assert tl.width_of(B.SAVE) == pytest.approx(0.5)
    # start 0's window 8-11 (4.5 s with its save) was redone by start 1: 4 s, the stall apart
    assert tl.width_of(B.REDONE) == pytest.approx(4.0)
    hung = [b for b in tl.bands if b.kind == B.HUNG]
    assert [(b.lane, b.t0) for b in hung] == [(0, pytest.approx(47.5))]
    marks = {(m.kind, m.lane) for m in tl.marks}
    assert {("hang", 0), ("crash", 0), ("save", 0)} <= marks and ("crash", 1) not in marks


def test_every_kind_of_start_adds_up_on_the_fixtures():
    """Crash, stop signal, completed (synthetic), and real runs: preempted + requeued, spares,
    warm restarts (the phases drawn too)."""
    sms = [summarize(two_requeues().events)]
    sms += [summarize(read(DATA / name)) for name in sorted(p.name for p in DATA.iterdir())]
    assert len(sms) >= 8
    for sm in sms:
        for phases in (False, True):
            assert_partition(B.timeline(sm, phases=phases))
    signals = [m for m in B.timeline(sms[0]).marks if m.kind == "signal"]
    assert [m.lane for m in signals] == [1]


def test_a_real_hung_run_adds_up():
    """tests/unit/data/hang-gloo: a real torchrun + gloo run whose rank 1 hung before step 4
    (DSLURM_FAULT_HANG), caught by the watchdog, then resumed to completion (written by
    tests/integration/test_health.py's hang test, which checks the same on its own run)."""
    sm = summarize(read(DATA / "hang-gloo"))
    tl = B.timeline(sm)
    assert_partition(tl)
    (h,) = [e for s in sm.starts for e in s.all(B.ev.Hang)]
    assert tl.width_of(B.HUNG) == pytest.approx(h.idle_s, rel=1e-6)
    assert len(sm.starts) == 2 and sm.completion.complete


def test_the_png_draws_the_hang_and_names_it():
    import matplotlib.pyplot as plt

    from dslurm.observe.plot import timeline_figure

    fig = timeline_figure(summarize(hung_then_requeued().events))
    try:
        legend = {t.get_text() for t in fig.axes[0].get_legend().get_texts()}
    finally:
        plt.close(fig)
    assert {B.HUNG, B.TEARDOWN, B.QUEUE, "hang detected", "crash (the run's own failure)"} <= legend
