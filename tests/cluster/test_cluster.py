"""The local real Slurm cluster and the Slurm-command wrapper, against real daemons."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from dslurm import cli, cluster, slurm
from dslurm.cluster import conf as cc
from dslurm.errors import SlurmError

pytestmark = pytest.mark.cluster


def _script(tmp_path: Path, body: str, *sbatch_lines: str) -> Path:
    path = tmp_path / "job.sh"
    path.write_text("#!/bin/bash\n" + "".join(f"#SBATCH {s}\n" for s in sbatch_lines)
                    + body + "\n")
    return path


def test_up_twice_is_a_noop(slurm_cluster: cluster.ClusterInfo) -> None:
    record = slurm_cluster.state_dir / cluster.RECORD
    pids_before = [p["pid"] for p in json.loads(record.read_text())["procs"]]
    info = cluster.up(nodes=slurm_cluster.nodes, accounting=slurm_cluster.accounting)
    assert info == slurm_cluster  # same daemons (below): nothing was restarted
    assert [p["pid"] for p in json.loads(record.read_text())["procs"]] == pids_before
    assert cluster.is_up()


def test_status_lists_idle_nodes(slurm_cluster: cluster.ClusterInfo) -> None:
    st = cluster.status()
    assert st["up"] is True
    names = sorted(n["name"] for n in st["nodes"])  # type: ignore[union-attr]
    assert names == list(slurm_cluster.node_names)
    assert all(n["cpus"] >= 4 for n in st["nodes"])  # type: ignore[union-attr]


def test_down_with_nothing_running_exits_0(tmp_path: Path) -> None:
    assert cli.main(["cluster", "down", "--state-dir", str(tmp_path / "none")]) == 0
    assert cluster.down(tmp_path / "none") is False


def test_two_node_job_sees_two_hostnames(slurm_cluster: cluster.ClusterInfo,
                                         tmp_path: Path) -> None:
    script = _script(tmp_path, "srun hostname", "--nodes=2", "--output=out.txt")
    job = slurm.sbatch(script, cwd=tmp_path)
    assert slurm.wait_job(job, timeout=30) == "COMPLETED"
    hosts = (tmp_path / "out.txt").read_text().split()
    assert len(hosts) == 2 and len(set(hosts)) == 2
    assert set(hosts) <= set(slurm_cluster.node_names)
    info = slurm.job_info(job)
    assert info["num_nodes"] == 2 and info["exit_code"] == "0:0" and info["restarts"] == 0


def test_exclusive_job_with_two_tasks_of_two_cpus_per_node(slurm_cluster: cluster.ClusterInfo,
                                                           tmp_path: Path) -> None:
    proc = slurm.run_cmd(["srun", "--nodes=2", "--exclusive", "--ntasks-per-node=2",
                          "--cpus-per-task=2", "--chdir", str(tmp_path), "hostname"],
                         timeout=30)
    hosts = proc.stdout.split()
    assert len(hosts) == 4 and len(set(hosts)) == 2


def test_unknown_partition_fails_with_slurms_reason(slurm_cluster: cluster.ClusterInfo,
                                                    tmp_path: Path) -> None:
    with pytest.raises(SlurmError, match="invalid partition specified: nope"):
        slurm.sbatch(_script(tmp_path, "true"), extra_args=["--partition=nope"], cwd=tmp_path)


def test_submit_while_controller_down_says_start_the_cluster(tmp_path: Path) -> None:
    # A config for a controller that is not running (own port), so the session's cluster
    # keeps serving the other tests. message_timeout=2 makes the failure take ~1 s, not ~9 s.
    spec = cc.ClusterSpec(state_dir=tmp_path, nodes=1, ctld_port=16890, message_timeout=2)
    conf = tmp_path / "slurm.conf"
    conf.write_text(cc.render_slurm_conf(spec))
    with pytest.raises(SlurmError) as err:
        slurm.sbatch(_script(tmp_path, "true"), cwd=tmp_path, env={"SLURM_CONF": str(conf)})
    assert "Unable to contact slurm controller" in str(err.value)
    assert "dslurm cluster up" in str(err.value)


def test_sacct_reports_finished_job(slurm_cluster: cluster.ClusterInfo, tmp_path: Path) -> None:
    job = slurm.sbatch(_script(tmp_path, "exit 3", "--output=/dev/null"), cwd=tmp_path)
    assert slurm.wait_job(job, timeout=30) == "FAILED"
    deadline = time.monotonic() + 10  # slurmctld sends job records to slurmdbd asynchronously
    while True:
        out = slurm.run_cmd(["sacct", "-D", "-X", "-n", "-P", "-j", str(job), "-o", slurm.SACCT_FIELDS]).stdout
        info = slurm.parse_sacct(out)
        if (info and info["state"] == "FAILED") or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert info is not None and info["state"] == "FAILED" and info["exit_code"] == "3:0"
    assert info["restarts"] == 0 and info["reason"] == ""  # no stale pending reason once it ran


def test_requeue_restarts_job_within_seconds(slurm_cluster: cluster.ClusterInfo,
                                             tmp_path: Path) -> None:
    script = _script(tmp_path, 'echo "start $SLURM_RESTART_COUNT"; sleep 60', "--requeue",
                     "--open-mode=append", "--output=out.txt")
    job = slurm.sbatch(script, cwd=tmp_path)
    try:
        slurm.wait_job(job, states={"RUNNING"}, timeout=30)
        t0 = time.monotonic()
        slurm.requeue(job)
        deadline = t0 + 90
        while not (slurm.job_info(job)["restarts"] == 1
                   and slurm.job_info(job)["state"] == "RUNNING"):
            assert time.monotonic() < deadline, slurm.job_info(job)
            time.sleep(0.2)
        cycle = time.monotonic() - t0
        # Slurm's default cred_expire (120 s) would hold the job back for two minutes; the
        # local cluster's 10 s gives ~11 s cycles. The bound tells the two apart under load.
        assert cycle < 60, f"requeue cycle took {cycle:.1f} s (cred_expire should keep it ~11 s)"
    finally:
        slurm.cancel(job)
    assert slurm.wait_job(job, timeout=30) == "CANCELLED"


def test_wrap_job_and_unknown_job_id(slurm_cluster: cluster.ClusterInfo, tmp_path: Path) -> None:
    job = slurm.sbatch(None, extra_args=["--wrap", "true", "--output=/dev/null"], cwd=tmp_path)
    assert slurm.wait_job(job, timeout=30, poll=0.05) == "COMPLETED"
    # Never existed: not in slurmctld, not in accounting -> a clear error, not a KeyError.
    with pytest.raises(SlurmError, match="unknown to slurmctld and to accounting"):
        slurm.job_info(1)


def test_after_a_slurmctld_restart_steps_are_refused_for_a_while_and_no_node_is_read_as_lost(
        slurm_cluster: cluster.ClusterInfo, tmp_path: Path) -> None:
    """A Slurm fact the chaos soak met (seed 4444): for some seconds after slurmctld restarts, a new
    step in a running job is refused ("Memory required by task is not available": its nodes have
    not registered again). dslurm.recover.srun reads those words as a refusal that says nothing
    about the nodes, and its probe asks again meanwhile instead of counting the node lost."""
    import subprocess

    from dslurm.recover.srun import SrunRunner, refusal

    script = _script(tmp_path, "sleep 120", "--nodes=1", "--nodelist=node1", "--exclusive", "--output=out.txt")
    job = slurm.sbatch(script, cwd=tmp_path)
    try:
        slurm.wait_job(job, states={"RUNNING"}, timeout=30)
        cluster.restart_slurmctld(1.0)
        env = {**os.environ, **slurm_cluster.env(), "SLURM_JOB_ID": str(job)}  # as the batch shell has it
        # the supervisor's form (an explicit --nodelist): refused at once while node1 has not registered
        # again (seen: 5-60 s; without --nodelist srun pends instead, "Requested nodes are busy")
        first = subprocess.run(["srun", "--overlap", "-N1", "-n1", "--nodelist=node1", "--quiet", "true"], env=env,
                               capture_output=True, text=True, timeout=120)
        assert first.returncode == 0 or refusal(first.stderr), first.stderr
        cluster.restart_slurmctld(1.0)
        runner = SrunRunner(None, [], env)  # type: ignore[arg-type]  # the probe needs only the env
        assert runner.probe(["node1"], 20.0) == ()
    finally:
        slurm.run_cmd(["scancel", str(job)], check=False)
