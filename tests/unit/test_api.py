"""dslurm.api without Slurm: the submitit parameters are the rendered script's flags, the
inputs are validated like the CLI's, the summary is read from the ledger."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from submitit.slurm.slurm import _make_sbatch_string

from dslurm import api
from dslurm.api.job import job_env, output_tail, summarize, trainer_argv
from dslurm.cli.render import EXAMPLES
from dslurm.config import load_job, load_site, parse_time
from dslurm.config.resolve import load
from dslurm.errors import UserError
from dslurm.observe.events import decode_all
from dslurm.render import RenderRefs, directives, render_sbatch
from testkit import sbatch_flags

ROOT = Path(__file__).resolve().parents[2]
LOCAL, TINY = "site-configs/local.yaml", "examples/jobs/tiny-2node.yaml"


@pytest.fixture(autouse=True)
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)


@pytest.mark.parametrize("site,job", EXAMPLES)
def test_submitit_script_carries_every_directive(site, job, tmp_path):
    r = load(site, job)
    rendered = sbatch_flags(_make_sbatch_string(command="true", folder=tmp_path, **api.executor_parameters(r)))
    for key, value in directives(r, "logs"):
        if key in ("output", "error"):
            assert rendered[key].startswith(str(tmp_path))  # submitit's own per-job log files
        elif key == "time":
            assert int(rendered["time"]) * 60 == pytest.approx(parse_time(value), abs=59)
        elif key == "signal":
            assert rendered["signal"] == value.removeprefix("B:")  # every task, not the batch shell
        else:
            assert rendered[key] == value, key


def test_signal_reaches_the_tasks_and_srun_matches_the_rendered_step():
    r = load(LOCAL, TINY)
    params = api.executor_parameters(r)
    assert dict(directives(r, "logs"))["signal"] == "B:USR2@30"
    assert params["signal_delay_s"] == 30
    assert params["srun_args"] == ["--kill-on-bad-exit=1", "--cpus-per-task=2"]
    assert (params["nodes"], params["ntasks_per_node"], params["time"]) == (2, 1, 10)


def test_srun_mode_runs_one_task_per_process():
    r = load("site-configs/a100-eth.yaml", "examples/jobs/llama1b-a100-srun.yaml")
    params = api.executor_parameters(r)
    assert r.job.launch == "srun" and params["ntasks_per_node"] == r.procs_per_node > 1


def test_requeue_off_is_kept():
    r = load(LOCAL, TINY, ["requeue.enabled=false"])
    extra = api.executor_parameters(r, exclude=["node3"])
    assert "no-requeue" in extra["additional_parameters"] and "requeue" not in extra["additional_parameters"]
    assert extra["exclude"] == "node3"


def test_inputs_as_paths_dicts_or_objects_resolve_alike():
    from dslurm.config.schema import to_dict

    by_path = api.load_inputs(TINY, LOCAL, ["train.steps=7"])
    job, site = load_job(TINY), load_site(LOCAL)
    by_obj = api.load_inputs(job, site, ["train.steps=7"])
    by_dict = api.load_inputs(to_dict(job), to_dict(site), ["train.steps=7"])
    for r in (by_obj, by_dict):
        assert (r.layout, r.run_dir, r.time_s, r.job, r.site) == \
            (by_path.layout, by_path.run_dir, by_path.time_s, by_path.job, by_path.site)
    assert by_path.job.train.steps == 7 and by_path.run_dir.is_absolute()


def test_bad_dict_inputs_name_the_field():
    with pytest.raises(UserError, match="nodez"):
        api.load_inputs({"name": "x", "nodez": 2}, LOCAL)
    site = {"name": "s", "slurm": {"partition": "a b"}, "node": {"gpus": 0, "cpus": 2, "mem_gb": 1,
                                                                 "procs_per_node": 2}}
    with pytest.raises(UserError, match="slurm.partition"):  # the same checks as load_site
        api.load_inputs(TINY, site)


def test_job_env_is_what_the_script_exports():
    r = load(LOCAL, TINY)
    script = render_sbatch(r, RenderRefs(site="s.yaml", job="j.yaml"))
    exported = {ln.split("=", 1)[0].removeprefix("export ") for ln in script.splitlines() if ln.startswith("export ")}
    env = job_env(r)
    # The facts dir names the job id and restart, known only at run time: the script exports it
    # from SLURM_*, the submitit path derives the same path (dslurm.endings.facts.start_dir).
    exported.discard("DSLURM_FACTS_DIR")
    assert set(env) == exported and env["DSLURM_RUN_DIR"] == str(r.run_dir) and env["OMP_NUM_THREADS"] == "1"


def test_trainer_argv_is_the_scripts_with_this_interpreter():
    r = load(LOCAL, TINY)
    assert trainer_argv(r, "S", "J") == [sys.executable, "-m", "train", "--site", "S", "--job", "J"]


def ev(event: str, t: float, job: int | None, restart: int = 0, **kw) -> dict:
    return {"event": event, "t": t, "job_id": None if job is None else str(job), "restart": restart, **kw}


def test_summary_counts_only_this_job_and_survives_a_requeue():
    events = [
        ev("train_start", 1, 6, step=0), ev("exit", 2, 6, step=3, reason="completed", code=0),  # older job
        ev("submit", 10, None, job_ids=[7]),
        ev("train_start", 20, 7, step=0, startup_s=5),
        ev("steps", 30, 7, first=0, last=4, loss=5.0, duration_s=10, step_time_s=2),
        ev("signal", 31, 7, step=5), ev("ckpt_save", 32, 7, step=5),
        ev("exit", 32, 7, step=5, reason="requeue", code=75),
        ev("requeue", 33, 7, decision="requeue", exit_code=0),
        ev("train_start", 50, 7, 1, step=5, startup_s=5),
        ev("steps", 60, 7, 1, first=5, last=9, loss=4.0, duration_s=10, step_time_s=2),
        ev("stragglers", 60, 7, 1, step=10, hosts=["n1", "n1", "n2", "n2"], step_times_s=[1, 1, 1, 1]),
        ev("exit", 61, 7, 1, step=10, reason="completed", code=0),
    ]
    s = summarize(decode_all(events), "7", "/runs/x", ["n1", "n2"])
    assert (s.job_id, s.final_step, s.final_loss, s.restarts, s.lost_steps) == ("7", 10, 4.0, 1, 0)
    assert s.losses == [(5, 5.0), (10, 4.0)] and s.hosts == ["n1", "n1", "n2", "n2"]
    assert s.nodes == ["n1", "n2"] and s.train_s == 20 and 0 < s.goodput < 1


def test_output_tail_keeps_the_trainers_error_above_a_long_report(tmp_path):
    log = tmp_path / "task.err"
    log.write_text("before launch\n" + "error: [rank 0] data.h5: no such token file\n"
                   + "".join(f"torchrun report line {i}\n" for i in range(100)))
    out = output_tail(log, offset=len("before launch\n"), lines=5)
    assert out.splitlines()[0] == "error: [rank 0] data.h5: no such token file"
    assert "before launch" not in out and out.endswith("torchrun report line 99")


def test_importing_the_api_loads_neither_torch_nor_submitit():
    code = "import sys, dslurm.api; print('torch' in sys.modules, 'submitit' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == ["False", "False"]
