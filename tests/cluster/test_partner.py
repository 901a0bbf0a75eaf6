"""Partner copies on the real local Slurm (issue 52): 2 nodes x 2 processes, each slurmd its own
node-local scratch (site-configs/local.yaml: storage.scratch /tmp/dslurm-cluster/scratch/%n), node3
in the run's blocklist so the requeued start lands on node1 + node2 again. One job of its own, and
the session's uninterrupted reference run (conftest `two_tier_reference`, shared with test_two_tier.py):

- the two-tier run with `checkpoint.partner: true`. Once step 8's generation is committed locally,
  on the partner node and durably, every rank waits before step 11 (DSLURM_FAULT_AWAIT) while the
  test wipes node2's scratch and deletes step 8's durable copy; then node2's ranks are SIGKILLed
  (DSLURM_FAULT_KILL9). The requeued start resumes at step 8 -- the newest -- with ranks 2-3 pulled
  from the partner copy on node1 over the network (the ledger says so), and completes: every step's
  loss and the final checkpoint's tensors equal the reference's.

The byte flips, the forged tensor and the kill -9 mid-transfer are tests/integration/test_partner_dist.py's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cluster_jobs import SCRATCH, TWO_TIER, events, job_spec, logs, same_as_reference, submit, wait_for
from dslurm import checkpoint as ck
from dslurm import slurm

NEWEST = 8


def _newest_everywhere(run: Path) -> bool:
    ptr = ck.read_pointer(run) if (run / ck.POINTER).exists() else None
    done = [e for e in events(run, "ckpt_partner_commit") if e["step"] == NEWEST and e["ok"]]
    return bool(done) and ptr is not None and ptr.step == NEWEST


@pytest.mark.timeout(900)
def test_node_loss_resumes_at_the_newest_step_from_the_partner_copy(slurm_cluster, two_tier_reference, cli,
                                                                     tmp_path):
    env = slurm_cluster.env()
    run = tmp_path / "partner"
    common = {"sleep": 0.3, **TWO_TIER}
    run.mkdir()
    (run / "blocklist.txt").write_text("node3\n")  # every start on node1 + node2
    gate = run / "node2-lost"
    spec = job_spec(tmp_path, "partner", checkpoint={"tiers": "two_tier", "async_save": True, "partner": True},
                    env={"DSLURM_FAULT_KILL9": "11:2,3@0", "DSLURM_FAULT_AWAIT": f"{gate}:1:240"}, **common)
    job = submit(cli, env, spec)
    wait_for(lambda: _newest_everywhere(run), 400, f"step {NEWEST} committed locally, on the partner and durably")
    wiped = list((SCRATCH / "node2").glob(f"dslurm-{run.name}-*"))
    assert wiped, list((SCRATCH / "node2").iterdir())
    for p in wiped:
        shutil.rmtree(p)  # node2's local disk is gone
    ptr = ck.read_pointer(run)
    assert ptr is not None and ptr.step == NEWEST
    shutil.rmtree(ck.generations_dir(run) / ptr.generation)  # and the newest durable copy
    gate.write_text("")  # node2's ranks die before step 11
    assert slurm.wait_job(job, timeout=500, env=env) == "COMPLETED", logs(run)

    restores = {e["restart"]: e for e in events(run, "ckpt_restore") + events(run, "ckpt_fallback")}
    starts = {e["restart"]: e for e in events(run, "train_start")}
    assert starts[1]["step"] == NEWEST  # not the durable tier's step 4
    assert restores[1]["tier"] == "partner", restores[1]
    assert restores[1]["copies"] == {"local": [0, 1], "partner": [2, 3]}, restores[1]
    assert "ranks 2-3 from the partner copy on node1" in restores[1]["tier_reason"]
    assert restores[1]["restore_s"] > 0
    assert not events(run, "restore_rejected")
    commits = events(run, "ckpt_partner_commit")
    assert commits and all(e["ok"] and e["bytes"] > 0 for e in commits)
    same_as_reference(two_tier_reference, run, env, tmp_path)
