"""Two-tier checkpoints on the real local Slurm (issue 16): 2 nodes x 2 processes, each slurmd its own
node-local scratch (site-configs/local.yaml: storage.scratch /tmp/dslurm-cluster/scratch/%n, %n =
SLURMD_NODENAME). Two jobs in all, kept tiny:

- the reference: the same training uninterrupted (durable only);
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
import torch

from cluster_jobs import events, job_spec, logs, submit, wait_for
from dslurm import checkpoint as ck
from dslurm import slurm
from dslurm.checkpoint import tiers

STEPS, INTERVAL = 16, 4
SCRATCH = Path("/tmp/dslurm-cluster/scratch")


def _losses(run: Path) -> dict[int, float]:
    return {e["last"]: e["loss"] for e in events(run, "steps")}


def _final_tensors(run: Path, tmp: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    ptr = ck.read_pointer(run)
    assert ptr is not None and ptr.step == STEPS
    out = tmp / f"{run.name}.pt"
    dcp_to_torch_save(ck.generations_dir(run) / ptr.generation, out)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, obj: object) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}{k}.", v)
        elif isinstance(obj, torch.Tensor):
            flat[prefix.rstrip(".")] = obj
    walk("", torch.load(out, weights_only=False))
    return flat


def _steps_in(run: Path, restart: int) -> int:
    return max([e["last"] for e in events(run, "steps") if e.get("restart") == restart], default=-1)


@pytest.mark.timeout(900)
def test_two_tier_preempted_resumes_local_then_durable_after_node_loss(slurm_cluster, cli, tmp_path):
    env = slurm_cluster.env()
    ref, run = tmp_path / "ref2t", tmp_path / "twotier"
    common = {"steps": STEPS, "interval": INTERVAL, "sleep": 0.5}
    job_ref = submit(cli, env, job_spec(tmp_path, "ref2t", **common))
    assert slurm.wait_job(job_ref, timeout=400, env=env) == "COMPLETED", logs(ref)

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

    got, want = _losses(run), _losses(ref)
    assert sorted(got) == list(range(STEPS)) and got == want  # bit-identical, every step
    a, b = _final_tensors(ref, tmp_path), _final_tensors(run, tmp_path)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
