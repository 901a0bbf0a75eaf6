"""Sweeps (dslurm/sweep): the sweep file, task expansion and naming, the split by MaxArraySize,
every task resolved before anything is submitted, the array script, the sweep table. Pure or on
tmp files; no Slurm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from dslurm.errors import UserError
from dslurm.slurm.job_array import ArrayPart, parse_max_array_size, split_arrays
from dslurm.sweep.build import check_map, render_array, resolve_sweep, sweep_map
from dslurm.sweep.report import TaskRow, sort_rows, table
from dslurm.sweep.spec import parse, slug, task_dir_name

ROOT = Path(__file__).resolve().parents[2]
SITE = str(ROOT / "site-configs" / "local.yaml")


def base(**extra):
    return {"site": SITE, "job": "job.yaml", **extra}


@pytest.fixture
def job(tmp_path):
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump({"name": "sw", "nodes": 1, "model": {"preset": "tiny"},
                                 "preflight": {"enabled": False}, "train": {"steps": 4, "global_batch": 8}}))
    return str(p)


def sweep_of(tmp_path, job, **extra):
    return resolve_sweep(parse({"site": SITE, "job": job, "dir": str(tmp_path / "sw"), **extra}, "s.yaml"),
                         base_dir=tmp_path)


def test_grid_expands_last_key_fastest():
    s = parse(base(grid={"train.lr": [1e-4, 3e-4], "train.seed": [0, 1]}, max_parallel=2))
    assert s.tasks == ((("train.lr", 1e-4), ("train.seed", 0)), (("train.lr", 1e-4), ("train.seed", 1)),
                       (("train.lr", 3e-4), ("train.seed", 0)), (("train.lr", 3e-4), ("train.seed", 1)))
    assert s.max_parallel == 2 and s.name == "sweep"


def test_task_list_and_common_overrides():
    s = parse(base(tasks=[{"train.lr": 1e-4}, {"train.lr": 3e-4, "env.X": "1"}], set=["train.steps=9"]), "a/lr.yaml")
    assert s.name == "lr" and s.common == ("train.steps=9",)
    assert s.tasks[1] == (("train.lr", 3e-4), ("env.X", "1"))


@pytest.mark.parametrize("data, words", [
    (base(grid={}), ["grid", "empty"]),
    (base(grid={"train.lr": []}), ["grid.train.lr", "non-empty list"]),
    (base(grid={"train.lr": 1e-4}), ["grid.train.lr"]),
    (base(), ["either 'grid'", "neither"]),
    (base(grid={"a": [1]}, tasks=[{"a": 1}]), ["both"]),
    (base(tasks=[]), ["tasks"]),
    (base(tasks=["x"]), ["item 0"]),
    (base(grid={"x": [1]}, bogus=1), ["unknown key", "bogus", "Valid"]),
    ({"job": "j.yaml", "grid": {"x": [1]}}, ["'site'", "missing"]),
    (base(grid={"x": [1]}, max_parallel=-1), ["max_parallel"]),
    (base(grid={"checkpoint.run_dir": ["a", "b"]}), ["task 0", "checkpoint.run_dir", "cannot be swept"]),
    (base(grid={"name": ["a", "b"]}), ["'name' cannot be swept"]),
    (base(tasks=[{"train.lr": 1e-4}, {"train.lr": 1e-4}]), ["tasks 0 and 1", "same overrides"]),
])
def test_bad_sweep_files_are_refused(data, words):
    with pytest.raises(UserError) as exc:
        parse(data)
    assert all(w in str(exc.value) for w in words), str(exc.value)


def test_slug_is_stable_filesystem_safe_and_short():
    assert slug((("train.lr", 1e-4), ("train.seed", 0))) == "lr-0.0001_seed-0"
    assert slug((("model.dim", 64), ("train.dim", 2))) == "model.dim-64_train.dim-2"  # same last name: full
    assert slug((("env.A", "a/b c$`"),)) == "A-a_b_c"
    assert slug((("entry", ["x.py", "--lr", "1"]),)) == "entry-x.py_--lr_1"
    long = slug((("train.lr", "x" * 300),))
    assert len(long) <= 80
    assert slug(()) == "base"
    assert task_dir_name(3, (("train.seed", 1),)) == "3-seed-1"


def test_split_by_max_array_size():
    assert split_arrays([0, 1, 2, 3], 1001) == [ArrayPart(offset=0, ids=(0, 1, 2, 3))]
    parts = split_arrays(list(range(7)), 3)
    assert [(p.offset, p.ids) for p in parts] == [(0, (0, 1, 2)), (3, (0, 1, 2)), (6, (0,))]
    assert [p.tasks for p in parts] == [[0, 1, 2], [3, 4, 5], [6]]
    assert [(p.offset, p.ids) for p in split_arrays([1, 5], 3)] == [(0, (1,)), (3, (2,))]  # a resubmission
    with pytest.raises(UserError, match="no job arrays"):
        split_arrays([0], 0)


def test_max_array_size_from_scontrol_show_config():
    text = "Configuration data as of x\nMaxArraySize            = 1001\nMaxJobCount             = 10000\n"
    assert parse_max_array_size(text) == 1001
    assert parse_max_array_size("MaxJobCount = 1") is None


def test_every_task_resolved_with_its_own_run_dir(tmp_path, job):
    sw = sweep_of(tmp_path, job, grid={"train.lr": [1e-4, 3e-4]}, max_parallel=1)
    assert [t.r.run_dir for t in sw.tasks] == [tmp_path / "sw" / "0-lr-0.0001", tmp_path / "sw" / "1-lr-0.0003"]
    assert [t.r.job.train.lr for t in sw.tasks] == [1e-4, 3e-4]
    m = sweep_map(sw)
    assert [t["overrides"] for t in m["tasks"]] == [{"train.lr": 1e-4}, {"train.lr": 3e-4}]


@pytest.mark.parametrize("grid, words", [
    ({"train.nope": [1, 2]}, ["task 0", "train.nope"]),
    ({"train.lr": [1e-4, -1.0]}, ["task 1", "train.lr=-1.0", "lr"]),
    ({"parallel.tp": [1, 3]}, ["task 1", "parallel"]),
    ({"time": ["00:05:00", "00:09:00"]}, ["task 1", "--time", "one job array has one set of flags"]),
])
def test_a_task_that_fails_validation_is_named(tmp_path, job, grid, words):
    with pytest.raises(UserError) as exc:
        sweep_of(tmp_path, job, grid=grid)
    assert all(w in str(exc.value) for w in words), str(exc.value)
    assert not (tmp_path / "sw").exists()  # nothing written before every task resolved


def test_array_script_maps_tasks_to_their_run_dirs(tmp_path, job):
    sw = sweep_of(tmp_path, job, grid={"train.seed": [0, 1, 2]}, max_parallel=2)
    text = render_array(sw, ArrayPart(offset=0, ids=(0, 1, 2)))
    assert "#SBATCH --array=0-2%2" in text and "#SBATCH --requeue" in text
    assert f"#SBATCH --output={tmp_path}/sw/logs/%x-%A_%a.out" in text
    assert f"  1) RUN_DIR={tmp_path}/sw/1-seed-1 ;;" in text
    assert 'exec bash "$RUN_DIR/job.sbatch"' in text
    part = render_array(sw, ArrayPart(offset=2, ids=(0,)), 2, 2)  # a second array: ids restart at 0
    assert "TASK=$(( 2 + SLURM_ARRAY_TASK_ID ))" in part and "array 2 of 2" in part
    assert "#SBATCH --array=0%2" in part and "  2) RUN_DIR=" in part and "  1) RUN_DIR=" not in part


def test_a_sweep_dir_serves_one_sweep(tmp_path, job):
    sw = sweep_of(tmp_path, job, grid={"train.seed": [0, 1]})
    check_map(sw, sweep_map(sw))
    other = sweep_of(tmp_path, job, grid={"train.seed": [5, 1]})
    with pytest.raises(UserError, match="task 0 was"):
        check_map(other, sweep_map(sw))


def test_rows_sort_by_a_metric_missing_last():
    rows = [TaskRow(0, {"train.lr": 1}, "r0", "completed", train_loss=2.0, step=4, target_steps=4, goodput=0.5),
            TaskRow(1, {"train.lr": 2}, "r1", "running", train_loss=1.0),
            TaskRow(2, {"train.lr": 3}, "r2", "queued")]
    assert [r.task for r in sort_rows(rows, "train_loss")] == [1, 0, 2]
    assert [r.task for r in sort_rows(rows, "train_loss", descending=True)] == [0, 1, 2]
    with pytest.raises(UserError, match="Valid"):
        sort_rows(rows, "nope")
    text = table(rows)
    assert "lr=1" in text and "4/4" in text and "50%" in text and "1 of 3 task(s) completed" in text


def test_submit_dry_run_writes_map_and_script(tmp_path, job, cli):
    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump(base(job=job, dir=str(tmp_path / "sw"), grid={"train.seed": [0, 1]})))
    res = cli("submit", "--sweep", str(f), "--dry-run")
    assert res.returncode == 0, res.stderr
    m = json.loads((tmp_path / "sw" / "sweep.json").read_text())
    assert [Path(t["run_dir"]).name for t in m["tasks"]] == ["0-seed-0", "1-seed-1"]
    for t in m["tasks"]:
        assert (Path(t["run_dir"]) / "job.sbatch").is_file() and (Path(t["run_dir"]) / "job.yaml").is_file()
    assert "#SBATCH --array=0-1" in (tmp_path / "sw" / "array.sbatch").read_text()
    res = cli("submit", "--sweep", str(f), "--site", SITE)
    assert res.returncode != 0 and "--site cannot go with it" in res.stderr
