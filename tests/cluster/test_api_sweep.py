"""`api.sweep` on the real local Slurm, as a notebook would call it: two override sets, both
results returned, each task in its own run directory. It submits as `dslurm submit --sweep` does
(issue 38): with a MaxArraySize of 1 (patched: the local cluster's is 1001) the sweep is split
into two submitit arrays, the second after the first; every task's blocklist is excluded, not
only task 0's; and a second api.sweep while the arrays are queued or running is refused."""

from __future__ import annotations

import json

import pytest

from cluster_jobs import ROOT, SITE, job_spec, wait_for
from dslurm import api, slurm
from dslurm.errors import UserError
from dslurm.observe.ledger import read_events
from dslurm.slurm import job_array
from dslurm.sweep import submit as sweep_submit


@pytest.mark.timeout(600)
def test_api_sweep_returns_both_results(slurm_cluster, monkeypatch, tmp_path):
    for k, v in slurm_cluster.env().items():  # submitit runs sbatch/sacct with this process's environment
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(ROOT)
    spec = job_spec(tmp_path, "apisw", steps=6, nodes=1, tp=1, interval=3, sleep=0.2)

    monkeypatch.setattr(job_array, "max_array_size", lambda env=None: (1, "MaxArraySize 1 (this test)"))
    (tmp_path / "sw" / "1-seed-1").mkdir(parents=True)
    (tmp_path / "sw" / "1-seed-1" / "blocklist.txt").write_text("node3\n")  # task 1's burn-in found node3 bad
    tasks = [{"train.seed": 0}, {"train.seed": 1}]
    jobs = api.sweep(spec, site=SITE, tasks=tasks, max_parallel=2, dir=tmp_path / "sw")
    arrays = [str(j.job_id).split("_")[0] for j in jobs]
    for a in arrays:  # one --exclude for every array: the union of the tasks' blocklists
        shown = slurm.run_cmd(["scontrol", "-o", "show", "job", a], check=False).stdout
        assert "ExcNodeList=node3" in shown, shown
    assert f"Dependency=afterany:{arrays[0]}" in slurm.run_cmd(["scontrol", "-o", "show", "job", arrays[1]],
                                                                check=False).stdout
    with pytest.raises(UserError, match="still queued or running"):
        api.sweep(spec, site=SITE, tasks=tasks, dir=tmp_path / "sw")
    results = [j.result() for j in jobs]

    assert [j.sweep_task for j in jobs] == [0, 1]
    assert arrays[0] != arrays[1]  # two submissions (submitit gives a one-task batch a plain job id)
    assert [r.final_step for r in results] == [6, 6]
    assert [r.run_dir for r in results] == [str(tmp_path / "sw" / "0-seed-0"), str(tmp_path / "sw" / "1-seed-1")]
    assert results[0].losses != results[1].losses  # other seeds, other runs
    for j in jobs:
        starts = [e for e in read_events(j.run_dir) if e["event"] == "train_start"]
        assert len(starts) == 1  # one start each: no duplicate task start
    m = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert [t["overrides"] for t in m["tasks"]] == [{"train.seed": 0}, {"train.seed": 1}]
    assert [(a["via"], a["offset"], a["tasks"]) for a in m["arrays"]] == [("api", 0, [0]), ("api", 1, [1])]
    # result() returns while Slurm may still show the array COMPLETING: a resubmission waits for that
    wait_for(lambda: not sweep_submit._active_arrays(m, None), 120, "the arrays to leave the queue")
    assert api.sweep(spec, site=SITE, tasks=[{"train.seed": 0}, {"train.seed": 1}], dir=tmp_path / "sw") == []
