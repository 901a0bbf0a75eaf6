"""The pure parts of `dslurm selftest chaos` (dslurm/selftest/chaos/): the seeded schedule, the
promises read from a ledger, the table's attribution of endings to faults, the flags. The soak on
the real cluster is tests/cluster/test_chaos_soak.py."""

from __future__ import annotations

import argparse

import pytest

from dslurm.errors import UserError
from dslurm.observe import events as ev
from dslurm.observe.report import summarize
from dslurm.selftest.chaos import promises, schedule, table
from dslurm.selftest.chaos.cli import add_arguments, soak_from
from dslurm.selftest.chaos.run import PendingWatch, replay_command

T0 = 1000.0


def test_the_schedule_is_a_function_of_its_seed():
    kinds = schedule.parse_kinds("all", spares=True)
    a, b = schedule.draw(7, 5, 15, kinds), schedule.draw(7, 5, 15, kinds)
    assert a == b and a != schedule.draw(8, 5, 15, kinds)
    gaps = [y.at_s - x.at_s for x, y in zip(a, a[1:])]
    assert all(7.5 <= g <= 22.5 for g in gaps) and a[-1].at_s < 300 and 12 <= len(a) <= 40
    assert all(0 <= f.target < 1 for f in a)
    held = [f for f in a if schedule.KINDS[f.kind][1][1]]
    assert held and all(schedule.KINDS[f.kind][1][0] <= f.hold_s <= schedule.KINDS[f.kind][1][1] for f in held)
    assert all(f.hold_s == 0 for f in a if f not in held)


def test_kinds_are_checked_and_no_spare_means_no_spare_fault():
    assert "spare_off" not in schedule.parse_kinds(None, spares=False)
    assert schedule.parse_kinds("requeue, usr2", spares=True) == ("requeue", "usr2")
    with pytest.raises(ValueError, match="unknown fault kind.*'nope'.*valid: kill_worker"):
        schedule.parse_kinds("requeue,nope", spares=True)
    assert schedule.pick(["a", "b", "c"], 0.0) == "a" and schedule.pick(["a", "b", "c"], 0.999) == "c"


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--site")
    p.add_argument("--dir")
    p.add_argument("--steps", type=int)
    p.add_argument("--timeout-s", type=float)
    add_arguments(p)
    return p.parse_args(list(argv))


def test_flags_make_a_soak_and_bad_ones_name_the_flag(tmp_path):
    s = soak_from(_args("--seed", "5", "--minutes", "2", "--every", "10", "--dir", str(tmp_path / "x")))
    assert s.seed == 5 and s.faults == schedule.draw(5, 2, 10, s.kinds) and s.plan.steps == int(120 / 0.9)
    assert "--seed 5 --minutes 2 --every 10" in replay_command(s)
    for bad, flag in ((["--minutes", "0"], "--minutes"), (["--every", "-1"], "--every"),
                      (["--kinds", "bogus"], "--kinds"), (["--site", str(tmp_path / "none.yaml")], "--site")):
        with pytest.raises(UserError, match=flag):
            soak_from(_args(*bad))


# ------------------------------------------------------------------ a ledger as the soak sees it


def _start(job: str, restart: int, t: float, resume: int, reached: int, *, saves=(), ending="completed",
           losses=None, mode="torchrun", recovery=None) -> list[ev.Event]:
    k = {"job_id": job, "restart": restart}
    out: list[ev.Event] = [ev.JobStart(t=t, mode=mode, hosts=["node1", "node2"], **k),
                           ev.TrainStart(t=t + 1, step=resume, **k)]
    for i, s in enumerate(range(resume, reached)):
        out.append(ev.Steps(t=t + 2 + i, first=s, last=s, loss=(losses or {}).get(s, float(s)), duration_s=1.0,
                            step_time_s=1.0, **k))
        if s + 1 in saves:
            out.append(ev.CkptSave(t=t + 2.5 + i, step=s + 1, **k))
    end = t + 3 + (reached - resume)
    if ending:
        out.append(ev.Ending(t=end, cls=ending, **k))
    if recovery:
        out.append(ev.Recovery(t=end + 0.1, mode=recovery, cause=ending or "", failed_t=end, **k))
    return out


def _fault(index: int, kind: str, t: float, injected: bool = True) -> dict:
    return {"index": index, "kind": kind, "t": t, "injected": injected, "detail": f"did {kind}", "at_s": t - T0,
            "target": 0.0, "hold_s": 0.0, "t_end": None}


