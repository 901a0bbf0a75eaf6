"""A sweep on the real local Slurm (issue 26): one 4-task job array, at most 2 running. Task 2 is
requeued from outside (`scontrol requeue ARRAY_2`), task 3 crashes once (DSLURM_FAULT_CRASH on
its first start); every task completes, and neither touched another task. The report shows one
row per task; a second submission submits nothing; a task whose run is deleted runs alone."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml

from cluster_jobs import decisions, endings, events, job_spec, wait_for
from dslurm import slurm

TASKS = [{"train.seed": 0}, {"train.seed": 1}, {"train.seed": 2},
         {"train.seed": 3, "env.DSLURM_FAULT_CRASH": "3@0"}]  # task 3: crash before step 3, first start only
STEPS = 14


def states(sweep: Path, cli, env) -> dict[int, str]:
    res = cli("status", str(sweep), "--json", env=env)
    assert res.returncode == 0, res.stderr
    return {r["task"]: r["state"] for r in json.loads(res.stdout)}


@pytest.mark.timeout(900)
def test_sweep_four_tasks_preempt_and_crash_stay_in_their_task(slurm_cluster, cli, tmp_path):
    env = slurm_cluster.env()
    base = job_spec(tmp_path, "sw", steps=STEPS, nodes=1, tp=1, interval=3, sleep=0.4)
    sweep = tmp_path / "sweep"
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(yaml.safe_dump({"site": "site-configs/local.yaml", "job": base, "dir": str(sweep),
                                          "max_parallel": 2, "tasks": TASKS}, sort_keys=False))
    res = cli("submit", "--sweep", str(sweep_file), env=env)
    assert res.returncode == 0, res.stderr
    array = int(re.search(r"array job (\d+)", res.stdout).group(1))
    runs = [Path(t["run_dir"]) for t in json.loads((sweep / "sweep.json").read_text())["tasks"]]
    assert [r.name for r in runs] == ["0-seed-0", "1-seed-1", "2-seed-2", "3-seed-3_DSLURM_FAULT_CRASH-3_0"]
    assert "#SBATCH --array=0-3%2" in (sweep / "array.sbatch").read_text()

    # Task 2 training in its first start: requeue that task, in the ARRAY_TASK form.
    wait_for(lambda: [e for e in events(runs[2], "steps") if e["last"] >= 2], 400, "task 2 training")
    slurm.run_cmd(["scontrol", "requeue", f"{array}_2"], env=env)
    for i in range(4):  # each task's own job id, ARRAY_TASK form; ends when its batch shell ends
        assert slurm.wait_job(f"{array}_{i}", timeout=600, env=env) == "COMPLETED"
    assert set(states(sweep, cli, env).values()) == {"completed"}

    restarts = {i: slurm.job_info(f"{array}_{i}", env=env)["restarts"] for i in range(4)}
    assert restarts == {0: 0, 1: 0, 2: 1, 3: 1}, restarts
    for i in (0, 1):  # untouched: one start, ended completed
        assert len(events(runs[i], "train_start")) == 1 and endings(runs[i]) == ["completed"]
    assert len(events(runs[2], "train_start")) == 2 and endings(runs[2])[-1] == "completed", endings(runs[2])
    assert decisions(runs[2])[-1] == "end"
    assert endings(runs[3])[0] == "crash" and decisions(runs[3]) == ["requeue", "end"]
    crash_rq = events(runs[3], "requeue")[0]
    assert "failure restart 1 of" in crash_rq["reason"], crash_rq  # its own budget
    job_ids = [{e["job_id"] for e in events(r, "train_start")} for r in runs]
    assert all(len(ids) == 1 for ids in job_ids) and len(set.union(*job_ids)) == 4  # each task its own job

    res = cli("report", str(sweep), env=env)
    assert res.returncode == 0, res.stderr
    rows = [ln for ln in res.stdout.splitlines() if re.match(r"\s*\d+\s+completed", ln)]
    assert len(rows) == 4, res.stdout
    assert (sweep / "report.png").stat().st_size > 0
    rep = json.loads(cli("report", str(sweep), "--json", "--no-png", "--sort", "train_loss", env=env).stdout)
    assert sorted(r["task"] for r in rep) == [0, 1, 2, 3]
    assert [r["restarts"] for r in sorted(rep, key=lambda r: r["task"])] == [0, 0, 1, 1]
    assert all(r["step"] == STEPS and r["train_loss"] is not None for r in rep)
    losses = [r["train_loss"] for r in rep]
    assert losses == sorted(losses)

    # The finished sweep again: nothing submitted. One task's run deleted: only it runs.
    res = cli("submit", "--sweep", str(sweep_file), env=env)
    assert res.returncode == 0 and "nothing submitted" in res.stdout, res.stdout + res.stderr
    shutil.rmtree(runs[1])
    res = cli("submit", "--sweep", str(sweep_file), env=env)
    assert res.returncode == 0, res.stderr
    assert "(1 task(s): 1)" in res.stdout, res.stdout
    again = int(re.search(r"array job (\d+)", res.stdout).group(1))
    assert slurm.wait_job(f"{again}_1", timeout=400, env=env) == "COMPLETED"
    assert states(sweep, cli, env) == {0: "completed", 1: "completed", 2: "completed", 3: "completed"}
    for i in (0, 2, 3):
        assert len(events(runs[i], "submit")) == 1  # not submitted again
