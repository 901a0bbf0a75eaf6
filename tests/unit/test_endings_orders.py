"""Endings that were decided by srun's code, or by the order the nodes exited in, instead of by
the facts (dslurm/endings/__init__.py). Each case writes its facts with the real writers
(dslurm.endings.worker_exit.report for the rank that fails, dslurm.endings.facts for the rest, with the
fields and signal times each party really records) and classifies them under every return code
srun gives for that interleaving: one that is crash (1), one where srun TERMed the other
launcher (143).

Found by walking every worker kind x every way a step ends x both exit orders; the cells that
were already right are covered by tests/unit/test_endings.py.
"""

from __future__ import annotations

import signal
import time
from types import SimpleNamespace

import pytest

from dslurm import endings as E
from dslurm.endings import facts as F
from dslurm.endings.worker_exit import Outcome, report
from dslurm.runtime.stop import StopRequest

PEER = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"
RUNNING = E.SlurmView(state="RUNNING")


@pytest.fixture
def start(tmp_path, monkeypatch):
    """This start's facts dir, as the batch script exports it; no launcher status dir."""
    d = tmp_path / "starts" / "7.0"
    d.mkdir(parents=True)
    monkeypatch.setenv(F.ENV, str(d))
    monkeypatch.delenv("DSLURM_STATUS_DIR", raising=False)
    return d


def tick() -> float:
    """A moment strictly after the previous one (the writers stamp time.time())."""
    time.sleep(0.002)
    return time.time()


def batch(d, *lines: tuple[str, float]) -> None:
    """The batch shell's trap: `SIGNAME EPOCHREALTIME` per signal."""
    with open(d / "batch.signals", "a") as fh:
        for name, t in lines:
            fh.write(f"{name} {t:.6f}\n")


def rank(r: int, kind: str, t: float, host: str, signal_: str | None, error: str = PEER, code: int = 1) -> None:
    F.write_rank_report(F.RankReport(rank=r, kind=kind, code=code, step=14, error=error, t=t, signal=signal_,
                                     host=host))


def launcher(host: str, node_rank: int, signals: list[tuple[str, float]], *, rc: int | None, codes: dict[str, int],
             silent: list[int], code: int, t: float) -> None:
    F.write_launcher_report(F.LauncherReport(host=host, node_rank=node_rank, signals=signals, torchrun_rc=rc,
                                             worker_codes=codes, silent_local_ranks=silent, code=code, t=t))


def own_crash_after(stop: StopRequest, *late_signals: signal.Signals) -> float:
    """Rank 0 fails of its own accord (its own exception, not a peer's), after whatever `stop`
    already received; `late_signals` reach it afterwards, while it cleans up (torchrun TERMs the
    workers still alive once a peer exited). Then it reports, as every entry does on its way out."""
    out = Outcome()
    out.stop = stop
    out.failed(RuntimeError("CUDA error: an illegal memory access was encountered"))
    t_fail = out.t
    assert t_fail is not None
    for sig in late_signals:
        tick()
        stop._handle(sig, None)  # the handler the signal runs
    tick()
    report(out, 1, 0)
    return t_fail


@pytest.mark.parametrize("late", [(), (signal.SIGTERM,)], ids=["alone", "then-torn-down"])
@pytest.mark.parametrize("step_rc", [1, 143])
def test_a_rank_that_crashes_after_the_time_limit_warning_is_the_origin(start, late, step_rc):
    # USR2 (the time-limit warning) reaches every rank; before the next step boundary (or during
    # the stop's save) rank 0 on node1 crashes of its own. Its peers lose it; node2's launcher is
    # TERMed by srun. USR2 tears nothing down: rank 0's crash is the origin, a retry is owed.
    # It was reported killed_by_teardown (victim_kind took any signal for a teardown; and a TERM
    # that reached it after its failure was dated to the USR2's arrival), so nothing named an
    # origin and the ending fell to srun's code: 143 read as `cancelled`, the retry lost.
    t0 = time.time()
    batch(start, ("USR2", t0))
    stop = StopRequest()
    stop._handle(signal.SIGUSR2, None)
    tick()
    t_fail = own_crash_after(stop, *late)
    rank(1, "peer_lost", tick(), "node1", "SIGUSR2")
    rank(2, "peer_lost", tick(), "node2", "SIGUSR2")
    rank(3, "peer_lost", tick(), "node2", "SIGUSR2")
    launcher("node1", 0, [("SIGUSR2", t0)], rc=1, codes={"0": 1, "1": 1}, silent=[], code=1, t=tick())
    launcher("node2", 1, [("SIGUSR2", t0), ("SIGTERM", tick())], rc=1, codes={"0": 1, "1": 1}, silent=[], code=1,
             t=tick())
    e = E.classify(F.read_start(start), RUNNING, step_rc)
    assert (e.cls, e.origin_rank) == (E.CRASH, 0), e
    assert any(f"{t_fail:.3f}" in x for x in e.evidence), e.evidence


