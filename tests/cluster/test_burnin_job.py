"""`dslurm burnin` as a standalone sbatch job on the real local cluster, and draining."""

from __future__ import annotations

import subprocess

import pytest

from dslurm import slurm
from dslurm.errors import SlurmError
from dslurm.observe.ledger import read_events
from testkit import load_scaled


def test_standalone_burnin_job_prints_its_verdict(slurm_cluster, cli, tmp_path):
    res = cli("burnin", "--site", "site-configs/local.yaml", "--nodes", "2", "--run-dir", str(tmp_path / "b"),
              "--wait", env=slurm_cluster.env(), timeout=load_scaled(300, procs=4))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "submitted burn-in job" in res.stdout and "busbw" in res.stdout.lower()
    pre = [e for e in read_events(tmp_path / "b") if e["event"] == "preflight"]
    assert len(pre) == 1 and pre[0]["passed"] and len(pre[0]["nodes"]) == 2


def test_bad_node_is_drained_where_the_site_allows_it(slurm_cluster, cli, tmp_path):
    """allow_drain: the burn-in drains the node it blames, with the reason (fault injected on
    node1; sbatch exports the submitting environment to the job). Resumed afterwards."""
    env = {**slurm_cluster.env(), "DSLURM_FAULT_SLOW_NODE": "node1:0.2"}
    site = tmp_path / "site.yaml"
    site.write_text(__import__("pathlib").Path("site-configs/local.yaml").read_text()
                     .replace("burnin:\n", "burnin:\n  allow_drain: true\n"))
    try:
        res = cli("burnin", "--site", str(site), "--nodes", "3", "--run-dir", str(tmp_path / "d"), "--wait",
                  env=env, timeout=load_scaled(300, procs=6))
        assert res.returncode == 3, res.stdout + res.stderr  # EXIT_BAD_NODES
        node1 = [n for n in slurm.nodes(env=env) if n["name"] == "node1"][0]
        assert "drain" in str(node1["state"]).lower(), node1
        out = slurm.run_cmd(["scontrol", "show", "node", "node1"], env=env).stdout
        assert "Reason=dslurm burn-in:" in out
        assert (tmp_path / "d" / "blocklist.txt").read_text().split() == ["node1"]
    finally:
        _resume(env, "node1")


def _resume(env, node: str, timeout: float = 60) -> None:
    """Give the node back to the shared test cluster: RESUME until it is idle and responding
    again (a job still completing on it keeps it draining for a moment). A node left drained
    or not responding makes the next `cluster up` see an unhealthy cluster and restart it."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        slurm.run_cmd(["scontrol", "update", f"NodeName={node}", "State=RESUME"], env=env, check=False)
        info = [n for n in slurm.nodes(env=env) if n["name"] == node][0]
        # Responding too: right after RESUME the controller shows `idle*` until its next ping.
        if (info["state"] == "idle" and info["responding"]) or time.monotonic() > deadline:
            assert info["state"] == "idle" and info["responding"], f"{node} after RESUME: {info}"
            return
        time.sleep(0.5)


def _fake_slurm(monkeypatch, sacct_after: int) -> list[str]:
    """scontrol has forgotten job 7; sacct has no record of it for its first `sacct_after` calls,
    then has it FAILED. No daemons: only what the commands answer."""
    calls: list[str] = []

    def run_cmd(args, **_kw):
        calls.append(args[0])
        if args[0] == "scontrol":
            return subprocess.CompletedProcess(args, 1, "", "slurm_load_jobs error: Invalid job id specified")
        known = calls.count("sacct") > sacct_after
        return subprocess.CompletedProcess(args, 0, "7|burnin-2|FAILED|node[1-2]|1:0|None|2\n" if known else "", "")

    monkeypatch.setattr(slurm, "run_cmd", run_cmd)
    monkeypatch.setattr(slurm.time, "sleep", lambda s: None)
    return calls


def test_a_job_gone_from_slurmctld_is_waited_for_until_accounting_has_it(monkeypatch):
    """Under load slurmdbd records a job late: `wait_job` (a job we submitted) waits through
    that window, bounded, instead of calling the job unknown; a bare `job_info` (any id,
    maybe one nobody submitted) still answers at once."""
    calls = _fake_slurm(monkeypatch, sacct_after=3)
    assert slurm.wait_job(7, timeout=60) == "FAILED"
    assert calls.count("sacct") == 4
    _fake_slurm(monkeypatch, sacct_after=3)
    with pytest.raises(SlurmError, match="unknown to slurmctld and to accounting"):
        slurm.job_info(7)
    _fake_slurm(monkeypatch, sacct_after=10**9)  # never comes: an error once the window is over
    monkeypatch.setattr(slurm, "accounting_settle_s", lambda: 0.0)
    with pytest.raises(SlurmError, match="unknown to slurmctld and to accounting"):
        slurm.wait_job(7, timeout=60)
