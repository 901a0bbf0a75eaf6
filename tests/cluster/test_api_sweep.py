"""`api.sweep` on the real local Slurm, as a notebook would call it: two override sets, one
submitit job array, both results returned, each task in its own run directory."""

from __future__ import annotations

import json

import pytest

from cluster_jobs import ROOT, SITE, job_spec
from dslurm import api
from dslurm.observe.ledger import read_events


@pytest.mark.timeout(600)
def test_api_sweep_returns_both_results(slurm_cluster, monkeypatch, tmp_path):
    for k, v in slurm_cluster.env().items():  # submitit runs sbatch/sacct with this process's environment
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(ROOT)
    spec = job_spec(tmp_path, "apisw", steps=6, nodes=1, tp=1, interval=3, sleep=0.2)

    jobs = api.sweep(spec, site=SITE, tasks=[{"train.seed": 0}, {"train.seed": 1}], max_parallel=2,
                     dir=tmp_path / "sw")
    results = [j.result() for j in jobs]

    assert [j.sweep_task for j in jobs] == [0, 1]
    array = str(jobs[0].job_id).split("_")[0]
    assert [str(j.job_id) for j in jobs] == [f"{array}_{i}" for i in (0, 1)]  # one array
    assert [r.final_step for r in results] == [6, 6]
    assert [r.run_dir for r in results] == [str(tmp_path / "sw" / "0-seed-0"), str(tmp_path / "sw" / "1-seed-1")]
    assert results[0].losses != results[1].losses  # other seeds, other runs
    for j in jobs:
        starts = [e for e in read_events(j.run_dir) if e["event"] == "train_start"]
        assert len(starts) == 1  # one start each: no duplicate task start
    m = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert [t["overrides"] for t in m["tasks"]] == [{"train.seed": 0}, {"train.seed": 1}]
    assert m["arrays"][0]["via"] == "api"
    assert api.sweep(spec, site=SITE, tasks=[{"train.seed": 0}, {"train.seed": 1}], dir=tmp_path / "sw") == []
