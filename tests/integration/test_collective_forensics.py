"""Why a job hangs or crawls (issue 37), with real torchrun + gloo + FSDP2, two runs of 2 ranks:

1. rank 0 slow in its data, rank 1 slow in its compute (straggler checks every step), then rank 1
   stalls inside the forward pass of step 4, between FSDP's collectives: the hang event names
   rank 1 with the c10d op and sequence number it did not enter, each rank's dump is readable by
   PyTorch's own flight-recorder analyser (which says the same), and every straggler check
   names rank 0 slow in data and rank 1 slow in compute;
2. `dslurm ctl RUN profile --steps 2` on the running job, and the job's `health.profile_at: 4`: a
   trace per rank with the step ranges each;
   then rank 1 runs out of memory at step 5: the oom event (step, phase), the rank's report
   `oom`, the ending `oom`, and requeue-me's stop (82) with the planner's fix, not a retry;
3. an own script on dslurm.runtime (tests/integration/fr_script.py) whose rank 1 fails before
   all-reduce #4: both ranks dump as they fail, and doctor names rank 1 with the op and #.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dslurm import endings as E
from dslurm import exitcodes as X
from dslurm.endings.facts import list_starts, read_start
from dslurm.observe import ctl, doctor, perfdoctor, report
from dslurm.observe import events as ev
from dslurm.requeue import decide_for
from train_helpers import SITE, run_train, write_job

pytestmark = [pytest.mark.integration, pytest.mark.timeout(400)]

FAST_WATCHDOG = ("health.hang_k=3", "health.hang_floor_s=2", "health.hang_ceiling_s=30")


def test_a_rank_stalled_between_fsdp_collectives_is_named_with_op_and_seq_and_slow_parts_are_split(tmp_path, caplog):
    job = write_job(tmp_path, "stall", steps=8)
    proc = run_train(2, job, *FAST_WATCHDOG, "train.straggler_every=1", timeout=200,
                     env={"DSLURM_FAULT_STALL": "4:1", "DSLURM_FAULT_SLOW_DATA": "0.3:0",
                          "DSLURM_FAULT_SLOW_COMPUTE": "0.6:1"})
    assert "exitcode  : 80" in proc.stderr, proc.stderr[-3000:]
    run = tmp_path / "stall"
    events = ev.read(run)
    (h,) = list(ev.of(events, ev.Hang))
    assert h.suspects == [1] and h.step == 3, h
    # the trainer's own notes see both ranks inside forward_backward; the c10d record tells them apart
    assert h.collectives["0"]["name"] == h.collectives["1"]["name"] == "forward_backward"
    (stall, *_) = h.flight
    assert stall["missing"] == [1] and stall["waiting"] == [0] and stall["op"].startswith("gloo:"), stall
    seq, group = stall["seq"], stall["group"]
    assert f"collective #{seq} ({stall['op']}" in h.why and "rank(s) [1] did not enter" in h.why, h.why
    pos = {r: {c["group"]: c for c in h.collectives[r]["c10d"]} for r in ("0", "1")}
    assert pos["0"][group]["seq"] == seq and pos["0"][group]["inside"], pos  # rank 0 waits inside #seq
    assert pos["1"][group]["seq"] == seq - 1 and not pos["1"][group]["inside"], pos  # rank 1 never entered it
    (start,) = list_starts(run)
    assert h.flight_dir == str(start / "fr") and sorted(p.name for p in (start / "fr").iterdir()) == [
        "rank-00000", "rank-00001"]
    from torch.distributed.flight_recorder import fr_trace  # PyTorch's own analyser, as `python -m` runs it

    with caplog.at_level(logging.INFO, logger="Flight Recorder"):
        fr_trace.main([h.flight_dir])
    said = caplog.text
    assert f"sequence number: {seq}" in said and "missing ranks: {1}" in said, said[-3000:]
    kinds = {r["rank"]: r["kind"] for r in read_start(start).ranks}
    assert kinds == {0: "peer_lost", 1: "crash"}, kinds
    # the straggler checks of the steps after the first (warm-up): rank 0 in data, rank 1 in compute
    checks = list(ev.of(events, ev.Stragglers))[1:]
    assert len(checks) >= 2, checks
    for e in checks:
        named = {(c["rank"], c["part"]) for c in e.causes}
        assert named == {(0, "data"), (1, "compute")}, (e.causes, e.parts)
        assert e.parts["1"]["collective_wait"] > e.parts["0"]["data"] * 0.5, e.parts  # rank 1 waits for rank 0
        assert e.scores["0"]["data"] < 0.7 and e.scores["1"]["compute"] < 0.7, e.scores
    found = {f.symptom: f for f in doctor.diagnose(events)}
    hang = next(f for s, f in found.items() if s.startswith("hang during training"))
    assert any(f"did not enter collective #{seq}" in x for x in hang.evidence), hang.evidence
    assert any("fr_trace" in x for x in hang.evidence), hang.evidence
    for part in ("data", "compute"):  # doctor maps each to the seed's straggler rows
        assert any(s.startswith(f"slow rank on {h.suspect_hosts[0]}: its {part}") for s in found), list(found)
    lines = report.health_lines(report.summarize(events).starts)
    assert any(line.startswith("  collective: rank(s) [1] did not enter") for line in lines), lines
    assert any("slow in compute" in line for line in lines) and any("slow in data" in line for line in lines), lines


def test_ctl_profile_leaves_a_trace_per_rank_and_an_oom_ends_as_oom_with_the_plans_fix(tmp_path):
    job = write_job(tmp_path, "prof", steps=8)
    run = tmp_path / "prof"
    run.mkdir()
    shutil.copy(SITE, run / "site.yaml")  # what `dslurm submit` freezes: requeue-me plans from it
    shutil.copy(job, run / "job.yaml")
    ctl.write_request(run, "profile", user="ana", steps=2)  # taken at the first step boundary
    # and the job's own option: step 4 alone (health.profile_at)
    proc = run_train(2, job, "health.profile_at=4", "health.profile_steps=1", env={"DSLURM_FAULT_OOM": "5:1"},
                     timeout=200)
    assert proc.returncode != 0, proc.stderr[-3000:]
    events = ev.read(run)
    (req,) = list(ev.of(events, ev.OperatorRequest))
    assert req.action == "profile" and req.user == "ana" and req.step == 1, req
    (p, job_p) = list(ev.of(events, ev.Profile))
    assert (p.first_step, p.last_step, p.why) == (2, 3, "dslurm ctl profile"), p
    assert (job_p.first_step, job_p.last_step, job_p.why) == (4, 4, "job (health.profile_at)"), job_p
    for prof, want in ((p, {"dslurm step 2", "dslurm step 3"}), (job_p, {"dslurm step 4"})):
        assert prof.files == ["rank-00000.trace.json.gz", "rank-00001.trace.json.gz"], prof
        for name in prof.files:
            trace = json.loads(gzip.decompress((tmp_path / prof.dir / name).read_bytes()))
            steps = {e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("dslurm step")}
            assert steps == want, (prof, steps)
    lines = report.health_lines(report.summarize(events).starts)
    assert any("profile of steps 2..3" in line and "2 of 2 file(s)" in line and "perfetto" in line
               for line in lines), lines
    (oom,) = list(ev.of(events, ev.Oom))
    assert oom.rank == 1 and oom.step == 5 and oom.phase == "compute" and oom.collective == "forward_backward", oom
    (start,) = list_starts(run)
    facts = read_start(start)
    assert {r["rank"]: r["kind"] for r in facts.ranks}[1] == "oom", facts.ranks
    assert json.loads((start / "oom-rank-00001.json").read_text())["phase"] == "compute"
    ending = E.classify(facts, E.SlurmView(state="RUNNING"))
    assert ending.cls == E.OOM and ending.origin_rank == 1, ending
    policy = SimpleNamespace(max_restarts=3, no_progress_limit=3, max_stray_stops=3)
    d = decide_for(events, run, "1", ending, policy, in_chain=False, requeue_enabled=True)
    assert d.action == "stop" and d.exit_code == X.OOM, d
    assert "not retried" in d.reason and "dslurm plan --site" in d.reason and "GB" in d.reason, d.reason


def test_an_own_script_on_dslurm_runtime_dumps_and_doctor_names_who_did_not_enter(tmp_path):
    run = tmp_path / "own"
    run.mkdir()
    shutil.copy(SITE, run / "site.yaml")
    (run / "job.yaml").write_text("name: own\nnodes: 1\nentry: [fr_script.py]\n")
    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(Path(__file__).with_name("fr_script.py"))]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DSLURM_RUN_DIR": str(run), "PYTHONPATH": str(root)}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode != 0, proc.stderr[-2000:]
    (start,) = list_starts(run)
    (row,) = perfdoctor.dump_rows(run, ev.read(run))
    # rank 1 left before all-reduce #4: rank 0 waited inside it (its dump, written as it failed)
    assert row[0] == f"collective stall in start {start.name}: suspect rank(s) [1]", (row, proc.stderr[-2000:])
    assert "rank(s) [1] did not enter collective #4 (gloo:all_reduce [[4]])" in row[2], row
