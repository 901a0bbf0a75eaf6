"""Warm restarts inside the allocation on the real local Slurm (dslurm/launch/warm.py): a 1+1 job
with `recovery.warm: true`. Step 0 starts cold and rank 1 crashes; step 1's workers are forked by
the node's preloaded pool (the ledger labels it warm) and rank 1 is killed -9 there; step 2 falls
back to the cold path (torchrun) and the job completes: one job, no requeue. The failure -> first
step of the warm attempt is compared with the cold start's job start -> first step of the same run."""

from __future__ import annotations

import pytest

from cluster_jobs import events, job_spec, logs, submit
from dslurm import slurm
from dslurm.observe import events as ev
from dslurm.observe.phases import tables
from dslurm.observe.report import summarize

# The goal is 0.35 (docs/recovery.md has the measured spread: 0.27-0.41 on this 2-core machine,
# lower the busier it is, since a cold start's imports suffer most); the test holds a bound that
# a quiet machine meets too, so it does not flake, and prints the ratio.
RATIO_BOUND = 0.5


@pytest.mark.timeout(600)
def test_warm_restart_after_a_crash_then_a_crash_in_it_falls_back_cold(slurm_cluster, cli, tmp_path):
    env = slurm_cluster.env()
    run = tmp_path / "warm"
    spec = job_spec(tmp_path, "warm", steps=18, nodes=1, interval=2, sleep=0.2, spares=1,
                    recovery={"warm": True}, requeue={"max_restarts": 4, "no_progress_limit": 0},
                    env={"DSLURM_FAULT_KILL9": "9:1@0.0", "DSLURM_FAULT_CRASH": "13:1@0.1"})
    job = submit(cli, env, spec)
    assert slurm.wait_job(job, timeout=400, env=env) == "COMPLETED", logs(run)
    assert slurm.job_info(job, env=env)["restarts"] == 0
    assert [e["cls"] for e in events(run, "ending")] == ["crash", "crash", "completed"], logs(run)
    assert [e["mode"] for e in events(run, "job_start")] == ["torchrun", "warm", "torchrun"]
    assert [e["mode"] for e in events(run, "recovery")] == ["same_nodes", "same_nodes"]
    assert [s["step"] for s in events(run, "train_start")] == [0, 8, 12]
    evs = ev.read(run)
    cold, warm, again = tables(evs)
    assert warm.warm and not cold.warm and not again.warm
    assert (warm.seconds("imports") or 0) < 0.2 < (cold.seconds("imports") or 0), (cold.rows, warm.rows)
    to_training = [r.resumed_s for r in summarize(evs).recoveries]
    ratio = to_training[0] / cold.startup_s()
    print(f"cold job start -> first step {cold.startup_s():.1f} s; failure -> first step: warm "
          f"{to_training[0]:.1f} s ({ratio:.2f}x), cold {to_training[1]:.1f} s")
    assert ratio <= RATIO_BOUND, (to_training, cold.rows, warm.rows)
