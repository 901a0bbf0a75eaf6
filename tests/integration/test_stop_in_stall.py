"""A stop signal is honoured while a rank waits for its batch (issue 34 item 2): rank 1's read
of step 4 stalls (DSLURM_FAULT_DATA_STALL=4:1, a hung file system) while rank 0 is already in the
step's collectives; USR2 to both workers (what the launcher forwards) ends the start with a save
at step 3 on both, exit 75 -- no rank takes step 4 -- and the resumed start trains step 4 from the
same batch to the end: 0 steps lost or repeated. Also: a TERM that arrives before the first step
is agreed before it (no step is taken after a stop seen during start-up) and saves nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dslurm import checkpoint as ck
from dslurm.observe.ledger import read_events
from testkit import LoadDeadline
from train_helpers import ROOT, SITE, run_train, step_records, write_job

pytestmark = pytest.mark.integration


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def _launch(job: Path, env: dict[str, str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "train",
           "--site", str(SITE), "--job", str(job), "--site-set", "node.nvlink_domain=8"]
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", **env},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


@pytest.mark.timeout(400)
def test_usr2_during_one_ranks_data_stall_saves_the_last_step_and_resumes_exactly(tmp_path):
    job = write_job(tmp_path, "stall", steps=6)
    run = tmp_path / "stall"
    proc = _launch(job, {"DSLURM_FAULT_DATA_STALL": "4:1"})
    try:
        deadline = LoadDeadline(180, procs=2)
        while len(step_records(run)) < 3 or time.sleep(2.0):  # step 3 done; rank 1 then stalls in step 4
            assert proc.poll() is None and not deadline.expired(), proc.communicate()[0]
            time.sleep(0.2)
        assert len(step_records(run)) == 3  # nobody got past the stall
        t0 = time.monotonic()
        for pid in _children(proc.pid):
            os.kill(pid, signal.SIGUSR2)
        out, _ = proc.communicate(timeout=120)
        ended_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    evs = list(read_events(run))
    (exit_ev,) = [e for e in evs if e["event"] == "exit"]
    saves = [e["step"] for e in evs if e["event"] == "ckpt_save"]
    assert exit_ev["reason"] == "requeue" and exit_ev["step"] == 3 and saves == [3], (exit_ev, saves, out[-3000:])
    assert "the step is not taken, the run saves at step 3" in out
    assert ended_s < 60, ended_s
    resumed = run_train(2, job, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    starts = [e for e in read_events(run) if e["event"] == "train_start"]
    assert [s["step"] for s in starts] == [0, 3]
    trained = [r["last"] for r in step_records(run)]
    assert trained == [0, 1, 2, 3, 4, 5], trained  # each step once: 0 lost, 0 repeated


@pytest.mark.timeout(300)
def test_a_term_during_start_up_is_agreed_before_the_first_step_and_saves_nothing(tmp_path):
    """A stop before a start's first step has nothing to save: a fresh start's next start is the same
    fresh start, and a start that restored the pointer's generation leaves the pointer as it was.
    (A save at step 0 used to be written, and its resume trained differently: AdamW's step counter
    came back as 1, tests/integration/test_checkpoint_local.py.)"""
    job = write_job(tmp_path, "early", steps=3)
    run = tmp_path / "early"
    # the launcher's stop file: a TERM that reached this start before its handlers were installed
    status = tmp_path / "status"
    status.mkdir()
    (status / "stop").write_text("SIGTERM")
    early = {"DSLURM_STATUS_DIR": str(status)}

    def saves() -> list[int]:
        return [e["step"] for e in read_events(run) if e["event"] == "ckpt_save"]

    res = run_train(None, job, env=early, timeout=120)
    assert res.returncode == 143, res.stderr[-3000:]
    evs = list(read_events(run))
    assert step_records(run) == []  # no step was taken after the stop
    (exit_ev,) = [e for e in evs if e["event"] == "exit"]
    assert exit_ev["reason"] == "terminated" and exit_ev["step"] == 0
    assert saves() == [] and ck.read_pointer(run) is None, res.stdout[-2000:]
    assert "nothing new to save; the next start begins at step 0" in res.stdout

    res = run_train(None, job, env={"DSLURM_FAULT_STOP": "1"}, timeout=120)  # fresh again: 1 step, saved
    assert res.returncode == 75, res.stderr[-3000:]
    starts = [e for e in read_events(run) if e["event"] == "train_start"]
    assert [(s["step"], s["generation"]) for s in starts] == [(0, None), (0, None)]
    pointer = ck.read_pointer(run)
    assert saves() == [1]

    res = run_train(None, job, env=early, timeout=120)  # restored step 1, stopped before step 2
    assert res.returncode == 143, res.stderr[-3000:]
    starts = [e for e in read_events(run) if e["event"] == "train_start"]
    assert starts[-1]["step"] == 1 and starts[-1]["generation"].startswith("step-00000001")
    assert saves() == [1] and ck.read_pointer(run) == pointer  # no second copy of step 1
