"""The notebook API (dslurm.api) on the real local Slurm, through the real submitit.

The example notebook runs cell by cell and its 2-node job is compared with the same job
submitted by `dslurm submit`; an external USR2 requeues a running API job, which resumes
from its checkpoint; a failing trainer surfaces as an exception with its own error; a
client without accounting is told how to fix it before anything is submitted.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from submitit.core.utils import FailedJobError

from dslurm import api, slurm
from dslurm.errors import UserError
from dslurm.observe.ledger import read_events
from testkit import LoadDeadline

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "examples" / "notebook.ipynb"
SITE, JOB = "site-configs/local.yaml", "examples/jobs/tiny-2node.yaml"


def notebook_cells() -> list[str]:
    nb = json.loads(NOTEBOOK.read_text())
    assert nb["nbformat"] == 4 and all("source" in c and "metadata" in c for c in nb["cells"])
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]


def wait_for(pred, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.5)


def job_events(run_dir: Path, job_id: str, name: str) -> list[dict]:
    return [e for e in read_events(run_dir) if e["event"] == name and str(e.get("job_id")) == str(job_id)]


@pytest.fixture
def slurm_env(slurm_cluster, monkeypatch):
    # submitit runs sbatch/sacct/scancel with this process's environment.
    for k, v in slurm_cluster.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.chdir(ROOT)


@pytest.fixture(scope="module")
def notebook(slurm_cluster, tmp_path_factory) -> dict:
    """Execute the notebook's code cells in order, in one namespace, like a kernel would."""
    ns: dict = {}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in slurm_cluster.env().items():
            mp.setenv(k, v)
        mp.setenv("DSLURM_NOTEBOOK_RUNS", str(tmp_path_factory.mktemp("notebook")))
        mp.chdir(ROOT / "examples")  # where a person opens it; the first cell finds the root
        for i, src in enumerate(notebook_cells()):
            exec(compile(src, f"{NOTEBOOK.name} code cell {i}", "exec"), ns)
    return ns


def test_notebook_runs_end_to_end(notebook):
    s = notebook["summary"]
    assert s.final_step == 10 and [step for step, _ in s.losses] == [5, 10]
    assert len(s.hosts) == 4 and len(s.nodes) == 2 and set(s.hosts) == set(s.nodes)
    assert s.goodput is not None and 0 < s.goodput <= 1
    local = notebook["local"]
    assert local.final_step == 10 and all(notebook["same"]) and len(notebook["same"]) == 2


def test_api_job_matches_dslurm_submit(notebook, slurm_env, cli, tmp_path):
    """Same job, same flags, same launcher: same ranks on the hosts and the same losses."""
    s = notebook["summary"]
    overrides = [*notebook["OVERRIDES"], f"checkpoint.run_dir={tmp_path / 'run'}"]
    res = cli("submit", "--site", SITE, "--job", JOB, *[a for o in overrides for a in ("--set", o)])
    assert res.returncode == 0, res.stderr
    job_id = re.search(r"submitted job (\d+)", res.stdout).group(1)
    assert slurm.wait_job(job_id, timeout=240) == "COMPLETED"
    cli_steps = [(e["first"], e["last"], e["loss"]) for e in job_events(tmp_path / "run", job_id, "steps")]
    api_steps = [(e["first"], e["last"], e["loss"]) for e in job_events(Path(s.run_dir), s.job_id, "steps")]
    assert [x[:2] for x in cli_steps] == [x[:2] for x in api_steps] == [(0, 4), (5, 9)]
    assert [x[2] for x in api_steps] == pytest.approx([x[2] for x in cli_steps], rel=1e-5)
    cli_hosts = job_events(tmp_path / "run", job_id, "stragglers")[-1]["hosts"]
    # Node names may differ between two jobs on a shared cluster; rank -> node rank may not.
    node_rank = lambda hosts: [sorted(set(hosts)).index(h) for h in hosts]  # noqa: E731
    assert node_rank(s.hosts) == node_rank(cli_hosts) == [0, 0, 1, 1]
    assert s.nodes == sorted(set(s.hosts))


