"""One requeue policy, computed once in resolve (issue 13): every path that submits a job emits
the same #SBATCH flags, and `dslurm requeue-me` reads the policy from the frozen run config."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from dslurm import api
from dslurm import exitcodes as X
from dslurm.config.resolve import load
from dslurm.observe import events as ev
from dslurm.observe.ledger import Ledger
from dslurm.submission import submit
from testkit import sbatch_flags

ROOT = Path(__file__).resolve().parents[2]
SITE = ROOT / "site-configs/local.yaml"  # signal_lead_s: 30, max_restarts: 4


@pytest.fixture(autouse=True)
def at_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def _job(tmp_path: Path, run: Path, **requeue) -> Path:
    job = yaml.safe_load((ROOT / "examples/jobs/tiny-2node.yaml").read_text())
    job["checkpoint"]["run_dir"] = str(run)
    job["requeue"] = requeue
    p = tmp_path / "job.yaml"
    p.write_text(yaml.safe_dump(job))
    return p


def _three_ways(cli, tmp_path: Path, job: Path) -> list[tuple[str, str]]:
    """(signal, time) as `dslurm render`, `dslurm submit --dry-run` and the notebook API emit them."""
    res = cli("render", "--site", str(SITE), "--job", str(job))
    assert res.returncode == 0, res.stderr
    rendered = sbatch_flags(res.stdout)
    res = cli("submit", "--site", str(SITE), "--job", str(job), "--dry-run")
    assert res.returncode == 0, res.stderr
    run = Path(yaml.safe_load(job.read_text())["checkpoint"]["run_dir"])
    submitted = sbatch_flags((run / "job.sbatch").read_text())
    params = api.executor_parameters(api.load_inputs(str(job), str(SITE)))
    from_api = (f"B:USR2@{params['signal_delay_s']}", params["time"])
    return [(rendered["signal"], rendered["time"]), (submitted["signal"], submitted["time"]),
            (from_api[0], "00:10:00" if from_api[1] == 10 else str(from_api[1]))]


@pytest.mark.parametrize("lead,history,want", [
    (100, False, 100),  # explicit in the job
    (None, False, 30),  # the site's default
    ("auto", False, 60),  # no measurements yet: the site default, raised to the 60 s floor
    ("auto", True, 170),  # measured: 2 x (40 s step + 45 s save)
])
def test_render_submit_and_api_emit_the_same_signal_flag(cli, tmp_path, lead, history, want):
    run = tmp_path / "run"
    if history:
        Ledger(run).append(ev.Steps(step_time_s=40.0))
        Ledger(run).append(ev.CkptSave(total_s=45.0, stall_s=45.0))
    job = _job(tmp_path, run, **({} if lead is None else {"signal_lead": lead}))
    got = _three_ways(cli, tmp_path, job)
    assert got == [(f"B:USR2@{want}", "00:10:00")] * 3, got


def test_the_submit_event_records_the_effective_lead_and_the_checkpoint_interval(tmp_path, monkeypatch):
    from dslurm import slurm

    monkeypatch.setattr(slurm, "sbatch", lambda *a, **k: 4242)  # no controller in this unit test
    run = tmp_path / "run"
    r = load(SITE, _job(tmp_path, run, signal_lead="auto"))
    submit(r)
    from dslurm.observe.ledger import read_events

    ev = [e for e in read_events(run) if e["event"] == "submit"][-1]
    assert ev["signal_lead_s"] == 60 and ev["signal_lead_setting"] == "auto" and "floor 60s" in ev["signal_lead_reason"]
    assert ev["checkpoint_interval"] == 20


def test_requeue_me_applies_the_frozen_budget_without_any_policy_variable(tmp_path, monkeypatch):
    """max_restarts: 1 in the job (site 4, config default 5, the old env default 3): after one
    earlier crash, a second crash spends the budget -- read from run_dir/job.yaml, no DSLURM_*."""
    from dslurm import requeue, slurm
    from dslurm.endings.facts import RankReport, write_rank_report

    run = tmp_path / "run"
    r = load(SITE, _job(tmp_path, run, max_restarts=1, no_progress_limit=0))
    submit(r, dry_run=True)  # freezes site.yaml and job.yaml into the run dir
    calls = []
    monkeypatch.setattr(slurm, "incarnations", lambda job, env=None: [])  # no accounting here
    monkeypatch.setattr(slurm, "down_nodes", lambda hosts, env=None: {})
    monkeypatch.setattr(slurm, "run_cmd", lambda args, **k: calls.append(args))
    env = {"DSLURM_RUN_DIR": str(run), "SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": "1"}
    Ledger(run).append(ev.Ending(job_id="7", restart=0, cls="crash"))
    write_rank_report(RankReport(rank=0, kind="crash", code=1, step=3, error="boom"), env)
    assert not any(k.startswith("DSLURM_") and k != "DSLURM_RUN_DIR" for k in env)
    assert requeue.requeue_me(1, env) == X.BUDGET
    assert calls == []  # no scontrol requeue


def test_a_start_that_died_with_its_node_gets_a_late_ending_naming_the_node(tmp_path, monkeypatch):
    """The batch shell died too (NODE_FAIL took the job down): the next start writes the ending,
    naming the node of that incarnation whose launcher left no report."""
    import json

    from dslurm import requeue, slurm
    from dslurm.endings.facts import LauncherReport, write_launcher_report
    from dslurm.observe.ledger import read_events

    run = tmp_path / "run"
    old = {"DSLURM_FACTS_DIR": str(run / "starts" / "7.0")}
    write_launcher_report(LauncherReport(host="node1", node_rank=0, signals=[], torchrun_rc=1, worker_codes={},
                                         silent_local_ranks=[], code=1), old)
    monkeypatch.setattr(slurm, "incarnations", lambda job, env=None: [
        {"state": "NODE_FAIL", "nodes": "node[1-2]", "start": 1, "end": 2},
        {"state": "RUNNING", "nodes": "node[1,3]", "start": 3, "end": 0}])
    requeue.close_earlier_starts(run, run / "starts" / "7.1", {})
    ends = [e for e in read_events(run) if e["event"] == "ending"]
    assert len(ends) == 1 and ends[0]["late"] and (ends[0]["job_id"], ends[0]["restart"]) == ("7", 0)
    assert (ends[0]["cls"], ends[0]["origin_host"]) == ("node_failure", "node2"), ends[0]
    assert json.loads((run / "starts" / "7.0" / "ending.json").read_text())["cls"] == "node_failure"


def test_requeue_me_requeues_a_stray_stop_within_the_frozen_stray_budget(tmp_path, monkeypatch):
    """A TERM that reached node2's launcher alone while Slurm runs the job (issue 24): the ranks
    saved; requeue-me records a stray stop and requeues (max_stray_stops: 1 in the job, read from
    run_dir/job.yaml); the second stray stop of the same job spends that budget and stops (77)."""
    from dslurm import requeue, slurm
    from dslurm.endings.facts import LauncherReport, RankReport, write_launcher_report, write_rank_report
    from dslurm.observe.ledger import read_events

    run = tmp_path / "run"
    submit(load(SITE, _job(tmp_path, run, max_stray_stops=1, no_progress_limit=0)), dry_run=True)
    calls: list[list[str]] = []
    monkeypatch.setattr(slurm, "incarnations", lambda job, env=None: [{"state": "RUNNING"}])
    monkeypatch.setattr(slurm, "down_nodes", lambda hosts, env=None: {})
    monkeypatch.setattr(slurm, "run_cmd", lambda args, **k: calls.append(list(args)))
    for restart in (0, 1):
        env = {"DSLURM_RUN_DIR": str(run), "SLURM_JOB_ID": "7", "SLURM_RESTART_COUNT": str(restart)}
        for host, sigs in (("node1", []), ("node2", [("SIGTERM", 5.0)])):
            write_launcher_report(LauncherReport(host=host, node_rank=int(host[-1]) - 1, signals=sigs, torchrun_rc=143,
                                                 worker_codes={}, silent_local_ranks=[], code=143), env)
        for r in range(4):
            write_rank_report(RankReport(rank=r, kind="terminated_saved", code=143, step=8, signal="SIGTERM",
                                         host=f"node{1 + r // 2}"), env)
        monkeypatch.setenv("SLURM_JOB_ID", "7")  # the ledger stamps each event with this start
        monkeypatch.setenv("SLURM_RESTART_COUNT", str(restart))
        assert requeue.requeue_me(143, env) == (X.OK if restart == 0 else X.BUDGET)
    assert calls == [["scontrol", "requeue", "7"]]  # the first stray stop only
    ends = [e for e in read_events(run) if e["event"] == "ending"]
    assert [(e["cls"], e["saved"], e["step"]) for e in ends] == [("stray_stop", True, 8)] * 2, ends
    rq = [e for e in read_events(run) if e["event"] == "requeue"]
    assert [(e["decision"], e["ending"]) for e in rq] == [("requeue", "stray_stop"), ("stop", "stray_stop")]
    assert "stray stop 1 of 1" in rq[0]["reason"] and "1 of 1 stray-stop requeues" in rq[1]["reason"], rq