def test_a_clean_chaos_ledger_keeps_every_promise():
    evs = [*_start("1", 0, T0, 0, 12, saves=(5, 10), ending="crash", recovery="same_nodes"),
           *_start("1", 0, T0 + 20, 10, 20, saves=(15, 20), mode="warm")]
    done = [_fault(0, "kill_worker", T0 + 10)]
    sm = summarize(evs)
    assert promises.check(sm, evs, done, steps=20, identical=None, bad_generations={}, t0=T0) == []
    (row,) = table.rows(sm, done, T0)
    assert (row.path, row.ended_it, row.lost, row.start) == ("warm", True, 2, 0)
    assert row.to_step_s is not None and row.to_step_s > 0


def test_each_broken_promise_is_named_with_the_fault_before_it():
    evs = [*_start("1", 0, T0, 0, 12, saves=(5, 10), ending="crash"),  # a crash no own fault explains
           *_start("1", 1, T0 + 20, 5, 14, saves=(), ending=None, losses={7: 99.0}),  # resumed at 5 < 10, no ending
           *_start("1", 2, T0 + 40, 14, 18, saves=(18,))]
    done = [_fault(0, "ctld_restart", T0 + 8), _fault(1, "disk_full", T0 + 25)]
    evs.append(ev.CkptFallback(t=T0 + 41, job_id="1", restart=2, rejected=["g1"]))
    sm = summarize(evs, skipped_lines=1)
    broken = promises.check(sm, evs, done, steps=20, identical="3 of 39 tensors differ", t0=T0,
                            bad_generations={"g2": ["rank0.distcp: crc32 mismatch"]})
    by = {}
    for b in broken:
        by.setdefault(b.promise, []).append(b)
    assert set(by) == {"complete", "identical", "no step twice", "every start ended", "nothing torn", "budget"}, broken
    assert any("resumed at step 5" in b.detail and "step 10 was committed" in b.detail for b in by["no step twice"])
    assert any("step 7 trained again" in b.detail for b in by["no step twice"])
    (budget,) = by["budget"]
    assert "'crash'" in budget.detail and budget.fault.startswith("#0 ctld_restart at +8.0 s")
    assert {b.detail.split(":")[0] for b in by["nothing torn"]} >= {"1 garbled line(s) in the ledger", "generation g2"}
    assert by["identical"][0].fault == "-"


def test_a_job_left_pending_for_good_is_a_broken_promise_and_a_passing_reason_is_not():
    w = PendingWatch(bound_s=60)
    w.see("PENDING", "BadConstraints", T0)
    w.see("PENDING", "Resources", T0 + 50)  # the reason changed: the clock starts again
    w.see("PENDING", "BadConstraints", T0 + 55)
    w.see("PENDING", "BadConstraints", T0 + 100)
    assert w.stuck is None
    w.see("PENDING", "Priority", T0 + 120)
    w.see("RUNNING", "None", T0 + 130)
    assert w.stuck is None
    w.see("PENDING", "BadConstraints", T0 + 200)
    w.see("PENDING", "BadConstraints", T0 + 261)
    assert w.stuck is not None and w.stuck[0] == T0 + 261 and "BadConstraints" in w.stuck[1]
    sm = summarize([*_start("1", 0, T0, 0, 20, saves=(10, 20))])
    broken = promises.check(sm, [], [_fault(0, "requeue", T0 + 150)], steps=20, identical=None,
                            bad_generations={}, t0=T0, stuck=w.stuck)
    (b,) = [b for b in broken if b.promise == "placeable"]
    assert b.at == T0 + 261 and b.fault.startswith("#0 requeue at +150.0 s")


def test_a_stopped_worker_is_credited_with_the_crash_it_caused_later():
    """SIGSTOP ends a start only once the watchdog fires; a disk fill meanwhile is not the cause."""
    evs = [*_start("1", 0, T0, 0, 12, saves=(5, 10), ending="crash", recovery="same_nodes"),
           *_start("1", 0, T0 + 20, 10, 20, saves=(20,))]
    done = [_fault(0, "stop_worker", T0 + 3), _fault(1, "disk_full", T0 + 9), _fault(2, "requeue", T0 + 30, False)]
    rows = table.rows(summarize(evs), done, T0)
    assert [(r.kind, r.ended_it, r.path) for r in rows] == [
        ("stop_worker", True, "cold"), ("disk_full", False, "absorbed"), ("requeue", False, "skipped")]
    md = table.markdown(rows, summarize(evs), ["# head"])
    assert "| stop_worker | 1 | 0 |" in md and "| 2 | 30.0 | requeue | 1 | no | skipped |" in md
    header = next(line for line in md.splitlines() if line.startswith("| kind |"))
    assert header.count("skipped") == 1, header  # a column of its own, not a path too
    assert "| requeue | 0 | 1 | 0 | 0 | 0 | - |" in md, md


