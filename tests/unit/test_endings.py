"""Classifying how a job step ended from recorded facts (dslurm/endings/__init__.py), never from rc.

The race that once lost a retry: node1's ranks crash, `srun --kill-on-bad-exit` TERMs node2's
launcher, srun returns 143. Both exit orders are built here explicitly, with the step's
return code set to what srun really returns in each, and must classify as the same crash.
"""

from __future__ import annotations

from dslurm import endings as E
from dslurm.endings.facts import StartFacts

T0 = 1_000.0


def rank(r, kind, t, host="node1", code=1, step=14, error="", signal=None):
    return {"rank": r, "kind": kind, "t": t, "host": host, "code": code, "step": step, "error": error,
            "signal": signal}


def launcher(host, signals=(), rc=0, silent=(), t=T0):
    return {"host": host, "signals": [list(s) for s in signals], "torchrun_rc": rc,
            "worker_codes": {}, "silent_local_ranks": list(silent), "t": t}


def facts(ranks=(), launchers=(), batch=()):
    return StartFacts("7.0", list(batch), list(launchers), list(ranks), None)


RUNNING = E.SlurmView(state="RUNNING")
PEER = "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234"


def test_crash_first_then_srun_tears_down_the_other_node():
    # Order A: node1's ranks exit 1 first; srun TERMs node2's launcher, whose ranks die saving.
    f = facts(
        ranks=[rank(0, "crash", T0, error="RuntimeError: injected crash"),
               rank(1, "killed_by_teardown", T0 + 2, error="", signal="SIGTERM"),
               rank(2, "peer_lost", T0 + 2.1, host="node2", error=PEER, signal="SIGTERM"),
               rank(3, "terminated_saved", T0 + 2.2, host="node2", code=143, signal="SIGTERM")],
        launchers=[launcher("node1", rc=1, t=T0 + 0.5), launcher("node2", [("SIGTERM", T0 + 1.0)], rc=143)])
    e = E.classify(f, RUNNING, step_rc=143)
    assert (e.cls, e.origin_rank, e.origin_host) == (E.CRASH, 0, "node1")
    assert "injected crash" in e.reason and any("other ranks" in x for x in e.evidence)


def test_victims_exit_first_and_the_crashed_node_is_torn_down_later():
    # Order B: the crashing rank reports, then lingers (DSLURM_FAULT_EXIT_DELAY); node2's ranks
    # see the peer vanish and exit 1 first; srun then TERMs node1's launcher.
    f = facts(
        ranks=[rank(2, "peer_lost", T0 + 0.3, host="node2", error=PEER),
               rank(3, "peer_lost", T0 + 0.3, host="node2", error=PEER),
               rank(0, "crash", T0, error="RuntimeError: injected crash")],
        launchers=[launcher("node2", rc=1, t=T0 + 0.5), launcher("node1", [("SIGTERM", T0 + 1)], rc=143, t=T0 + 3)])
    e = E.classify(f, RUNNING, step_rc=1)
    assert (e.cls, e.origin_rank, e.origin_host) == (E.CRASH, 0, "node1")


def test_a_crash_report_with_a_peer_error_is_a_victim_not_the_origin():
    f = facts(ranks=[rank(2, "crash", T0, host="node2", error=PEER), rank(0, "crash", T0 + 0.1, error="ValueError: x")])
    assert E.classify(f, RUNNING).origin_rank == 0


def test_term_at_the_batch_shell_before_any_failure_is_slurm():
    saved = [rank(r, "terminated_saved", T0 + 1, code=143, signal="SIGTERM") for r in range(4)]
    f = facts(ranks=saved, batch=[("TERM", T0)])
    assert E.classify(f, E.SlurmView(state="CANCELLED")).cls == E.CANCELLED
    e = E.classify(f, E.SlurmView(state="REQUEUED"))
    assert e.cls == E.PREEMPTED and e.saved
    assert E.classify(f, E.SlurmView(state="TIMEOUT")).cls == E.TIME_LIMIT


def test_a_crash_before_slurms_term_is_still_a_crash():
    f = facts(ranks=[rank(0, "crash", T0, error="boom")], batch=[("TERM", T0 + 5)])
    assert E.classify(f, E.SlurmView(state="CANCELLED")).cls == E.CRASH


