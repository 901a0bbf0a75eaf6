"""`dslurm burnin` as a standalone sbatch job on the real local cluster, and draining."""

from __future__ import annotations

from dslurm import slurm
from dslurm.observe.ledger import read_events


def test_standalone_burnin_job_prints_its_verdict(slurm_cluster, cli, tmp_path):
    res = cli("burnin", "--site", "site-configs/local.yaml", "--nodes", "2", "--run-dir", str(tmp_path / "b"),
              "--wait", env=slurm_cluster.env(), timeout=300)
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
                  env=env, timeout=300)
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
