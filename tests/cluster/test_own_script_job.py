"""Your own script on the real local Slurm (issue 19): examples/own_script/train_safe.py, 2 nodes x
2 processes, stopped twice -- Slurm's time-limit USR2 and an external `scontrol requeue` (TERM)
-- ends with parameters bit-identical to an uninterrupted run, no step trained twice or lost,
and `dslurm report` reading its ledger; the unmodified train_plain.py runs under dslurm too
(whole nodes, torchrun, the burn-in in front of it) and trains the very same parameters."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cluster_jobs import events, job_spec, submit, wait_for
from dslurm import slurm

STEPS = 60
EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "own_script"


def script_job(tmp_path: Path, name: str, script: str, sleep: float = 0.4, **extra: object) -> str:
    entry = [str(EXAMPLES / script), "--steps", str(STEPS), "--step-sleep", str(sleep),
             "--out", str(tmp_path / f"{name}.pt")]
    return job_spec(tmp_path, name, entry=entry, **extra)


def params(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def safe_reference(slurm_cluster, tmp_path_factory) -> Path:
    """train_safe.py uninterrupted, once for both tests (the same job each would run): its parameters."""
    from testkit import run_cli

    env, tmp = slurm_cluster.env(), tmp_path_factory.mktemp("safe-ref")
    ref_id = submit(run_cli, env, script_job(tmp, "ref", "train_safe.py", sleep=0.0))  # a sleep changes no number
    assert slurm.wait_job(ref_id, timeout=300, env=env) == "COMPLETED"
    assert events(tmp / "ref", "exit")[-1]["code"] == 0
    return tmp / "ref.pt"


@pytest.mark.timeout(1200)
def test_own_script_preempted_twice_ends_bit_identical(slurm_cluster, cli, tmp_path, safe_reference):
    env = slurm_cluster.env()

    # Time limit 2 min with a 100 s lead: Slurm sends USR2 to the batch shell ~20 s in.
    job = submit(cli, env, script_job(tmp_path, "rq", "train_safe.py", time="00:02:00",
                                      requeue={"signal_lead": 100, "max_restarts": 4}))
    run = tmp_path / "rq"
    first = wait_for(lambda: events(run, "requeue"), 240, "the first requeue")
    # the ranks' agreed stop decides, not srun's code (143 when one node's 75 made srun TERM the other)
    assert first[0]["ending"] == "warned_stop" and first[0]["decision"] == "requeue", first
    slurm.run_cmd(["scontrol", "update", f"JobId={job}", "TimeLimit=00:10:00"], env=env)
    wait_for(lambda: len([e for e in events(run, "steps") if e["restart"] == 1]) >= 3, 240,
             "training in the second start")
    slurm.run_cmd(["scontrol", "requeue", str(job)], env=env)  # external: TERM, save, Slurm requeues
    assert slurm.wait_job(job, timeout=400, env=env) == "COMPLETED"
    assert slurm.job_info(job, env=env)["restarts"] == 2

    starts, exits = events(run, "train_start"), events(run, "exit")
    assert [e["code"] for e in exits] == [75, 143, 0], exits
    for prev_exit, nxt in zip(exits, starts[1:]):  # every start resumed where the last one saved
        assert nxt["step"] == prev_exit["step"] > 0, (prev_exit, nxt)
    trained = [e["last"] for e in events(run, "steps")]
    assert sorted(trained) == list(range(STEPS))  # each step exactly once: nothing lost, nothing redone
    assert same(params(tmp_path / "rq.pt"), params(safe_reference))

    report = cli("report", str(run), "--json", "--no-png", env=env)
    assert report.returncode == 0, report.stderr
    summary = json.loads(report.stdout)
    assert summary["restarts"] == 2 and summary["lost_steps"] == 0 and summary["final_step"] == STEPS


@pytest.mark.timeout(600)
def test_unmodified_plain_script_runs_under_dslurm(slurm_cluster, cli, tmp_path, safe_reference):
    env = slurm_cluster.env()
    job = submit(cli, env, script_job(tmp_path, "plain", "train_plain.py", preflight={"enabled": True},
                                      requeue={"enabled": False}))
    assert slurm.wait_job(job, timeout=400, env=env) == "COMPLETED"
    run = tmp_path / "plain"
    gate = events(run, "preflight")
    assert len(gate) == 1 and gate[0]["passed"], gate  # the burn-in ran, in front of the script
    assert [(e["mode"], e["nproc_per_node"], len(e["hosts"])) for e in events(run, "job_start")] == [
        ("torchrun", 2, 2)]
    # the same training through dslurm.runtime (the module's reference), for the parameters
    assert same(params(tmp_path / "plain.pt"), params(safe_reference))