def test_term_reaching_only_launchers_decides_nothing():
    # srun's teardown: launchers got TERM, the batch shell did not, no rank failed of its own,
    # node1's launcher saw its torchrun fail with a rank that left no report (kill -9).
    f = facts(ranks=[rank(2, "killed_by_teardown", T0 + 1, host="node2", signal="SIGTERM")],
              launchers=[launcher("node2", [("SIGTERM", T0 + 0.5)], rc=143, t=T0 + 1.2),
                         launcher("node1", rc=1, silent=[0], t=T0 + 0.4)])
    e = E.classify(f, RUNNING, step_rc=143)
    assert (e.cls, e.origin_host) == (E.CRASH, "node1") and "left no report" in e.reason


def test_agreed_stops_and_completion():
    usr2 = [rank(r, "stop_saved", T0, code=75, signal="SIGUSR2") for r in range(2)]
    e = E.classify(facts(ranks=usr2, batch=[("USR2", T0 - 1)]), RUNNING, 75)
    assert (e.cls, e.saved) == (E.WARNED_STOP, True)
    done = [rank(r, "completed", T0, code=0, step=30) for r in range(2)]
    assert E.classify(facts(ranks=done), RUNNING, 0).cls == E.COMPLETED


def test_own_failures_keep_their_class():
    for kind in (E.SAVE_FAILED, E.REFUSED, E.USER_ERROR, E.BURNIN_REJECTED):
        f = facts(ranks=[rank(0, kind, T0, error="why"), rank(1, "peer_lost", T0 + 1, error=PEER)])
        assert E.classify(f, RUNNING).cls == kind


def test_node_failure_wins_and_no_facts_falls_back_to_the_code_said_plainly():
    f = facts(ranks=[rank(0, "peer_lost", T0, error=PEER)], launchers=[launcher("node1", rc=1)])
    e = E.classify(f, E.SlurmView(state="RUNNING", down_nodes=("node2",)))
    assert (e.cls, e.origin_host) == (E.NODE_FAILURE, "node2")
    # A node that wrote its launcher report was alive when the step ended: a down state seen
    # afterwards did not end it, and the crash on node1 stays the cause.
    f = facts(ranks=[rank(0, "crash", T0, error="boom")], launchers=[launcher("node1", rc=1), launcher("node2")])
    assert E.classify(f, E.SlurmView(state="RUNNING", down_nodes=("node2",))).cls == E.CRASH
    assert E.classify(facts(), E.SlurmView(state="NODE_FAIL")).cls == E.NODE_FAILURE
    e = E.classify(facts(), E.SlurmView(), step_rc=1)
    assert e.cls == E.CRASH and "no per-rank facts" in e.reason


def test_a_step_that_died_before_any_fact_with_143_is_a_crash_unless_someone_stopped_it():
    """`dslurm selftest chaos` (seed 1): a launcher killed -9 as its step started, srun TERMed the
    other, nothing was recorded, the step said 143, and the run ended 'cancelled' with nobody asking."""
    e = E.classify(facts(), RUNNING, step_rc=143)
    assert e.cls == E.CRASH and "no TERM at the batch shell" in e.reason, e
    assert E.classify(facts(), E.SlurmView(state="CANCELLED"), step_rc=143).cls == E.CANCELLED
    assert E.classify(facts(batch=[("TERM", T0)]), RUNNING, step_rc=143).cls != E.CRASH


def test_peer_error_patterns():
    from dslurm.endings.facts import is_peer_error, victim_kind

    assert is_peer_error(PEER) and is_peer_error("Connection reset by peer")
    assert not is_peer_error("RuntimeError: injected crash before step 15")
    assert victim_kind("crash", PEER, None) == "peer_lost"
    assert victim_kind("crash", "boom", "SIGTERM") == "killed_by_teardown"
    assert victim_kind("crash", "boom", None) == "crash" and victim_kind("save_failed", PEER, None) == "save_failed"


def test_a_term_after_a_saved_warned_stop_does_not_undo_it():
    # USR2 (the time-limit warning), every rank saved and exited 75; then the time limit's TERM
    # reaches the batch shell while requeue-me runs: still a warned stop, to be requeued.
    saved = [rank(r, "stop_saved", T0 + 1, code=75, signal="SIGUSR2") for r in range(2)]
    f = facts(ranks=saved, batch=[("USR2", T0), ("TERM", T0 + 5)])
    assert E.classify(f, E.SlurmView(state="RUNNING"), 75).cls == E.WARNED_STOP
    # ... but a TERM before the save finished is Slurm's stop.
    f = facts(ranks=saved, batch=[("USR2", T0), ("TERM", T0 + 0.5)])
    assert E.classify(f, E.SlurmView(state="TIMEOUT"), 75).cls == E.TIME_LIMIT


