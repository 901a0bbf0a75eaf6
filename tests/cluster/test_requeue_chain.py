"""The requeue chain on the real local Slurm (issue 6): a 2-node x 2-process FSDP x TP job
is stopped twice while training — once by Slurm's own time-limit signal
(--signal=B:USR2@LEAD), once by an external `scontrol requeue` (TERM) — and ends with the
same losses and bit-identical parameters as an uninterrupted run, with no step redone. The
interrupted run reads its windows from the token file's memory map (`data.read: mmap`), the
reference by a call each: the two read paths give the same batches."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

from cluster_jobs import job_spec, submit, wait_for
from dslurm import slurm
from dslurm.checkpoint import read_pointer
from dslurm.observe.ledger import read_events

STEPS = 30


def losses(run: Path) -> dict[int, float]:
    """Loss per step from the ledger (log_every=1); a step trained twice would show twice."""
    out: dict[int, float] = {}
    for e in read_events(run):
        if e["event"] == "steps":
            assert e["last"] not in out, f"step {e['last']} trained twice"
            out[e["last"]] = e["loss"]
    return out


def final_params(run: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    ptr = read_pointer(run)
    assert ptr is not None and ptr.step == STEPS
    out = tmp_path / f"{run.name}.pt"
    dcp_to_torch_save(run / "generations" / ptr.generation, out)
    state = torch.load(out, weights_only=False)
    model = state.get("model", state)
    return {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}


@pytest.mark.timeout(900)
def test_two_requeues_lose_nothing(slurm_cluster, cli, tmp_path):
    env = slurm_cluster.env()
    # Reference first: the same job, never interrupted.
    ref_id = submit(cli, env, job_spec(tmp_path, "ref", sleep=0.0))  # the step sleep changes no number
    assert slurm.wait_job(ref_id, timeout=300, env=env) == "COMPLETED"

    # Time limit 2 min with a 100 s lead: Slurm sends USR2 to the batch shell ~20 s in.
    # ... read through the token file's memory map (data.read: mmap), the reference by a call per
    # window: the same batches, across both requeues, or the parameters differ
    spec = job_spec(tmp_path, "rq", time="00:02:00", requeue={"signal_lead": 100, "max_restarts": 4},
                    data={"read": "mmap"})
    job = submit(cli, env, spec)
    run = tmp_path / "rq"
    first = wait_for(lambda: [e for e in read_events(run) if e["event"] == "requeue"], 240, "the first requeue")
    # the ranks' agreed stop decides, not srun's code (143 when one node's 75 made srun TERM the other)
    assert first[0]["ending"] == "warned_stop" and first[0]["decision"] == "requeue", first
    # Later starts get a limit long enough to finish: the time-limit path was exercised once.
    slurm.run_cmd(["scontrol", "update", f"JobId={job}", "TimeLimit=00:10:00"], env=env)
    wait_for(lambda: [e for e in read_events(run) if e["event"] == "steps" and e["restart"] == 1
                      and e["last"] >= 3], 240, "training in the second start")
    slurm.run_cmd(["scontrol", "requeue", str(job)], env=env)  # external: TERM, save, requeue
    assert slurm.wait_job(job, timeout=400, env=env) == "COMPLETED"
    assert slurm.job_info(job, env=env)["restarts"] == 2

    events = list(read_events(run))
    starts = [e for e in events if e["event"] == "train_start"]
    exits = [e for e in events if e["event"] == "exit"]
    assert [e["reason"] for e in exits][-1] == "completed"
    # Zero lost steps: every start resumed exactly where the previous one stopped and saved.
    for prev_exit, nxt in zip(exits, starts[1:]):
        assert nxt["step"] == prev_exit["step"], (prev_exit, nxt)
    ref_l, rq_l = losses(tmp_path / "ref"), losses(run)
    assert sorted(rq_l) == sorted(ref_l) == list(range(STEPS))  # `last` is the 0-based step index
    assert rq_l == ref_l  # bitwise: same layout, same data order, RNG restored
    ref_p, rq_p = final_params(tmp_path / "ref", tmp_path), final_params(run, tmp_path)
    assert ref_p.keys() == rq_p.keys() and all(torch.equal(ref_p[k], rq_p[k]) for k in ref_p)
    report = cli("report", str(run), "--json", "--no-png", env=env)
    assert report.returncode == 0, report.stderr
    summary = __import__("json").loads(report.stdout)
    assert summary["restarts"] == 2 and summary["lost_steps"] == 0 and summary["final_step"] == STEPS


@pytest.mark.timeout(600)
def test_chain_of_three_ends_when_training_ends_in_link_two(slurm_cluster, cli, tmp_path):
    env = slurm_cluster.env()
    res = cli("submit", "--site", "site-configs/local.yaml", "--job", job_spec(tmp_path, "chain"),
              "--chain", "3", env=env)
    assert res.returncode == 0, res.stderr
    links = [int(i) for i in re.search(r"submitted job ([\d,]+)", res.stdout).group(1).split(",")]
    assert len(links) == 3
    run = tmp_path / "chain"
    wait_for(lambda: [e for e in read_events(run) if e["event"] == "steps" and e["last"] >= 3], 240,
             "training in link 1")
    subprocess.run(["scancel", "--signal=USR2", "--batch", str(links[0])], env={**env, "PATH": "/usr/bin:/bin"},
                   check=True)
    assert slurm.wait_job(links[0], timeout=120, env=env) == "COMPLETED"  # saved, ended; no requeue
    assert slurm.wait_job(links[1], timeout=400, env=env) == "COMPLETED"
    assert slurm.wait_job(links[2], timeout=60, env=env) == "CANCELLED"
    events = list(read_events(run))
    started = {e["job_id"] for e in events if e["event"] == "train_start"}
    assert started == {str(links[0]), str(links[1])}  # link 3 never trained
    decisions = [(e["job_id"], e["decision"]) for e in events if e["event"] == "requeue"]
    assert decisions == [(str(links[0]), "end"), (str(links[1]), "end")]
    cancel = [e for e in events if e["event"] == "chain_cancel"]
    assert cancel and cancel[0]["job_ids"] == [links[2]]
    assert read_pointer(run).step == STEPS


# The same crash on every start stopping on the no-progress guard is in test_fault_matrix.py
# (the crash race, order A), with the exit order forced.
