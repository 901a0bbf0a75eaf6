"""The benches' endpoint (dslurm.observe.endpoints): a recovery is timed to the first step done by
the start being timed, by the report's own rule, even when the dying attempt's rank 0 logs a late
`steps` event after the kill (issue 40: bench_warm_spare printed 0.16 s for a swap whose next
start trained at > 2.71 s). Synthetic ledgers with the times worked out by hand; pure."""

from __future__ import annotations

import pytest

from dslurm.observe import endpoints
from dslurm.observe import events as ev
from dslurm.observe.report import summarize

BASE = {"job_id": "7100", "restart": 0, "host": "node1"}
KILL = 120.0


def _ledger(late_at: list[float]) -> list[ev.Event]:
    """A cold start training steps 0..7 (one a second from t=110), node2 killed at 120.0, the dying
    rank 0's late windows (step 8) at `late_at`, the recovery decided at 121.0, the next start's
    launcher at 121.5, train_start at 123.0 (restored step 5) and its first step done at 124.2
    (phase table), first window at 124.3."""
    out: list[dict] = [{**BASE, "event": "job_start", "t": 100.0, "hosts": ["node1", "node2"], "mode": "torchrun",
                        "nproc_per_node": 2},
                       {**BASE, "event": "train_start", "t": 109.0, "step": 0}]
    out += [{**BASE, "event": "steps", "t": 110.0 + k, "first": k, "last": k, "loss": 2.0, "duration_s": 1.0}
            for k in range(8)]
    out.append({**BASE, "event": "ending", "t": 120.6, "cls": "node_failure", "reason": "node2 lost"})
    out.append({**BASE, "event": "recovery", "t": 121.0, "failed_t": KILL, "cause": "node_failure", "mode": "spare",
                "removed": ["node2"], "added": ["node3"], "nodes": ["node1", "node3"], "from_nodes": 2,
                "to_nodes": 2, "resume_step": 5})
    out += [{**BASE, "event": "job_start", "t": 121.5, "hosts": ["node1", "node3"], "mode": "warm",
             "nproc_per_node": 2},
            {**BASE, "event": "train_start", "t": 123.0, "step": 5, "generation": "step-5"},
            {**BASE, "event": "start_phases", "t": 124.2, "t0": 121.6, "step": 5, "generation": "step-5",
             "phases": {"restore": 1.0, "first_step": 1.2}},
            {**BASE, "event": "steps", "t": 124.3, "first": 5, "last": 5, "loss": 2.0, "duration_s": 1.0}]
    for t in late_at:  # the dying attempt's step 8, logged after the kill
        out.append({**BASE, "event": "steps", "t": t, "first": 8, "last": 8, "loss": 2.0, "duration_s": 1.0})
    return ev.decode_all(sorted(out, key=lambda r: r["t"]))


@pytest.mark.parametrize("late_at", [[], [120.16], [121.2], [122.0], [120.16, 121.2, 122.0]],
                         ids=["none", "before-decision", "after-decision", "after-next-job-start", "all"])
def test_a_dying_attempts_late_steps_never_ends_the_next_starts_clock(late_at):
    evs = _ledger(late_at)
    naive = next(e.t - KILL for e in ev.of(evs, ev.Steps) if e.t >= KILL)  # what the bench used to print
    timed = endpoints.since(evs, KILL)
    assert timed.phases == {"ending": 0.6, "decided": 1.0, "job_start": 1.5, "train_start": 3.0,
                            "first_step": pytest.approx(4.2)}
    assert endpoints.check_order(timed) == []
    if late_at:
        assert naive == pytest.approx(late_at[0] - KILL) and naive < 3.0  # the old endpoint: before train_start
    sm = summarize(evs)  # the report reads the same: one recovery, two starts, 4.2 s to training again
    assert sm.restarts == 1 and [r.resumed_s for r in sm.recoveries] == [pytest.approx(4.2)]
    # a window logged before the next launcher is the dying start's; one after it sits in the next start's
    # group (ledger order) but before its train_start, so it is never that start's first step
    assert sum(w.last == 8 for w in sm.starts[0].windows) == sum(t < 121.5 for t in late_at)


def test_phases_out_of_order_are_named_and_a_missing_endpoint_too():
    evs = _ledger([])
    # a clock 2 s behind on the next start's launcher: its job_start before the decision
    skewed = [ev.JobStart(**{**e.__dict__, "t": 120.5}) if isinstance(e, ev.JobStart) and e.t == 121.5 else e
              for e in evs]
    bad = endpoints.check_order(endpoints.since(skewed, KILL))
    assert bad == ["job_start 0.500 s before decided 1.000 s"]
    early = endpoints.check_order(endpoints.since(evs, KILL + 1.4))  # t0 after the decision and the ending
    assert early == ["ending -0.800 s before t0", "decided -0.400 s before t0"]
    never = [e for e in evs if not (isinstance(e, ev.TrainStart) and e.t > KILL)]
    timed = endpoints.since(never, KILL)
    assert timed.first_step is None and endpoints.check_order(timed) == ["no train_start", "no first_step"]
    assert endpoints.check_order(endpoints.since(evs, 200.0)) == ["no job_start", "no train_start", "no first_step"]


def test_a_starts_own_phases_from_its_begin():
    sm = summarize(_ledger([121.2]))
    first, second = (endpoints.start_phases(s) for s in sm.starts)
    assert first.phases == {"job_start": 0.0, "train_start": 9.0, "first_step": 10.0}
    assert second.phases == {"job_start": 0.0, "train_start": 1.5, "first_step": pytest.approx(2.7)}
    assert endpoints.format_phases(second) == "job_start 0.00, train_start 1.50, first_step 2.70"