def test_a_burnin_verdict_stays_the_ending_when_srun_tears_the_other_node_down():
    # Every rank gets the verdict and exits 78; node1's launcher happens to exit first, srun TERMs
    # node2's, and returns 143 (seen in CI under load). Both orders, the same ending.
    why = "burn-in rejected node1 (intra-node busbw 0.040 GB/s is 27.6x below node2)"
    node1 = [rank(r, E.BURNIN_REJECTED, T0, code=78, error=why) for r in (0, 1)]
    node2_written = [rank(r, E.BURNIN_REJECTED, T0 - 0.01, host="node2", code=78, error=why) for r in (2, 3)]
    torn = [launcher("node1", rc=78, t=T0 + 0.2), launcher("node2", [("SIGTERM", T0 + 0.3)], rc=143, t=T0 + 0.4)]
    for ranks in (node1 + node2_written, node1):  # node2's ranks wrote their verdict, or died first
        assert E.classify(facts(ranks=ranks, launchers=torn), RUNNING, step_rc=143).cls == E.BURNIN_REJECTED
    e = E.classify(facts(ranks=node2_written + node1), RUNNING, step_rc=78)
    # The reason is the verdict (naming node1), never "rejected on node2" because node2 reported first.
    assert (e.cls, e.reason, e.origin_host) == (E.BURNIN_REJECTED, why, None)


def test_a_warned_stop_stays_a_warned_stop_when_srun_tears_the_other_node_down():
    # All ranks saved on USR2 and exit 75; node1's 75 is "bad" to --kill-on-bad-exit, so srun TERMs
    # node2's launcher as its ranks leave and returns 143: still the agreed stop, to be requeued.
    saved = [rank(r, "stop_saved", T0 + 1, host=f"node{1 + r // 2}", code=75, signal="SIGUSR2") for r in range(4)]
    torn = [launcher("node1", rc=75, t=T0 + 1.1), launcher("node2", [("SIGTERM", T0 + 1.2)], rc=143, t=T0 + 1.3)]
    e = E.classify(facts(ranks=saved, launchers=torn, batch=[("USR2", T0)]), RUNNING, step_rc=143)
    assert (e.cls, e.saved) == (E.WARNED_STOP, True)


# ---------------------------------------------------------------- stray stops (issue 24)

STEP_ONLY = [launcher("node1", rc=143, t=T0 + 2), launcher("node2", [("SIGTERM", T0)], rc=143, t=T0 + 2.1)]
SAVED_ON_TERM = [rank(r, "terminated_saved", T0 + 1, host=f"node{1 + r // 2}", code=143, step=8, signal="SIGTERM")
                 for r in range(4)]


def test_a_term_that_reached_the_step_only_while_slurm_runs_the_job_is_a_stray_stop():
    for state in ("RUNNING", "COMPLETING", None, ""):
        e = E.classify(facts(ranks=SAVED_ON_TERM, launchers=STEP_ONLY), E.SlurmView(state=state), step_rc=143)
        assert (e.cls, e.saved, e.step) == (E.STRAY_STOP, True, 8), (state, e)
    assert "node2 at 1000.000" in e.reason and "not a cancel" in e.reason
    # Slurm's own word that the job was cancelled (the batch shell's record lost) keeps it a cancel.
    e = E.classify(facts(ranks=SAVED_ON_TERM, launchers=STEP_ONLY), E.SlurmView(state="CANCELLED by 0"), 143)
    assert (e.cls, e.saved) == (E.CANCELLED, True)


def test_a_term_at_some_launchers_with_no_reports_is_a_stray_stop_unless_a_launcher_failed_of_its_own():
    # node2's launcher got the TERM and its workers died of it; node1's workers finished and wrote
    # nothing (a plain script): no rule named it, the ending fell to srun's code (1: a crash).
    part = [launcher("node1", rc=0, t=T0 + 5), launcher("node2", [("SIGTERM", T0)], rc=1, t=T0 + 0.2)]
    assert E.classify(facts(launchers=part), RUNNING, step_rc=1).cls == E.STRAY_STOP
    # node1's launcher ended non-zero of its own (no TERM): srun's teardown sent node2 its TERM.
    own = [{**launcher("node1", rc=0, t=T0 - 1), "code": 1}, launcher("node2", [("SIGTERM", T0)], rc=1, t=T0 + 0.2)]
    assert E.classify(facts(launchers=own), RUNNING, step_rc=1).cls == E.CRASH


