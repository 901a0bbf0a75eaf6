"""The sweep rules `dslurm submit --sweep` and `api.sweep` share (dslurm/sweep/submit.py, issue
38): every task's blocklist goes into the array's --exclude (not task 0's only), a second
submission is refused while an array of the sweep is queued or running, and an `squeue` that
fails is not "nothing running". Slurm's commands are stubbed at `slurm.run_cmd`; the real
submissions are tests/cluster/test_sweep.py and test_api_sweep.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from dslurm import slurm
from dslurm.errors import SlurmError, UserError
from dslurm.sweep import submit as S
from dslurm.sweep.build import resolve_sweep
from dslurm.sweep.spec import parse

SITE = str(Path(__file__).resolve().parents[2] / "site-configs" / "local.yaml")


@pytest.fixture
def sweep(tmp_path, monkeypatch):
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump({"name": "sw", "nodes": 1, "model": {"preset": "tiny"},
                                   "preflight": {"enabled": False}, "train": {"steps": 4, "global_batch": 8}}))
    monkeypatch.chdir(tmp_path)
    return resolve_sweep(parse({"site": SITE, "job": str(job), "dir": str(tmp_path / "sw"),
                                "grid": {"train.seed": [0, 1, 2]}}, "s.yaml"), base_dir=tmp_path)


def test_every_tasks_blocklist_is_excluded_and_a_running_sweep_is_not_submitted_twice(sweep, monkeypatch):
    calls: list[list[str]] = []
    queue = {"state": ""}

    def run_cmd(args, **k):
        calls.append(list(args))
        if args[0] == "squeue":
            if queue["state"] == "ERROR":
                raise SlurmError("squeue: error: Unable to contact slurm controller (connect failure)")
            if not queue["state"]:
                raise SlurmError("slurm_load_jobs error: Invalid job id specified")
            return subprocess.CompletedProcess(args, 0, f"500_0|sw|{queue['state']}|1|node1|u|0:01\n", "")
        if args[0] == "scontrol":
            return subprocess.CompletedProcess(args, 0, "MaxArraySize = 2\n", "")
        return subprocess.CompletedProcess(args, 0, f"{500 + len([c for c in calls if c[0] == 'sbatch'])}\n", "")

    monkeypatch.setattr(slurm, "run_cmd", run_cmd)
    for t, host in ((1, "node3"), (2, "node2")):
        t_dir = sweep.tasks[t].r.run_dir
        t_dir.mkdir(parents=True)
        (t_dir / "blocklist.txt").write_text(f"{host}\n")
    sub = S.submit_sweep(sweep)
    batches = [c for c in calls if c[0] == "sbatch"]
    assert len(batches) == 2 and sub.array_ids == [501, 502]  # MaxArraySize 2: tasks 0,1 then 2
    assert all("--exclude=node2,node3" in b for b in batches), batches
    assert "--dependency=afterany:501" in batches[1]
    queue["state"] = "RUNNING"
    with pytest.raises(UserError, match="still queued or running"):
        S.submit_sweep(sweep)
    queue["state"] = "ERROR"  # squeue fails: not "no array active" (a submission could run tasks twice)
    with pytest.raises(UserError, match="cannot tell whether array job"):
        S.refuse_while_running(sweep)
    assert S.sweep_blocklist(sweep, [0]) == [] and S.sweep_blocklist(sweep) == ["node2", "node3"]


def test_doctor_reads_a_sweep_tasks_array_logs(sweep, monkeypatch):
    """A sweep task's Slurm logs live in <sweep dir>/logs (the array's --output), not in its run
    directory: the submit event names them and `dslurm doctor <task dir>` reads them."""
    from dslurm.observe import doctor
    from dslurm.observe import events as ev

    def run_cmd(args, **k):
        if args[0] == "squeue":
            raise SlurmError("slurm_load_jobs error: Invalid job id specified")
        out = "MaxArraySize = 1001\n" if args[0] == "scontrol" else "600\n"
        return subprocess.CompletedProcess(args, 0, out, "")

    monkeypatch.setattr(slurm, "run_cmd", run_cmd)
    S.submit_sweep(sweep)
    run = sweep.tasks[2].r.run_dir
    (sub,) = ev.of(ev.read(run), ev.Submit)
    assert sub.logs == [str(sweep.dir / "logs" / f"sw-600_2.{x}") for x in ("out", "err")]
    Path(sub.logs[1]).write_text("Traceback (most recent call last):\nRuntimeError: injected crash\n")
    lines = doctor.read_logs(run, ev.read(run))
    assert [ln.text.strip() for ln in lines][-1] == "RuntimeError: injected crash"
    assert doctor.read_logs(run) == []  # without the ledger: only <run_dir>/logs, which a sweep task has not
