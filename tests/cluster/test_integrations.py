"""A Hugging Face Trainer script and a Lightning script, each changed by one import and `run`
(examples/integrations/), on the real local Slurm (issue 49): 2 nodes x 1 process, DDP over gloo,
dropout, a shuffled loader. Each job is requeued with `scontrol requeue` (TERM: saved, exit 143,
Slurm requeues), then warned with USR2 to the batch shell (saved, exit 75, requeue-me requeues),
and ends with parameters bit-identical to an uninterrupted run of the same script (torchrun, 2
processes, no Slurm: the same world of two). The HF job also takes a `dslurm ctl save`; the report
reads both runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from cluster_jobs import ROOT, events, logs, submit, wait_for
from dslurm import slurm

EXAMPLES = ROOT / "examples" / "integrations"
LIBS = {  # script, steps, seconds per step (time to signal it)
    "hf": ("hf_train.py", 24, 0.4),
    "lightning": ("lightning_train.py", 30, 0.3),  # 24 batches per epoch: the run crosses one
}


def entry(lib: str, out: Path, sleep: float) -> list[str]:
    script, steps, _ = LIBS[lib]
    extra = ["--output-dir", str(out.parent / f"{lib}-out")] if lib == "hf" else ["--root-dir", str(out.parent)]
    return [str(EXAMPLES / script), "--steps", str(steps), "--step-sleep", str(sleep), "--out", str(out), *extra]


def job_file(tmp: Path, lib: str) -> str:
    job = {"name": f"int-{lib}", "nodes": 2, "procs_per_node": 1, "time": "00:10:00",
           "entry": entry(lib, tmp / f"{lib}.pt", LIBS[lib][2]), "preflight": {"enabled": False},
           "checkpoint": {"run_dir": str(tmp / lib), "interval": 10}, "requeue": {"max_restarts": 4}}
    path = tmp / f"{lib}.yaml"
    path.write_text(yaml.safe_dump(job))
    return str(path)


def reference(tmp: Path, lib: str) -> subprocess.Popen:
    """The same script uninterrupted: torchrun, 2 processes, no Slurm (started beside the job)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           *entry(lib, tmp / f"{lib}-ref.pt", 0.0)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DSLURM_RUN_DIR": str(tmp / f"{lib}-ref"), "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def steps_in(run: Path, restart: int) -> int:
    return len([e for e in events(run, "steps") if e["restart"] == restart])


def signal_batch(sig: str, job: int, env: dict[str, str]) -> None:
    subprocess.run(["scancel", f"--signal={sig}", "--batch", str(job)], env={**env, "PATH": "/usr/bin:/bin"},
                   check=True)


def same(a: Path, b: Path) -> bool:
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("lib", ["hf", "lightning"])
def test_library_trainer_requeued_then_warned_ends_bit_identical(slurm_cluster, cli, tmp_path, lib):
    env = slurm_cluster.env()
    run, steps = tmp_path / lib, LIBS[lib][1]
    job = submit(cli, env, job_file(tmp_path, lib))
    ref = reference(tmp_path, lib)
    wait_for(lambda: steps_in(run, 0) >= 3, 300, "training in the first start")
    if lib == "hf":  # an operator's save, taken at the next step boundary and committed
        assert cli("ctl", str(run), "save", env=env).returncode == 0
        (taken,) = wait_for(lambda: events(run, "operator_request"), 60, "the ctl save taken")
        wait_for(lambda: [e for e in events(run, "ckpt_save") if e["step"] == taken["step"]], 60, "its save")
    slurm.run_cmd(["scontrol", "requeue", str(job)], env=env)  # TERM: saved, 143, Slurm requeues
    wait_for(lambda: steps_in(run, 1) >= 3, 300, "training in the second start")
    signal_batch("USR2", job, env)  # the time-limit warning: saved, 75, requeue-me requeues
    assert slurm.wait_job(job, timeout=400, env=env) == "COMPLETED", logs(run)
    assert ref.wait(timeout=300) == 0

    exits, starts = events(run, "exit"), events(run, "train_start")
    assert [e["code"] for e in exits] == [143, 75, 0], exits
    for prev, nxt in zip(exits, starts[1:]):  # each start resumed from the stop's own save
        assert nxt["step"] == prev["step"] > 0, (prev, nxt)
    assert sorted(e["last"] for e in events(run, "steps")) == list(range(steps))  # none lost, none twice
    assert same(tmp_path / f"{lib}.pt", tmp_path / f"{lib}-ref.pt")
    report = cli("report", str(run), "--json", "--no-png", env=env)
    assert report.returncode == 0, report.stderr
    summary = json.loads(report.stdout)
    assert summary["restarts"] == 2 and summary["lost_steps"] == 0 and summary["final_step"] == steps, summary
    assert summary["status"] == "completed" and 0 < summary["goodput"] < 1, summary  # the run's goodput
