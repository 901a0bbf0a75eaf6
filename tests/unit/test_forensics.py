"""Issue 37's pure parts: the Flight Recorder dumps read (who did not enter collective #N of group
G), the straggler split (arrival lateness per part, NVRx relative scores), the OOM ending and its
fix, the profile request, and the report/doctor lines. Milliseconds; the real runs are in
tests/integration/test_collective_forensics.py."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest

from dslurm import endings as E
from dslurm import exitcodes as X
from dslurm import faults, health
from dslurm.endings.facts import StartFacts
from dslurm.endings.worker_exit import Outcome, is_oom
from dslurm.errors import UserError
from dslurm.observe import ctl, forensics, perfdoctor, perflines, slowrank
from dslurm.observe import events as ev
from dslurm.observe.report import summarize
from dslurm.requeue import decide
from dslurm.requeue.oom import oom_fix
from dslurm.run import RunDir

ROOT = Path(__file__).resolve().parents[2]


def entry(group: str, seq: int, op: str = "gloo:all_gather", *, retired: bool = True, t: int = 0,
          desc: str = "default_pg", p2p: bool = False) -> dict:
    """One Flight Recorder entry as torch 2.13 dumps it (the keys the readers use)."""
    return {"process_group": [group, desc], "collective_seq_id": 0 if p2p else seq, "p2p_seq_id": seq if p2p else 0,
            "is_p2p": p2p, "profiling_name": op, "input_sizes": [[8]], "retired": retired,
            "time_created_ns": t, "state": "scheduled"}


def dump(entries: list[dict], groups: dict[str, list[int]]) -> dict:
    return {"version": "2.10", "entries": entries,
            "pg_config": {g: {"name": g, "desc": "", "ranks": str(r)} for g, r in groups.items()}}


def test_group_states_read_entered_completed_and_inside():
    d = dump([entry("0", 1), entry("0", 2), entry("0", 3, "gloo:reduce_scatter", retired=False, t=30),
              entry("1", 4, "gloo:send", retired=False, p2p=True)], {"0": [0, 1], "1": [0, 1], "7": [0, 2]})
    s = forensics.group_states(d)
    g = s["0"]
    assert (g.entered, g.completed, g.inside, g.op, g.t_ns, g.ranks) == (3, 2, True, "gloo:reduce_scatter", 30, [0, 1])
    assert s["1"].p2p_inside == ["gloo:send #4"] and not s["1"].inside
    assert s["7"].entered == 0 and s["7"].ranks == [0, 2]  # a group never used still lists its members
    assert forensics.from_note(json.loads(json.dumps(forensics.to_note(s)))) == s
    assert forensics.from_note({"x": {"bogus": 1}}) == {} and forensics.from_note("garbled") == {}


def test_the_rank_that_did_not_enter_is_named_with_op_and_seq():
    # rank 1 stalled in compute between FSDP's all-gathers: it finished #58, rank 0 waits in #59
    r0 = forensics.group_states(dump([entry("0", 58), entry("0", 59, retired=False, t=100)], {"0": [0, 1]}))
    r1 = forensics.group_states(dump([entry("0", 58)], {"0": [0, 1]}))
    who, why, found = forensics.verdict({0: r0, 1: r1}, 2)
    assert who == [1]
    assert found[0].missing == [1] and found[0].waiting == [0] and found[0].seq == 59 and found[0].behind == {"1": 58}
    assert why == ("rank(s) [1] did not enter collective #59 (gloo:all_gather [[8]]) of group 0 (default_pg) "
                   "(rank 1 at #58) while rank(s) [0] wait inside it")


def test_a_rank_waiting_elsewhere_is_a_victim_and_silent_ranks_are_named():
    # rank 1 computes; rank 0 waits for it in group 0; ranks 2, 3 wait for rank 0 in group 1
    g0 = {"0": [0, 1]}
    g1 = {"1": [0, 2, 3]}
    r0 = forensics.group_states(dump([entry("0", 5, retired=False, t=10), entry("1", 2, desc="dp", t=1)], g0 | g1))
    r1 = forensics.group_states(dump([entry("0", 4)], g0))
    r2 = forensics.group_states(dump([entry("1", 3, retired=False, t=20, desc="dp")], g1))
    who, why, found = forensics.verdict({0: r0, 1: r1, 2: r2}, 4)
    assert who == [1, 3]  # rank 0 is missing from group 1's #3 but waits inside group 0: not a root
    assert "rank(s) [1] did not enter collective #5" in why and "rank(s) [3] left no flight-recorder dump" in why
    assert {s.group for s in found} == {"0", "1"}


def test_every_member_inside_the_same_collective_names_nobody_and_op_mismatch_is_said():
    a = forensics.group_states(dump([entry("0", 7, "gloo:all_reduce", retired=False, t=5)], {"0": [0, 1]}))
    b = forensics.group_states(dump([entry("0", 7, "gloo:broadcast", retired=False, t=6)], {"0": [0, 1]}))
    who, why, found = forensics.verdict({0: a, 1: b}, 2)
    assert who == [] and why == ""
    assert "every member is inside" in found[0].sentence() and found[0].ops_differ == ["gloo:all_reduce",
                                                                                       "gloo:broadcast"]
    assert forensics.verdict({}, 2) == ([], "", [])


def test_read_dumps_skips_garbage(tmp_path):
    (tmp_path / "fr").mkdir()
    (tmp_path / "fr" / "rank-00001").write_bytes(pickle.dumps(dump([entry("0", 3)], {"0": [0, 1]})))
    (tmp_path / "fr" / "rank-00002").write_bytes(b"not a pickle")
    got = forensics.read_dumps(tmp_path)
    assert list(got) == [1] and got[1]["0"].entered == 3
    assert forensics.read_dumps(tmp_path / "none") == {}


def test_the_flight_recorder_is_on_unless_the_user_chose():
    env: dict[str, str] = {}
    assert health.enable_flight_recorder(env) and env == {"TORCH_FR_BUFFER_SIZE": str(health.FR_ENTRIES)}
    for mine in ({"TORCH_FR_BUFFER_SIZE": "0"}, {"TORCH_NCCL_TRACE_BUFFER_SIZE": "100"}):
        before = dict(mine)
        assert not health.enable_flight_recorder(mine) and mine == before


# ------------------------------------------------------------------ the straggler split

MS = 1_000_000


def rank_step(rank: int, spans: list[tuple[str, int, int]], arrivals: list[tuple[int, int]]) -> slowrank.RankStep:
    return slowrank.RankStep(rank=rank, host=f"n{rank}", step_s=(spans[-1][2] - spans[0][1]) / 1e3,
                             spans=[(n, a * MS, b * MS) for n, a, b in spans],
                             arrivals=[("0", seq, t * MS) for seq, t in arrivals])


def test_a_rank_slow_in_data_makes_the_others_wait_in_compute():
    # rank 1 reads its batch for 300 ms; rank 0 enters the first all-gather at 10 ms and waits
    r0 = rank_step(0, [("data", 0, 10), ("compute", 10, 420), ("optimizer", 420, 430)],
                   [(1, 11), (2, 330), (3, 425)])
    r1 = rank_step(1, [("data", 0, 300), ("compute", 300, 420), ("optimizer", 420, 430)],
                   [(1, 301), (2, 331), (3, 426)])
    parts, scores, slow = slowrank.causes([r0, r1])
    assert slow == [{"rank": 1, "host": "n1", "part": "data", "behind_s": 0.29, "score": scores[1]["data"],
                     "part_s": 0.3}]
    # rank 0 waited 290 + 1 ms in compute and 1 ms in the optimizer's collective: taken out of both
    assert parts[0] == pytest.approx({"data": 0.01, "compute": 0.41 - 0.291, "optimizer": 0.009,
                                      "collective_wait": 0.292})
    assert scores[1]["data"] == round(0.01 / 0.3, 3) and scores[0]["data"] == 1.0  # NVRx: best / this rank
    assert slowrank.sentence(slow[0]).startswith("rank 1 (n1) slow in data: 0.290 s behind the others")


def test_a_rank_slow_in_compute_is_named_in_compute_and_async_lateness_is_counted_once():
    # rank 1 computes a layer 200 ms longer; its later (async) arrivals carry the lateness along
    r0 = rank_step(0, [("data", 0, 5), ("compute", 5, 400), ("optimizer", 400, 410)],
                   [(1, 6), (2, 50), (3, 60), (4, 402)])
    r1 = rank_step(1, [("data", 0, 5), ("compute", 5, 400), ("optimizer", 400, 410)],
                   [(1, 6), (2, 250), (3, 261), (4, 401)])
    _, _, slow = slowrank.causes([r0, r1])
    assert [(s["rank"], s["part"], s["behind_s"]) for s in slow] == [(1, "compute", 0.201)]
    assert slowrank.causes([r0])[2] == []  # one rank: nothing to compare


def test_a_small_difference_is_not_a_straggler():
    r0 = rank_step(0, [("data", 0, 1), ("compute", 1, 100)], [(1, 2)])
    r1 = rank_step(1, [("data", 0, 3), ("compute", 3, 100)], [(1, 4)])
    assert slowrank.causes([r0, r1])[2] == []  # 2 ms behind of a 100 ms step: below MIN_SHARE


# ------------------------------------------------------------------ out of memory


class OutOfMemoryError(RuntimeError):
    """torch.OutOfMemoryError's name, without torch (the classification reads the name)."""