def test_rules_before_the_stray_stop_keep_their_endings():
    # A crash of rank 0 on node1, with node2's launcher TERMed by srun: a crash, never a stray stop.
    f = facts(ranks=[rank(0, "crash", T0 - 1, error="boom"),
                     rank(2, "killed_by_teardown", T0 + 0.5, host="node2", signal="SIGTERM")],
              launchers=[launcher("node1", rc=1, t=T0 - 0.5), launcher("node2", [("SIGTERM", T0)], rc=143)])
    assert (E.classify(f, RUNNING, 143).cls, E.classify(f, RUNNING, 143).origin_rank) == (E.CRASH, 0)
    # A kill -9 (silent rank) on node1: rule 6, whatever node2's launcher got.
    f = facts(ranks=[rank(2, "peer_lost", T0, host="node2", error=PEER)],
              launchers=[launcher("node1", rc=1, silent=[0], t=T0 - 0.1), launcher("node2", [("SIGTERM", T0)], rc=1)])
    assert (E.classify(f, RUNNING, 1).cls, E.classify(f, RUNNING, 1).origin_host) == (E.CRASH, "node1")
    # A TERM at the batch shell is rule 2's, as before (RUNNING with a TERM: a preemption's grace time).
    f = facts(ranks=SAVED_ON_TERM, launchers=STEP_ONLY, batch=[("TERM", T0 - 0.1)])
    assert E.classify(f, RUNNING, 143).cls == E.PREEMPTED
    assert E.classify(f, E.SlurmView(state="CANCELLED"), 143).cls == E.CANCELLED
    # A node lost without a launcher report: rule 1.
    f = facts(ranks=SAVED_ON_TERM[:2], launchers=STEP_ONLY[:1])
    assert E.classify(f, E.SlurmView(state="RUNNING", down_nodes=("node2",)), 143).cls == E.NODE_FAILURE
    # The warned stop (USR2) whose other node srun tore down stays a warned stop.
    usr2 = [rank(r, "stop_saved", T0 + 1, code=75, signal="SIGUSR2") for r in range(2)]
    assert E.classify(facts(ranks=usr2, launchers=STEP_ONLY), RUNNING, 143).cls == E.WARNED_STOP


def test_a_late_ending_of_a_stray_stop_reads_the_incarnations_state():
    # The next start writes the ending of a start whose batch shell left none: once accounting says
    # the incarnation ended (FAILED: the batch exited 143; REQUEUED), Slurm ended it and no stray
    # stop is made up afterwards: rule 4's class as before, decided by Slurm.
    f = facts(ranks=SAVED_ON_TERM, launchers=STEP_ONLY)
    for state in ("FAILED", "REQUEUED", "TIMEOUT", "PREEMPTED"):
        assert E.classify(f, E.SlurmView(state=state), 143).cls == E.CANCELLED, state


def test_a_fact_that_meets_a_disk_full_for_seconds_is_written_once_it_has_room(tmp_path, monkeypatch):
    """`dslurm selftest chaos` (seed 1): the ranks' reports of a hang were lost to a disk full for 7 s,
    and the start read as a stray stop. ENOSPC is tried again for ENOSPC_RETRY_S; other errors are not."""
    import errno

    from dslurm.endings import facts as F

    real, calls = F.atomic_write_text, []

    def full_twice(path, text, *a, **k):
        calls.append(path)
        if len(calls) <= 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(path, text, *a, **k)

    monkeypatch.setattr(F, "atomic_write_text", full_twice)
    monkeypatch.setattr(F.time, "sleep", lambda s: None)
    F.write_rank_report(F.RankReport(rank=3, kind="crash", code=1, step=4), {F.ENV: str(tmp_path)})
    assert len(calls) == 3 and F.read_start(tmp_path).ranks[0]["kind"] == "crash"
    monkeypatch.setattr(F, "ENOSPC_RETRY_S", 0.0)
    calls.clear()
    assert F._write_json(tmp_path / "x.json", {}) is False and len(calls) == 1  # gives up at the deadline

    def denied(path, text, *a, **k):
        calls.append(path)
        raise PermissionError(errno.EACCES, "denied")

    monkeypatch.setattr(F, "ENOSPC_RETRY_S", 10.0)
    monkeypatch.setattr(F, "atomic_write_text", denied)
    calls.clear()
    assert F._write_json(tmp_path / "y.json", {}) is False and len(calls) == 1
