"""Throughput, MFU, the step breakdown, straggler flagging and the log line."""

from __future__ import annotations

from pathlib import Path

import pytest

from dslurm.config import load_site
from train.metrics import (
    Peak,
    StepMetrics,
    flag_stragglers,
    format_log_line,
    gather_step_times,
    mfu,
    peak_for,
    straggler_event,
    tokens_per_s,
)

SITES = Path(__file__).resolve().parents[2] / "site-configs"


def test_mfu_worked_example_of_the_seed():
    # 20,000 tokens/s x 120 GFLOP/token = 2.4 PFLOP/s on 8 x 1 PFLOP/s -> 30 %.
    assert mfu(20_000, 120e9, 1e15, 8) == pytest.approx(0.30)
    assert mfu(20_000, 120e9, 0.0, 8) is None  # unknown peak: no number, not 0 or inf
    assert tokens_per_s(1000, 0.5) == 2000 and tokens_per_s(1000, 0) == 0.0


def test_peak_comes_from_the_site():
    h100 = peak_for(load_site(SITES / "h100-ib.yaml"), procs_per_node=8)
    assert h100 == Peak(989e12, "bf16 peak")
    local = load_site(SITES / "local.yaml")
    assert peak_for(local, procs_per_node=2) == Peak(0.0, "cpu: no peak")
    measured = peak_for(local, procs_per_node=2, cpu_peak_gflops=40.0)
    assert measured == Peak(20e9, "cpu: measured peak")  # two processes share the cores


def test_stragglers_are_named_with_their_host():
    times = [0.10, 0.11, 0.10, 0.31, 0.10, 0.12, 0.10, 0.16]
    hosts = [f"node{r // 4}" for r in range(8)]
    slow = flag_stragglers(times, hosts, factor=1.5)
    assert [(s.rank, s.host) for s in slow] == [(3, "node0"), (7, "node1")]  # slowest first
    assert slow[0].ratio == pytest.approx(0.31 / 0.105)
    assert flag_stragglers([0.1] * 8, factor=1.5) == []
    assert flag_stragglers([0.2, 1.0], factor=1.5)[0].host == "?"  # no hosts given
    event = straggler_event(50, times, hosts, factor=1.5)
    assert event.step == 50 and [s["rank"] for s in event.slow] == [3, 7] and event.slow_hosts() == ["node0", "node1"]
    with pytest.raises(ValueError, match="factor"):
        flag_stragglers(times, factor=1.0)
    with pytest.raises(ValueError, match="3 hosts for 8 ranks"):
        flag_stragglers(times, hosts[:3])


def test_gather_without_a_process_group_returns_this_rank():
    times, hosts = gather_step_times(0.25)
    assert times == [0.25] and len(hosts) == 1 and hosts[0]


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def run_step(m: StepMetrics, clock: FakeClock, step: int, *, data: float, compute: float,
             opt: float, other: float, loss: float) -> float:
    for name, dt in (("data", data), ("compute", compute), ("optimizer", opt)):
        with m.phase(name):
            clock.t += dt
    clock.t += other
    return m.end_step(step, loss)


def test_collector_splits_the_step_and_summarises_a_window():
    clock, syncs = FakeClock(), []
    m = StepMetrics(tokens_per_step=1000, flops_per_token=1e9, peak=Peak(1e12, "bf16 peak"),
                    n_devices=2, clock=clock, sync=lambda: syncs.append(1))
    m.start()
    assert run_step(m, clock, 0, data=0.1, compute=0.6, opt=0.2, other=0.1, loss=5.0) == \
        pytest.approx(1.0)
    run_step(m, clock, 1, data=0.3, compute=0.6, opt=0.2, other=0.1, loss=4.0)
    assert syncs  # every phase boundary synchronises
    win = m.summary()
    assert (win.first, win.last, win.loss) == (0, 1, 4.0)
    assert win.step_time_s == pytest.approx(1.1) and win.duration_s == pytest.approx(2.2)
    assert win.breakdown == pytest.approx({"data": 0.2, "compute": 0.6, "optimizer": 0.2,
                                           "checkpoint": 0.0, "other": 0.1})
    assert win.tokens_per_s == pytest.approx(2000 / 2.2)
    assert win.mfu == pytest.approx(2000 / 2.2 * 1e9 / 2e12)
    ev = win.event(lr=0.1)
    assert ev.first == 0 and ev.last == 1 and ev.mfu == pytest.approx(win.mfu, rel=1e-4) and ev.lr == 0.1
    assert m.summary() is None  # the window was reset
    with pytest.raises(ValueError, match="phase 'io'"):
        with m.phase("io"):
            pass


def test_log_line_on_cpu_and_gpu():
    clock = FakeClock()
    m = StepMetrics(tokens_per_step=512, flops_per_token=1e6, peak=Peak(0.0, "cpu: no peak"),
                    n_devices=2, clock=clock)
    m.start()
    # 512 tokens in 84 ms = 6095 tok/s
    run_step(m, clock, 39, data=0.002, compute=0.07, opt=0.01, other=0.002, loss=3.21444)
    line = format_log_line(m.summary(), total_steps=100, lr=2.91e-3)
    assert line.startswith("step 40/100 loss 3.2144 lr 2.91e-03 | 6.1k tok/s ")
    assert "mfu n/a (cpu: no peak)" in line
    assert "84ms/step (data 2 compute 70 opt 10 ckpt 0 other 2 ms)" in line
    g = StepMetrics(tokens_per_step=512, flops_per_token=1e9, peak=Peak(1e12, "bf16 peak"),
                    n_devices=1, clock=clock)
    g.start()
    run_step(g, clock, 0, data=0, compute=1.0, opt=0, other=0, loss=1.0)
    assert "mfu 51.2%" in format_log_line(g.summary(), total_steps=10, lr=1e-3)