@pytest.mark.parametrize("first", ["node1", "node2"])
@pytest.mark.parametrize("step_rc", [1, 143])
def test_a_rank_killed_9_after_the_time_limit_warning_is_a_crash(start, first, step_rc):
    # USR2 reaches every launcher (srun forwards it) and rank; rank 0 on node1 is killed -9
    # (OOM killer) during the stop's save and leaves no report. Its peers lose it. The launcher
    # rule skipped every launcher that had received *any* signal, USR2 included, so the ending
    # fell to srun's code. Both exit orders: node1's launcher first (srun TERMs node2's), or
    # node2's first (srun TERMs node1's, whose torchrun had already failed).
    t0 = time.time()
    batch(start, ("USR2", t0))
    for r, host in ((1, "node1"), (2, "node2"), (3, "node2")):
        rank(r, "peer_lost", tick(), host, "SIGUSR2")
    order = ["node1", "node2"] if first == "node1" else ["node2", "node1"]
    for i, host in enumerate(order):
        torn = [("SIGTERM", tick())] if i else []
        if host == "node1":
            launcher("node1", 0, [("SIGUSR2", t0), *torn], rc=1, codes={"1": 1}, silent=[0], code=1, t=tick())
        else:
            launcher("node2", 1, [("SIGUSR2", t0), *torn], rc=1, codes={"0": 1, "1": 1}, silent=[], code=1, t=tick())
    e = E.classify(F.read_start(start), RUNNING, step_rc)
    assert e.cls == E.CRASH and "left no report" in e.reason, e
    assert e.origin_host == "node1", e  # the silent node, even when node2's launcher exited first


@pytest.mark.parametrize("first", ["node1", "node2"])
def test_a_kill_9_without_any_warning_names_the_silent_node_in_either_order(start, first):
    # Rank 0 on node1 is killed -9 mid-step. Order A: node1's launcher exits first, srun TERMs
    # node2's. Order B: node2's ranks see the peer vanish and exit 1 first (their launcher has no
    # TERM and a failed torchrun too); srun TERMs node1's. The silent node is the origin in both.
    for r, host in ((1, "node1"), (2, "node2"), (3, "node2")):
        rank(r, "peer_lost", tick(), host, None)
    order = ["node1", "node2"] if first == "node1" else ["node2", "node1"]
    for i, host in enumerate(order):
        torn = [("SIGTERM", tick())] if i else []
        if host == "node1":
            launcher("node1", 0, torn, rc=1, codes={"1": 1}, silent=[0], code=1, t=tick())
        else:
            launcher("node2", 1, torn, rc=1, codes={"0": 1, "1": 1}, silent=[], code=1, t=tick())
    e = E.classify(F.read_start(start), RUNNING, 1)
    assert (e.cls, e.origin_host) == (E.CRASH, "node1"), e


@pytest.mark.parametrize("state", ["RUNNING", None])
@pytest.mark.parametrize("nodes", [1, 2])
def test_term_aimed_at_the_step_of_a_script_without_reports_is_a_stray_stop(start, nodes, state):
    # `scancel --signal=TERM JOB` (steps only, not the batch shell) while the workers run code that
    # writes no rank report: a plain script (behind the gate or not), the probe or the burn-in
    # before their verdict, the trainer before its handlers are installed. Every launcher records
    # the TERM; the workers die of it; torchrun, TERMed too, exits 1 (SignalException), so every
    # launcher and srun return 1. The ending was read from that 1 as a crash and retried, then as
    # a cancel (no retry); but nothing reached the batch shell and Slurm still runs the job:
    # nobody said the run should end. A stray stop, requeued within its own budget.
    t0 = time.time()
    for n in range(nodes):
        launcher(f"node{n + 1}", n, [("SIGTERM", t0 + 0.001 * n)], rc=1, codes={}, silent=[0, 1], code=1, t=tick())
    e = E.classify(F.read_start(start), E.SlurmView(state=state), step_rc=1)
    assert e.cls == E.STRAY_STOP and not e.saved, e
    assert any("batch shell got no TERM" in x for x in e.evidence), e.evidence
    # Once Slurm says the job is cancelled, the same facts are a cancel, as before.
    assert E.classify(F.read_start(start), E.SlurmView(state="CANCELLED"), step_rc=1).cls == E.CANCELLED


def _saved_on_term(hosts: dict[int, str], t: float) -> None:
    """Every rank agreed on the TERM one of them got and saved (the trainer's `terminated_saved`)."""
    for r, host in hosts.items():
        rank(r, "terminated_saved", t, host, "SIGTERM", error="", code=143)


