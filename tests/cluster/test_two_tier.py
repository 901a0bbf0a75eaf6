"""Two-tier checkpoints on the real local Slurm (issue 16): 2 nodes x 2 processes, each slurmd its own
node-local scratch (site-configs/local.yaml: storage.scratch /tmp/dslurm-cluster/scratch/%n, %n =
SLURMD_NODENAME). One job of its own, kept tiny, and the session's uninterrupted reference run
(conftest `two_tier_reference`, shared with test_partner.py):

- the two-tier run, pinned to node1+node2 (node3 in the run's blocklist, so a requeue lands on the
  same nodes): `scontrol requeue` in start 0 (TERM: the stop save reaches durable before exit) ->
  start 1 restores from the local tier; `scontrol requeuehold` in start 1, node2's scratch wiped
  while held (node loss), release -> start 2 restores from durable. Every step's loss and the final
  checkpoint's tensors equal the reference's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cluster_jobs import SCRATCH, TWO_TIER, events, job_spec, logs, same_as_reference, submit, wait_for
from dslurm import slurm
from dslurm.checkpoint import tiers


def _steps_in(run: Path, restart: int) -> int:
    return max([e["last"] for e in events(run, "steps") if e.get("restart") == restart], default=-1)


@pytest.mark.timeout(900)
def test_two_tier_preempted_resumes_local_then_durable_after_node_loss(slurm_cluster, two_tier_reference, cli,
                                                                        tmp_path):
    env = slurm_cluster.env()
    run = tmp_path / "twotier"
    common = {"sleep": 0.5, **TWO_TIER}
    run.mkdir()
    (run / "blocklist.txt").write_text("node3\n")  # every start on node1 + node2: "the same nodes"
    spec = job_spec(tmp_path, "twotier", checkpoint={"tiers": "two_tier", "async_save": True}, **common)
    job = submit(cli, env, spec)
    wait_for(lambda: _steps_in(run, 0) >= 5, 300, "a local commit in start 0")
    slurm.run_cmd(["scontrol", "requeue", str(job)], env=env)
    wait_for(lambda: _steps_in(run, 1) >= 10, 300, "start 1 training past its next save")
    slurm.run_cmd(["scontrol", "requeuehold", str(job)], env=env)
    wait_for(lambda: [e for e in events(run, "ending") if e["restart"] == 1], 180, "start 1's ending")
    wiped = [p for p in (SCRATCH / "node2").glob(f"dslurm-{run.name}-*")]
    assert wiped, list((SCRATCH / "node2").iterdir())
    for p in wiped:
        shutil.rmtree(p)  # node2 lost its local disk
    slurm.run_cmd(["scontrol", "release", str(job)], env=env)
    assert slurm.wait_job(job, timeout=500, env=env) == "COMPLETED", logs(run)

    restores = events(run, "ckpt_restore") + events(run, "ckpt_fallback")
    by_start = {e["restart"]: e for e in restores}
    starts = {e["restart"]: e for e in events(run, "train_start")}
    ends = {e["restart"]: e for e in events(run, "exit")}
    assert by_start[1]["tier"] == "local", by_start[1]
    assert "locally committed on all 4 ranks" in by_start[1]["tier_reason"]
    assert starts[1]["step"] == ends[0]["step"]  # the stop save, restored from the local tier
    assert by_start[2]["tier"] == "durable" and "no local generation on 2 of 4 ranks" in by_start[2]["tier_reason"]
    assert starts[2]["step"] == ends[1]["step"]  # the stop save reached durable before start 1 exited
    saves = [e for e in events(run, "ckpt_save") if e.get("tier") == "two_tier"]
    assert saves and all(e["lag_s"] is not None for e in saves)
    assert events(run, "ckpt_local_commit")
    # only node1 (ranks 0, 1) still holds local generations of the run
    name = tiers.local_run_dir(SCRATCH / "node1", run).name
    assert (SCRATCH / "node1" / name).is_dir()
    same_as_reference(two_tier_reference, run, env, tmp_path)
