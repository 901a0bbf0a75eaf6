"""A warm restart for real (dslurm/launch/warm.py), without Slurm: `dslurm launch` with a
one-node SLURM_* environment. The first attempt starts cold (torchrun) and rank 1 crashes before
step 5; the second attempt's workers are forked by a preloaded pool. It resumes from the save at
step 4 and completes with the loss of every step equal, bit for bit, to an uninterrupted run's:
nothing of the failed attempt (process group, RNG, module state) reached the warm one. The warm
start imports nothing heavy (its `imports` phase is near zero) and the ledger labels it warm."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dslurm.launch import warm
from dslurm.observe import events as ev
from dslurm.observe.phases import tables
from train_helpers import ROOT, SITE, run_train, step_records, write_job

STEPS = 8


def _launch(job: Path, run_dir: Path, step_index: int, extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "localhost",
           "SLURM_NNODES": "1", "SLURM_NODEID": "0", "DSLURM_RUN_DIR": str(run_dir),
           "DSLURM_STEP_INDEX": str(step_index), **extra}
    cmd = [sys.executable, "-m", "dslurm", "launch", "--nproc-per-node", "2", "--rdzv", "static", "--",
           sys.executable, "-m", "train", "--site", str(SITE), "--job", str(job),
           "--site-set", "node.nvlink_domain=8", "--set", "checkpoint.interval=2"]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.timeout(600)
def test_warm_restart_after_a_crash_matches_an_uninterrupted_run(tmp_path):
    ref_job = write_job(tmp_path, "ref", steps=STEPS)
    ref = run_train(2, ref_job, "checkpoint.interval=2", timeout=180)
    assert ref.returncode == 0, ref.stderr[-3000:]
    job = write_job(tmp_path, "warm", steps=STEPS)
    run_dir = tmp_path / "warm"
    sock = warm.socket_path("4242", "localhost", str(tmp_path))
    pool = subprocess.Popen([sys.executable, "-m", "dslurm.launch.warm", "--job", "4242", "--host", "localhost",
                             "--socket", str(sock), "--module", "train"], cwd=ROOT,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)})
    try:
        first = _launch(job, run_dir, 0, {"DSLURM_FAULT_CRASH": "5:1@0.0"})
        assert first.returncode != 0, first.stderr[-3000:]
        deadline = time.monotonic() + 120
        while not sock.exists():
            assert pool.poll() is None and time.monotonic() < deadline, "the pool did not come up"
            time.sleep(0.1)
        second = _launch(job, run_dir, 1, {warm.WARM_ENV: "1", "TMPDIR": str(tmp_path)})
        assert second.returncode == 0, second.stderr[-5000:]
        assert "warm start: workers" in second.stderr
    finally:
        pool.terminate()
        pool.wait(30)
    losses = {r["last"]: r["loss"] for r in step_records(run_dir)}  # the second attempt's win
    assert losses == {r["last"]: r["loss"] for r in step_records(tmp_path / "ref")}
    evs = ev.read(run_dir)
    assert [e.mode for e in ev.of(evs, ev.JobStart)] == ["torchrun", "warm"]
    cold, hot = tables(evs)
    assert hot.step == 4 and not hot.cold and hot.warm and not cold.warm
    assert (hot.seconds("imports") or 0) < 0.2 < (cold.seconds("imports") or 0), (cold.rows, hot.rows)
