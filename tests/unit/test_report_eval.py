"""Evaluations in `dslurm report`: the last eval loss and perplexity, eval time on its own line
and out of productive time, in --json and on the PNG's loss plot."""

from __future__ import annotations

import argparse
import json
import math

import pytest
from test_report import Ledger, _write

from dslurm.observe import events as ev
from dslurm.observe.plot import eval_line, timeline_figure
from dslurm.observe.report import run, summarize


def with_evals() -> Ledger:
    """20 steps of 1 s; evals of 2 s after steps 10 and 20, an interrupted one of 0.5 s after 15;
    the trainer restarts its step clock after each eval, so no window holds eval time."""
    led = Ledger()
    t = led.start(0.0, 0, 0)
    t = led.train(t, 0, 9, 0)
    led.ev("eval", t + 2.0, 0, step=10, loss=3.5, ppl=math.exp(3.5), batches=4, eval_batches=4, tokens=4096,
           source="held_out", duration_s=2.0)
    t = led.train(t + 2.0, 10, 14, 0, every=5)
    led.ev("eval", t + 0.5, 0, step=15, loss=None, ppl=None, batches=1, eval_batches=4, tokens=1024,
           source="held_out", duration_s=0.5, interrupted=True)
    t = led.train(t + 0.5, 15, 19, 0, every=5)
    led.ev("eval", t + 2.0, 0, step=20, loss=3.0, ppl=math.exp(3.0), batches=4, eval_batches=4, tokens=4096,
           source="held_out", duration_s=2.0)
    led.ev("exit", t + 2.0, 0, reason="completed", step=20, code=0)
    return led


def test_eval_event_round_trips_and_tolerates_a_garbled_field():
    (e,) = ev.decode_all([{"event": "eval", "t": 1.0, "step": 3, "loss": "x", "batches": 2, "interrupted": True}])
    assert isinstance(e, ev.Eval) and e.step == 3 and e.loss is None and e.batches == 2 and e.interrupted


def test_last_eval_loss_perplexity_and_eval_time_apart_from_productive_time():
    sm = summarize(with_evals().events)
    assert sm.eval is not None
    assert (sm.eval.count, sm.eval.interrupted, sm.eval.last_step) == (2, 1, 20)
    assert sm.eval.loss == 3.0 and sm.eval.ppl == pytest.approx(math.exp(3.0)) and sm.eval.best_loss == 3.0
    assert sm.eval.time_s == pytest.approx(4.5) and sm.starts[0].eval_s == pytest.approx(4.5)
    assert sm.productive_s == pytest.approx(20.0)  # the 4.5 s of eval is wall time, not training
    assert sm.goodput == pytest.approx(20.0 / sm.wall_s)
    line = eval_line(sm)
    assert "loss 3.0000 ppl 20.09 at step 20" in line and "2 eval(s), 1 interrupted" in line
    assert "4.5s apart from training" in line
    assert summarize(Ledger().events).eval is None


def test_json_and_text_carry_the_eval_lines(tmp_path, capsys):
    _write(tmp_path, with_evals().records)
    assert run(argparse.Namespace(run_dir=tmp_path, json=True, png=None, no_png=True)) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["eval"]["loss"] == 3.0 and out["eval"]["count"] == 2 and out["eval"]["time_s"] == 4.5
    assert out["starts"][0]["eval_s"] == 4.5
    assert run(argparse.Namespace(run_dir=tmp_path, json=False, png=None, no_png=True)) == 0
    assert "eval (held_out): loss 3.0000" in capsys.readouterr().out


def test_png_plots_eval_points_on_the_loss_axis_and_an_eval_band():
    import matplotlib.pyplot as plt

    fig = timeline_figure(summarize(with_evals().events))
    try:
        top, bottom = fig.axes[:2]
        lines = {ln.get_label(): ln for ln in bottom.get_lines()}
        assert list(lines["eval loss (held_out)"].get_ydata()) == [3.5, 3.0]
        assert "eval" in [t.get_text() for t in top.get_legend().get_texts()]
    finally:
        plt.close(fig)