def test_an_oom_is_reported_as_oom_ends_as_oom_and_is_not_retried():
    out = Outcome()
    out.failed(OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert out.kind == "oom" and is_oom(OutOfMemoryError()) and not is_oom(RuntimeError())
    ranks = [{"rank": 1, "kind": "oom", "code": 1, "step": 4, "t": 10.0, "host": "n1",
              "error": "OutOfMemoryError: CUDA out of memory"},
             {"rank": 0, "kind": "peer_lost", "code": 1, "step": 4, "t": 11.0, "host": "n0",
              "error": "Connection closed by peer"}]
    facts = StartFacts(name="1.0", batch_signals=[], launchers=[], ending=None, ranks=ranks)
    ending = E.classify(facts, E.SlurmView(state="RUNNING"))
    assert ending.cls == E.OOM and ending.origin_rank == 1, ending
    d = decide(ending=ending.cls, failures=0, max_restarts=3, no_progress_limit=3, start_steps=[0], pointer_step=0,
               detail="Fix: ...")
    assert (d.action, d.exit_code) == ("stop", X.OOM) and "not retried" in d.reason


def test_the_oom_fix_comes_from_the_planner(tmp_path):
    (tmp_path / "job.yaml").write_text(
        f"name: j\nnodes: 1\nmodel:\n  preset: tiny\ntrain:\n  steps: 4\n  global_batch: 8\n"
        f"checkpoint:\n  run_dir: {tmp_path}\npreflight:\n  enabled: false\n")
    shutil.copy(ROOT / "site-configs" / "local.yaml", tmp_path / "site.yaml")
    fix = oom_fix(tmp_path)
    assert "the planner estimates" in fix and "within its estimate" in fix and "activation_checkpoint=full" in fix
    assert f"`dslurm plan --site {tmp_path / 'site.yaml'} --job {tmp_path / 'job.yaml'}`" in fix
    assert "could not propose" in oom_fix(tmp_path / "gone")  # never raises into requeue-me


# ------------------------------------------------------------------ profile requests, knobs


def test_a_profile_request_carries_its_steps(tmp_path):
    (tmp_path / "job.yaml").write_text("name: x\n")
    req = ctl.write_request(tmp_path, "profile", user="ana", steps=4)
    got = ctl.Poller(tmp_path, every_s=0).take()
    assert got == req and got.steps == 4
    assert ctl.parse(json.dumps({"action": "profile"})).steps == 0  # the job's health.profile_steps
    assert ctl.parse(json.dumps({"action": "profile", "steps": True})).steps == 0
    with pytest.raises(UserError, match="--steps -1"):
        ctl.write_request(tmp_path, "profile", steps=-1)


def test_slow_knobs_are_seconds_for_the_named_ranks():
    env = {"DSLURM_FAULT_SLOW_DATA": "0.3:1", "RANK": "1"}
    assert faults.seconds_fault("DSLURM_FAULT_SLOW_DATA", env) == 0.3
    assert faults.seconds_fault("DSLURM_FAULT_SLOW_DATA", {**env, "RANK": "0"}) == 0.0


# ------------------------------------------------------------------ report and doctor


def test_report_and_doctor_lines(tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / "rank-00000.trace.json.gz").write_bytes(b"x")
    cause = {"rank": 1, "host": "n1", "part": "data", "behind_s": 0.3, "score": 0.05, "part_s": 0.31}
    stall = forensics.Stall(group="0", desc="default_pg", seq=59, op="gloo:all_gather", sizes=[], waiting=[0],
                            missing=[1], behind={"1": 58}, silent=[]).as_dict()
    evs = [ev.TrainStart(t=1.0, step=0), ev.Stragglers(t=2.0, step=1, causes=[cause], parts={"1": {"data": 0.31}}),
           ev.Stragglers(t=3.0, step=2, causes=[cause]),
           ev.Hang(t=4.0, step=2, flight=[stall], flight_dir="/r/starts/1.0/fr",
                   collectives={"0": {"c10d": [{"group": "0", "seq": 59, "op": "gloo:all_gather", "inside": True}]}}),
           ev.Profile(t=5.0, first_step=2, last_step=3, dir=str(tmp_path / "p"), view="perfetto",
                      files=["rank-00000.trace.json.gz", "rank-00001.trace.json.gz"]),
           ev.Oom(t=6.0, rank=1, step=4, phase="compute", error="CUDA out of memory", memory={"reserved_gib": 70.5})]
    lines = perflines.lines(0, evs)
    assert "  collective: rank(s) [1] did not enter collective #59 (gloo:all_gather) of group 0 (default_pg) " \
           "(rank 1 at #58) while rank(s) [0] wait inside it" in lines
    assert any(line.startswith("slow rank in start 0: rank 1 (n1) slow in data") and "(2 of 2" in line
               for line in lines), lines
    assert any("profile of steps 2..3" in line and "1 of 2 file(s)" in line for line in lines), lines
    assert any(line.startswith("out of memory in start 0: rank 1 at step 4 in compute") for line in lines), lines
    starts = summarize(evs).starts
    rows = {r[0]: r for r in perfdoctor.checks(starts)}
    assert "slow rank on n1: its data in 2 checks" in rows and "input path" in rows[
        "slow rank on n1: its data in 2 checks"][2]
    oom = next(r for s, r in rows.items() if s.startswith("out of memory"))
    assert any("reserved 70.50 GiB" in x for x in oom[1]), oom
    hang_ev = perfdoctor.hang_evidence(next(ev.of(evs, ev.Hang)))
    assert any("rank 0 c10d: #59 gloo:all_gather of group 0 (inside)" == x for x in hang_ev), hang_ev


def test_doctor_reads_dumps_no_hang_event_read(tmp_path):
    fr = tmp_path / "starts" / "7.0" / "fr"
    fr.mkdir(parents=True)
    (fr / "rank-00000").write_bytes(pickle.dumps(dump([entry("0", 3, retired=False, t=1)], {"0": [0, 1]})))
    (fr / "rank-00001").write_bytes(pickle.dumps(dump([entry("0", 2)], {"0": [0, 1]})))
    (row,) = perfdoctor.dump_rows(tmp_path, [])
    assert row[0] == "collective stall in start 7.0: suspect rank(s) [1]" and "did not enter collective #3" in row[2]
    assert perfdoctor.dump_rows(tmp_path, [ev.Hang(flight_dir=str(fr))]) == []  # the hang event shows it already


def test_profile_fields_are_checked():
    from dslurm.config import load_job

    with pytest.raises(UserError, match="health.profile_steps.*at least 1"):
        load_job(data={"name": "j", "nodes": 1}, overrides=["health.profile_steps=0"])
    with pytest.raises(UserError, match="health.profile_at"):
        load_job(data={"name": "j", "nodes": 1}, overrides=["health.profile_at=-1"])
    assert load_job(data={"name": "j", "nodes": 1}, overrides=["health.profile_at=4"]).health.profile_at == 4


def test_profile_windows_queue_in_step_order_and_overlaps_are_dropped(tmp_path):
    import torch

    from train.profile import StepProfiler

    prof = StepProfiler(run=RunDir(tmp_path), start="1.0", rank=0, world=2, device=torch.device("cpu"), at=4, steps=1)
    prof.request(2, after=1, why="dslurm ctl profile")  # steps 2..3, before the job's step 4
    prof.request(3, after=2, why="again")  # 3..5 overlaps both: dropped
    prof.request(0, after=10, why="later")  # 0: the job's profile_steps (1)
    assert prof.pending == [(2, 3, "dslurm ctl profile"), (4, 4, "job (health.profile_at)"), (11, 11, "later")]
    prof.before_step(5)  # resumed past 2..4: those are not profiled, nothing starts
    assert prof.pending == [(11, 11, "later")] and not prof.active


def test_ctl_profile_on_the_command_line(tmp_path, capsys):
    from dslurm.cli import main

    (tmp_path / "job.yaml").write_text("name: x\n")
    assert main(["ctl", str(tmp_path), "profile", "--steps", "2"]) == 0
    assert "profile of the next 2 step(s) requested" in capsys.readouterr().out
    assert ctl.parse((tmp_path / ctl.REQUEST).read_text()).steps == 2
    assert main(["ctl", str(tmp_path), "save", "--steps", "2"]) == 2
    assert "--steps is for profile only" in capsys.readouterr().err


def test_dumps_taken_after_the_collective_failed_still_name_who_did_not_enter():
    # an own script: rank 0's all-reduce #4 failed when rank 1 (which never entered it) went away
    r0 = forensics.group_states(dump([entry("0", 3), entry("0", 4, "gloo:all_reduce", t=9)], {"0": [0, 1]}))
    r1 = forensics.group_states(dump([entry("0", 3)], {"0": [0, 1]}))
    who, why, (stall,) = forensics.verdict({0: r0, 1: r1}, 2)
    assert who == [1] and not stall.live and why.endswith("rank(s) [0] entered it and it failed there"), why
    # a member with no entry of a group at all may only have had it evicted: not named from that
    r2 = forensics.group_states(dump([entry("5", 1)], {"0": [0, 1], "5": [0, 1]}))
    assert forensics.verdict({0: r0, 1: r2}, 2)[0] == []