def test_a_readmitted_blocklist_belongs_to_the_start_whose_requeue_wrote_it():
    """`dslurm selftest chaos` (seed 4343): requeue-me writes `blocklist_waived` after its decision;
    read as a start of its own, every such requeue left a start "without an ending"."""
    evs = [*_start("1", 0, T0, 0, 6, saves=(5,), ending="crash"),
           ev.Requeue(t=T0 + 7, job_id="1", restart=0, decision="requeue", ending="crash"),
           ev.BlocklistWaived(t=T0 + 7.1, job_id="1", restart=0, hosts=["node1"], reason="3 of 3"),
           *_start("1", 1, T0 + 20, 5, 10, saves=(10,))]
    sm = summarize(evs)
    assert [s.ending for s in sm.starts] == ["crash", "completed"]
    assert [len(s.all(ev.BlocklistWaived)) for s in sm.starts] == [1, 0]
    assert promises.check(sm, evs, [_fault(0, "kill_worker", T0 + 4)], steps=10, identical=None,
                          bad_generations={}, t0=T0) == []


def test_a_late_ending_joins_the_last_job_step_of_its_incarnation():
    """`dslurm selftest chaos` (seed 209): a crash recovered in the allocation (step 0 ended, step 1
    started), then `scontrol requeue` killed the batch shell before step 1's ending was written; the
    next start wrote it late. It describes step 1, not step 0 (which had its own)."""
    evs = [*_start("1", 0, T0, 0, 6, saves=(5,), ending="crash", recovery="same_nodes"),
           ev.JobStart(t=T0 + 20, job_id="1", restart=0, mode="torchrun", hosts=["node1", "node2"]),
           *_start("1", 1, T0 + 60, 5, 10, saves=(10,), ending=None),
           ev.Ending(t=T0 + 75, job_id="1", restart=0, cls="preempted", late=True),
           ev.Ending(t=T0 + 76, job_id="1", restart=1, cls="completed")]
    sm = summarize(evs)
    assert [s.ending for s in sm.starts] == ["crash", "preempted", "completed"]
    assert promises.check(sm, evs, [_fault(0, "kill_worker", T0 + 4), _fault(1, "requeue", T0 + 30)], steps=10,
                          identical=None, bad_generations={}, t0=T0) == []


def test_a_fault_belongs_to_the_start_running_until_the_next_one_begins():
    """`--mode script`, seed 209: a recovered step that logged little before `scontrol requeue` ended it
    still owns the faults until the requeued start begins; the requeue is credited with its ending."""
    evs = [*_start("1", 0, T0, 0, 6, saves=(5,), ending="crash", recovery="same_nodes"),
           ev.JobStart(t=T0 + 20, job_id="1", restart=0, mode="torchrun", hosts=["node1", "node2"]),
           *_start("1", 1, T0 + 60, 5, 10, saves=(10,), ending=None),
           ev.Ending(t=T0 + 75, job_id="1", restart=0, cls="preempted", late=True),
           ev.Ending(t=T0 + 76, job_id="1", restart=1, cls="completed")]
    done = [_fault(0, "kill_worker", T0 + 4), _fault(1, "stop_worker", T0 + 30), _fault(2, "requeue", T0 + 40)]
    rows = table.rows(summarize(evs), done, T0)
    assert [(r.start, r.ended_it, r.path) for r in rows] == [(0, True, "cold"), (1, False, "absorbed"),
                                                             (1, True, "requeue")]


def test_a_disk_full_fault_that_cannot_be_mounted_is_refused_not_skipped(tmp_path):
    """Issue 54: a schedule with disk_full whose tmpfs cannot be mounted used to skip every
    disk_full fault with a log line. Now it is an exit 2 naming the fix; a schedule without
    disk_full mounts nothing. (The mount fails here through a size tmpfs rejects, root or not.)"""
    from dslurm.errors import UserError
    from dslurm.selftest.chaos.run import mount_durable

    assert mount_durable(tmp_path / "none", 128, ()) is None and not (tmp_path / "none").exists()
    with pytest.raises(UserError, match=r"cannot mount a -1 MB tmpfs .*--kinds kill_worker,requeue$"):
        mount_durable(tmp_path / "bad", -1, ("kill_worker", "disk_full", "requeue"))
