"""A stop signal is honoured whatever the training processes are doing
(issue 34 item 2), on the local cluster, one job for the scenarios (cheap): MLflow at a server on
127.0.0.1 that never answers waits in its open for the whole run (the tracker call), and

- start 0: rank 1's read of step 4 stalls (DSLURM_FAULT_DATA_STALL=4:1@0, a hung file system)
  while rank 0 waits in the step's collectives; USR2 to the batch shell: saved at step 3 (no
  rank took step 4), requeued;
- start 1: TERM (an external `scontrol requeue`: Slurm's preemption) while the periodic async save
  of step 5 is in flight (the knob holds it open 8 s) and the tracker still waits: the stop's save
  waits for it, then saves at the step agreed; requeued;
- start 2 completes. Every step is trained exactly once: 0 lost.
"""

from __future__ import annotations

import subprocess
import time

import pytest

from cluster_jobs import endings, events, job_spec, logs, submit, trained_steps, wait_for
from dslurm import slurm
from outage_servers import silent_server

pytestmark = pytest.mark.cluster


def _steps(run, restart: int) -> int:
    return max([e["last"] for e in events(run, "steps") if e["restart"] == restart], default=-1)


def _signal_batch(sig: str, job: int, env: dict[str, str]) -> None:
    subprocess.run(["scancel", f"--signal={sig}", "--batch", str(job)], env={**env, "PATH": "/usr/bin:/bin"},
                   check=True)


@pytest.mark.timeout(600)
def test_usr2_in_a_data_stall_then_term_in_a_tracker_wait_save_requeue_and_lose_nothing(slurm_cluster, cli,
                                                                                         tmp_path):
    env = slurm_cluster.env()
    run = tmp_path / "anywhere"
    with silent_server() as url:
        spec = job_spec(tmp_path, "anywhere", nodes=1, tp=2, steps=14, interval=5, sleep=0.3,
                        checkpoint={"async_save": True},
                        env={"DSLURM_FAULT_DATA_STALL": "4:1@0", "DSLURM_FAULT_SAVE_SLEEP": "8"},
                        metrics={"trackers": ["mlflow"], "mlflow_uri": url, "tracker_timeout_s": 600})
        job = submit(cli, env, spec)
        wait_for(lambda: _steps(run, 0) >= 2, 240, "start 0 at its stall")
        time.sleep(3)  # rank 1 is in its stalled read, rank 0 in the step's collectives
        assert _steps(run, 0) == 2
        _signal_batch("USR2", job, env)
        wait_for(lambda: [e for e in events(run, "train_start") if e["restart"] == 1], 240, "start 1")
        wait_for(lambda: _steps(run, 1) >= 5, 240, "start 1 past its async save of step 5")
        assert 5 not in [e["step"] for e in events(run, "ckpt_save")]  # still in flight
        slurm.run_cmd(["scontrol", "requeue", str(job)], env=env)
        wait_for(lambda: [e for e in events(run, "train_start") if e["restart"] == 2], 240, "start 2")
        assert slurm.wait_job(job, timeout=300, env=env) == "COMPLETED", logs(run)
    exits = events(run, "exit")
    assert [e["reason"] for e in exits] == ["requeue", "terminated", "completed"], exits
    assert exits[0]["step"] == 3, exits[0]
    saves = [(e["restart"], e["step"]) for e in events(run, "ckpt_save")]
    assert (0, 3) in saves and (1, 5) in saves and exits[1]["step"] > 5, (saves, exits)
    assert (1, exits[1]["step"]) in saves, saves  # the stop's own save, after the one in flight
    starts = [e["step"] for e in events(run, "train_start")]
    assert starts == [0, 3, exits[1]["step"]], starts
    assert trained_steps(run) == {s: 1 for s in range(14)}, trained_steps(run)  # 0 lost, 0 repeated
    assert len(endings(run)) == 3
    failed = [e for e in events(run, "tracker_failed")]
    assert failed and all(url.rsplit(":", 1)[1] in e["error"] for e in failed), failed
