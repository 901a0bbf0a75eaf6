"""Pure rendering of the local cluster's config (dslurm.cluster.conf)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dslurm.cluster import conf as cc


def _spec(**kw: object) -> cc.ClusterSpec:
    return cc.ClusterSpec(state_dir=Path("/s"), controller_host="vm", **kw)  # type: ignore[arg-type]


def _kv(text: str) -> dict[str, str]:
    return dict(ln.split("=", 1) for ln in text.splitlines()
                if ln and not ln.startswith("#") and not ln.startswith(("NodeName", "Partition")))


def test_slurm_conf_one_line_per_node_with_distinct_ports() -> None:
    text = cc.render_slurm_conf(_spec(nodes=3, cpus=4))
    node_lines = [ln for ln in text.splitlines() if ln.startswith("NodeName=")]
    assert len(node_lines) == 3
    ports = {tok for ln in node_lines for tok in ln.split() if tok.startswith("Port=")}
    assert len(ports) == 3
    assert all("NodeAddr=127.0.0.1" in ln and "CPUs=4" in ln for ln in node_lines)
    assert "PartitionName=debug Nodes=node1,node2,node3 Default=YES MaxTime=INFINITE" in text


def test_slurm_conf_settings_that_make_requeue_fast_and_local_work() -> None:
    kv = _kv(cc.render_slurm_conf(_spec(first_job_id=1234)))
    assert kv["SlurmctldHost"] == "vm(127.0.0.1)"
    assert "cred_expire=10" in kv["AuthInfo"] and "socket=/s/munge/" in kv["AuthInfo"]
    assert kv["SchedulerParameters"] == "bf_interval=1,sched_interval=1"
    assert kv["ProctrackType"] == "proctrack/pgid"
    assert kv["ReturnToService"] == "2" and kv["JobRequeue"] == "1"
    assert kv["FirstJobId"] == "1234"
    assert kv["SlurmdParameters"] == "config_overrides"
    assert kv["AccountingStorageType"] == "accounting_storage/none"
    assert "Gres" not in kv and "GresTypes" not in kv


def test_accounting_points_controller_and_dbd_at_the_private_munge_socket() -> None:
    spec = _spec(accounting=True)
    kv = _kv(cc.render_slurm_conf(spec))
    assert kv["AccountingStorageType"] == "accounting_storage/slurmdbd"
    assert kv["AccountingStoragePass"] == "/s/munge/munge.socket.2"
    dbd = _kv(cc.render_slurmdbd_conf(spec))
    assert dbd["DbdHost"] == "vm" and dbd["StoragePort"] == str(cc.MYSQL_PORT)
    assert dbd["AuthInfo"] == "socket=/s/munge/munge.socket.2"


def test_first_job_id_grows_with_time_and_passes_previous_ids() -> None:
    t = 1_800_000_000.0
    assert cc.time_based_job_id(t + 3600) > cc.time_based_job_id(t)
    assert cc.next_first_job_id(t, previous_max=0) == cc.time_based_job_id(t)
    big = cc.time_based_job_id(t) + 500
    assert cc.next_first_job_id(t, previous_max=big) == big + 1
    assert cc.next_first_job_id(t, previous_max=10**9) < cc.MAX_JOB_ID


def test_max_job_id_in_log() -> None:
    log = ("[..] _slurm_rpc_submit_batch_job: JobId=6034231 InitPrio=1\n"
           "[..] _job_complete: JobId=6034229 done\n")
    assert cc.max_job_id_in_log(log) == 6034231
    assert cc.max_job_id_in_log("") == 0


def test_hosts_line_is_marked_with_state_dir() -> None:
    line = cc.hosts_line(2, Path("/tmp/x"))
    assert line.startswith("127.0.0.1 node1 node2 ")
    assert line.endswith("# dslurm-cluster /tmp/x")


@pytest.mark.parametrize("kw", [{"nodes": 0}, {"cpus": 0}, {"first_job_id": cc.MAX_JOB_ID}])
def test_spec_rejects_bad_values_naming_them(kw: dict) -> None:
    with pytest.raises(ValueError, match=next(iter(kw))):
        _spec(**kw)


def test_daemons_run_in_the_state_dir_not_in_the_callers_cwd(tmp_path, monkeypatch):
    import os
    import time

    from dslurm.cluster.proc import spawn_proc

    log = tmp_path / "state" / "log"
    log.mkdir(parents=True)
    elsewhere = tmp_path / "checkout"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    rec = spawn_proc("pwd", ["pwd"], log / "pwd.out", dict(os.environ))
    deadline = time.monotonic() + 10
    while not (log / "pwd.out").read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rec["pid"] > 0 and (log / "pwd.out").read_text().strip() == str(log)