@pytest.mark.parametrize("first", ["node1", "node2"])
@pytest.mark.parametrize("reports_first", [True, False], ids=["reports-then-launchers", "launchers-then-reports"])
def test_a_term_that_reached_one_launcher_only_is_a_stray_stop_in_either_order(start, first, reports_first):
    # The field report (issue 24): in the start after a hang's requeue, node2's launcher alone got a
    # TERM at step 8: not the batch shell, not node1's launcher, no cancel in any Slurm log. The
    # ranks agreed on it and saved; the ending was "cancelled" (TERM aimed at the job step) and the
    # run stopped at step 8 of 40. Whichever node exits first and whether the ranks' reports or
    # the launchers' land first, it is a stray stop, saved, naming node2 and when.
    t_term = time.time()

    def launchers() -> None:
        for host in (["node1", "node2"] if first == "node1" else ["node2", "node1"]):
            sigs = [("SIGTERM", t_term)] if host == "node2" else []
            launcher(host, int(host[-1]) - 1, sigs, rc=143, codes={"0": 143, "1": 143}, silent=[], code=143, t=tick())

    if not reports_first:
        launchers()
    _saved_on_term({0: "node1", 1: "node1", 2: "node2", 3: "node2"}, tick())
    if reports_first:
        launchers()
    for step_rc in (143, 1):
        e = E.classify(F.read_start(start), RUNNING, step_rc)
        assert (e.cls, e.saved, e.step) == (E.STRAY_STOP, True, 14), e
        assert "node2" in e.reason and f"{t_term:.3f}" in e.reason, e.reason
        assert any("none at node1" in x for x in e.evidence) and any("batch shell got no TERM" in x
                                                                      for x in e.evidence), e.evidence


def test_a_cancel_that_dslurm_cancel_recorded_is_a_cancel_in_either_form(start):
    # `dslurm cancel --save`: the request is recorded first, then `scancel --full --signal=TERM`
    # reaches the batch shell and the steps while Slurm still shows the job RUNNING (rule 2 would
    # call that a preemption); and a step-only TERM after a recorded request is the user's too.
    F.write_cancel_request(start, save=True, user="ada")
    _saved_on_term({0: "node1", 1: "node1"}, tick())
    launcher("node1", 0, [("SIGTERM", tick())], rc=143, codes={"0": 143, "1": 143}, silent=[], code=143, t=tick())
    e = E.classify(F.read_start(start), RUNNING, 143)
    assert (e.cls, e.saved) == (E.CANCELLED, True), e
    assert any("dslurm cancel --save" in x and "ada" in x for x in e.evidence), e.evidence
    batch(start, ("TERM", tick() - 0.5))
    e = E.classify(F.read_start(start), RUNNING, 143)
    assert (e.cls, e.saved) == (E.CANCELLED, True), e
    # a later job step of an in-allocation recovery reads the request of its start
    step1 = start.parent / "7.0.1"
    step1.mkdir()
    assert F.read_start(step1).cancel and F.read_start(step1).cancel["save"] is True


def test_the_signal_a_rank_reports_is_the_one_that_came_before_its_failure():
    # The writer's rule behind the first test, on its own: USR2 first, then the rank fails, then
    # torchrun's TERM. The report's signal is the USR2 (a warning: not a teardown), never the TERM
    # that came after the failure.
    from dslurm.endings.worker_exit import signal_before_failure

    stop = StopRequest()
    stop._handle(signal.SIGUSR2, None)
    failed = tick()
    tick()
    stop._handle(signal.SIGTERM, None)
    assert stop.signame == "SIGTERM"  # TERM outranks USR2 for the stop itself
    assert signal_before_failure(stop, failed) == "SIGUSR2"
    assert F.victim_kind("crash", "RuntimeError: boom", "SIGUSR2") == "crash"
    assert F.victim_kind("crash", "RuntimeError: boom", "SIGTERM") == "killed_by_teardown"
    # a TERM alone, before the failure, is kept
    assert signal_before_failure(SimpleNamespace(signame="SIGTERM", times={"SIGTERM": 1.0}), 2.0) == "SIGTERM"


def test_a_saved_warned_stop_is_stamped_before_the_cleanup_so_a_late_term_cannot_undo_it(start, tmp_path):
    # dslurm.runtime's exit_for_requeue: the stop's save is closed (committed), then the exit
    # event, the barrier, the report. The time limit's TERM may land in between; the report was
    # stamped after it, so "every rank saved before the TERM" failed and the warned stop became
    # Slurm's time limit: no requeue, the job over. The report is stamped when the save closed.
    from dslurm.runtime import Runtime

    t0 = time.time()
    batch(start, ("USR2", t0))
    term_at: list[float] = []

    class Ledger:  # the exit event is where the TERM lands: after the save, before the report
        def append(self, event):
            term_at.append(tick())
            rt.outcome.stop._handle(signal.SIGTERM, None)

    rt = Runtime(run_dir=tmp_path, site=None, job=None, t_start=t0)
    rt.ledger = Ledger()
    rt.outcome.stop = StopRequest()
    rt.outcome.stop._handle(signal.SIGUSR2, None)
    rt.checkpoints = [SimpleNamespace(close=lambda: None)]
    rt._end(75, 12)
    rank(1, "stop_saved", t0 + 0.001, "node1", "SIGUSR2", error="", code=75)
    batch(start, ("TERM", term_at[0]))
    facts = F.read_start(start)
    assert [r["kind"] for r in facts.ranks] == ["stop_saved", "stop_saved"]
    assert all(r["t"] < term_at[0] for r in facts.ranks), (facts.ranks, term_at)
    e = E.classify(facts, E.SlurmView(state="RUNNING"), 143)
    assert (e.cls, e.saved) == (E.WARNED_STOP, True), e