def test_usr2_requeues_and_resumes_exactly_then_a_crash_is_retried_as_requeue_me_would(slurm_env, tmp_path):
    """One API job, two interruptions (one job for both: each start costs a Slurm cycle).
    Start 0: an external USR2 requeues it through submitit; it saved at the stop and start 1 resumes
    exactly there, nothing redone. Start 1: rank 0 crashes before its 11th optimizer step (10 steps
    done). submitit alone retries timeouts and preemptions, never a crash (issue 38): rank 0 of the
    API job classifies the start's ending from its facts, records it (the restart budget counts it),
    and requeues through submitit when dslurm's decision says so; start 2 resumes from start 1's
    newest save and completes."""
    run = tmp_path / "run"
    job = api.submit(JOB, site=SITE, overrides=[
        "train.steps=12", "train.log_every=1", "train.step_sleep_s=0.2", "checkpoint.interval=4",
        "checkpoint.async_save=false",  # each save's event when it commits: start 2's resume step is known
        "preflight.enabled=false", f"checkpoint.run_dir={run}", "env.DSLURM_FAULT_CRASH=11:0@1"])
    wait_for(lambda: job_events(run, job.job_id, "steps"), 180, "the first logged steps")
    # What Slurm sends before the time limit (--signal=USR2@LEAD) and what submitit's own
    # job._interrupt(timeout=True) sends: USR2 to every task of the job.
    slurm.run_cmd(["scancel", "--signal=USR2", job.job_id])
    s = job.result()
    starts = job_events(run, job.job_id, "train_start")
    stop = [e for e in job_events(run, job.job_id, "exit") if e["reason"] == "requeue"]
    saves = [(e["restart"], e["step"]) for e in job_events(run, job.job_id, "ckpt_save")]
    assert [e["restart"] for e in starts] == [0, 1, 2], starts
    assert len(stop) == 1 and stop[0]["restart"] == 0 and (0, stop[0]["step"]) in saves, (stop, saves)
    assert max(st for r, st in saves if r == 0) == stop[0]["step"]  # saved at the stop
    assert starts[1]["step"] == stop[0]["step"] > 0, starts  # resumed exactly there: nothing redone
    assert stop[0]["step"] < 10, stop  # start 1 trained before its crash
    after = [e for e in job_events(run, job.job_id, "steps") if e["restart"] == 1]
    assert after[0]["first"] == stop[0]["step"]
    assert [e["cls"] for e in job_events(run, job.job_id, "ending")] == ["warned_stop", "crash"]
    decisions = job_events(run, job.job_id, "requeue")
    assert [e["decision"] for e in decisions] == ["requeue", "requeue"], decisions
    assert decisions[0]["via"] == "submitit"
    newest = max(st for r, st in saves if r <= 1)
    assert starts[2]["step"] == newest < 10, (starts, saves)
    trained: dict[int, int] = {}
    for e in job_events(run, job.job_id, "steps"):
        trained[e["last"]] = trained.get(e["last"], 0) + 1
    redone = sorted(st for st, n in trained.items() if n > 1)
    assert redone == list(range(newest, 10)), (redone, newest)  # only the crash cost steps (0-based)
    assert (s.final_step, s.restarts, s.lost_steps) == (12, 2, len(redone))


def test_a_failing_trainer_raises_with_its_error_output(slurm_env, tmp_path):
    job_spec = {"name": "api-bad-data", "nodes": 1, "time": "00:05:00",
                "data": {"path": "/nonexistent/tokens.h5"}, "train": {"steps": 5},
                "preflight": {"enabled": False}, "checkpoint": {"run_dir": str(tmp_path / "run")}}
    took = LoadDeadline(150, procs=2)  # the bound on an idle machine, stretched by the load
    job = api.submit(job_spec, site=SITE)
    with pytest.raises(FailedJobError) as err:
        job.result()
    assert not took.expired(), took.describe()
    text = str(err.value)
    assert "TrainerFailed" in text and "the trainer exited 2" in text
    # the trainer's own words: the job's field, then the file
    assert re.search(r"error: \[rank 0\] .*data\.path.*: /nonexistent/tokens\.h5: no such token file", text), text


def test_without_accounting_submit_says_how_to_fix_it(slurm_cluster, monkeypatch, tmp_path):
    # This client's view of the cluster has no accounting: sacct says it is disabled.
    conf = slurm_cluster.slurm_conf.read_text()
    no_acct = tmp_path / "slurm.conf"
    no_acct.write_text("\n".join(ln for ln in conf.splitlines() if not ln.startswith("AccountingStorage")))
    monkeypatch.setenv("SLURM_CONF", str(no_acct))
    monkeypatch.chdir(ROOT)
    with pytest.raises(UserError, match=r"sacct.*dslurm cluster up --accounting"):
        api.submit(JOB, site=SITE, overrides=[f"checkpoint.run_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()  # nothing frozen, nothing submitted
