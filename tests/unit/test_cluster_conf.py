"""Pure rendering of the local cluster's config (dslurm.cluster.conf)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dslurm.cluster import conf as cc
from dslurm.cluster import shapes


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


# ------------------------------------------------------------------ GPU gres and site shapes

ROOT = Path(__file__).resolve().parents[2]


def _nodes(text: str) -> dict[str, dict[str, str]]:
    """NodeName lines as {name: {key: value}}."""
    out = {}
    for ln in text.splitlines():
        if ln.startswith("NodeName="):
            kv = dict(tok.split("=", 1) for tok in ln.split())
            out[kv["NodeName"]] = kv
    return out


def test_gres_conf_names_each_nodes_own_placeholder_devices() -> None:
    spec = _spec(nodes=2, gpus=4)
    lines = [ln for ln in cc.render_gres_conf(spec).splitlines() if not ln.startswith("#")]
    assert lines == ["NodeName=node1 Name=gpu File=/s/dev/node1/gpu[0-3]",
                     "NodeName=node2 Name=gpu File=/s/dev/node2/gpu[0-3]"]
    # The files `up` makes are exactly the ones the range names.
    assert cc.gpu_files(Path("/s"), "node2", 4) == [Path(f"/s/dev/node2/gpu{i}") for i in range(4)]
    one = cc.render_gres_conf(_spec(nodes=1, gpus=1)).splitlines()[-1]
    assert one == "NodeName=node1 Name=gpu File=/s/dev/node1/gpu0"
    assert [ln for ln in cc.render_gres_conf(_spec(nodes=2)).splitlines() if not ln.startswith("#")] == []


def test_slurm_conf_declares_gpu_gres_on_running_nodes() -> None:
    text = cc.render_slurm_conf(_spec(nodes=3, gpus=2, accounting=True))
    kv = _kv(text)
    assert kv["GresTypes"] == "gpu" and kv["AccountingStorageTRES"] == "gres/gpu"
    # Without slurmdbd, slurmctld refuses to start with a gres TRES ("slurmdbd is required").
    assert "AccountingStorageTRES" not in _kv(cc.render_slurm_conf(_spec(gpus=2)))
    nodes = _nodes(text)
    assert sorted(nodes) == ["node1", "node2", "node3"]
    assert all(n["Gres"] == "gpu:2" and n["State"] == "UNKNOWN" for n in nodes.values())
    assert "SuspendTime" not in kv and "CLOUD" not in text  # no shapes: no power saving


def test_site_shapes_of_the_shipped_gpu_sites() -> None:
    from dslurm.config import load_site

    h100 = shapes.site_shape(load_site(ROOT / "site-configs/h100-ib.yaml"), 16)
    a100 = shapes.site_shape(load_site(ROOT / "site-configs/a100-eth.yaml"), 2)
    assert h100 == cc.NodeShape(partition="gpu", nodes=16, cpus=96, memory_mb=2048 * 1024, gpus=8)
    # --gres=gpu:a100:4 needs the type on the node; --gpus-per-node=4 matches a typed gres too.
    assert a100 == cc.NodeShape(partition="a100", nodes=2, cpus=64, memory_mb=512 * 1024, gpus=4, gpu_type="a100")


def test_shaped_nodes_are_never_started_partitions_of_their_own() -> None:
    h100 = cc.NodeShape(partition="gpu", nodes=3, cpus=96, memory_mb=2_097_152, gpus=8)
    a100 = cc.NodeShape(partition="a100", nodes=2, cpus=64, memory_mb=524_288, gpus=4, gpu_type="a100")
    text = cc.render_slurm_conf(_spec(nodes=2, shapes=(h100, a100)))
    kv, nodes = _kv(text), _nodes(text)
    assert kv["GresTypes"] == "gpu"  # the shapes have GPUs even though the running nodes have none
    assert nodes["gpu-n3"]["Gres"] == "gpu:8" and nodes["gpu-n3"]["CPUs"] == "96"
    assert nodes["gpu-n3"]["RealMemory"] == "2097152" and nodes["gpu-n3"]["State"] == "CLOUD"
    assert nodes["a100-n2"]["Gres"] == "gpu:a100:4"
    assert "Gres" not in nodes["node1"] and nodes["node1"]["State"] == "UNKNOWN"
    parts = [ln for ln in text.splitlines() if ln.startswith("PartitionName=")]
    assert parts[1:] == ["PartitionName=gpu Nodes=gpu-n1,gpu-n2,gpu-n3 MaxTime=INFINITE State=UP",
                         "PartitionName=a100 Nodes=a100-n1,a100-n2 MaxTime=INFINITE State=UP"]
    assert "Default=YES" in parts[0] and parts[0].startswith("PartitionName=debug Nodes=node1,node2 ")
    # Power saving exists only to keep CLOUD nodes powered down; the running nodes never suspend.
    assert kv["SuspendTime"] == "INFINITE" and kv["SuspendExcNodes"] == "node1,node2"


def test_settings_record_gpus_and_shapes_and_read_back() -> None:
    shape = cc.NodeShape(partition="a100", nodes=2, cpus=64, memory_mb=524_288, gpus=4, gpu_type="a100")
    spec = _spec(gpus=2, shapes=(shape,))
    settings = spec.settings()
    assert settings["gpus"] == 2
    assert cc.shapes_from_settings(settings["shapes"]) == (shape,)
    assert cc.shapes_from_settings(None) == ()  # a record written before shapes existed
    assert _spec().settings() != settings


@pytest.mark.parametrize(("kw", "word"), [
    ({"partition": "debug"}, "partition"), ({"partition": "a b"}, "partition"), ({"nodes": 0}, "nodes"),
    ({"gpus": -1}, "gpus"), ({"gpu_type": "a 100"}, "gpu_type"),
])
def test_node_shape_rejects_bad_values_naming_them(kw: dict, word: str) -> None:
    base = {"partition": "gpu", "nodes": 2, "cpus": 8, "memory_mb": 1024, "gpus": 8, **kw}
    with pytest.raises(ValueError, match=word):
        cc.NodeShape(**base)


def test_spec_rejects_too_many_gpus_and_duplicate_shape_partitions() -> None:
    with pytest.raises(ValueError, match="gpus=65"):
        _spec(gpus=65)
    shape = cc.NodeShape(partition="gpu", nodes=1, cpus=8, memory_mb=1024, gpus=8)
    with pytest.raises(ValueError, match="must differ"):
        _spec(shapes=(shape, shape))


def test_site_shape_refuses_a_gres_that_is_not_gpu() -> None:
    from dslurm.config import load_site

    site = load_site(ROOT / "site-configs/a100-eth.yaml", ["slurm.gres_name=mps:100"])
    with pytest.raises(ValueError, match="mps:100"):
        shapes.site_shape(site, 2)


def test_parse_site_shape_reads_file_and_node_count() -> None:
    from dslurm.cluster import DEFAULT_SHAPE_NODES, parse_site_shape
    from dslurm.errors import UserError

    site = str(ROOT / "site-configs/a100-eth.yaml")
    assert parse_site_shape(site).nodes == DEFAULT_SHAPE_NODES
    assert parse_site_shape(f"{site}:3").nodes == 3
    with pytest.raises(UserError, match="NODES=0"):
        parse_site_shape(f"{site}:0")
    with pytest.raises(UserError, match="nosuch.yaml"):
        parse_site_shape("nosuch.yaml")


@pytest.mark.parametrize(("args", "word"), [
    (["--gpus-per-node", "99"], "gpus=99"), (["--site-shape", "nosuch.yaml"], "nosuch.yaml"),
])
def test_cluster_up_bad_gpu_flags_exit_2_without_traceback(cli, tmp_path, args: list[str], word: str) -> None:
    res = cli("cluster", "up", "--state-dir", str(tmp_path / "st"), *args)
    assert res.returncode == 2 and word in res.stderr and "Traceback" not in res.stderr, res.stderr


def test_status_lines_name_placeholder_gpus_and_shapes() -> None:
    from dslurm.cluster.show import format_status

    shape = cc.NodeShape(partition="gpu", nodes=16, cpus=96, memory_mb=2_097_152, gpus=8)
    st = {"up": True, "state_dir": "/s", "host_cpus": 2, "nodes": [], "jobs": [],
          "settings": {**_spec(gpus=2, shapes=(shape,)).settings()}}
    text = "\n".join(format_status(st))
    assert "2 placeholder GPU(s)" in text
    assert "partition gpu: 16 never-started node(s) of 8 GPU(s), 96 CPUs" in text


def test_running_nodes_keeps_only_the_started_slurmds_by_exact_name() -> None:
    """The one filter behind `up`'s idle wait, the health check and `status` (three copies before):
    shaped CLOUD nodes, nodes of a bigger earlier cluster and look-alike names are dropped; a
    started node that is down or not responding is kept (health decides on those, not the filter)."""
    from dslurm import slurm

    sinfo = ("node1|idle|4|4096|debug*\nnode2|down*|4|4096|debug*\nnode3|idle|4|4096|debug*\n"
             "node10|idle|4|4096|debug*\ngpu-n1|idle~|96|2097152|gpu\ngpu-n2|idle~|96|2097152|gpu\n"
             "node1|idle|4|4096|other\n")
    parsed = slurm.parse_sinfo_nodes(sinfo)
    kept = cc.running_nodes(parsed, 2)
    assert [n["name"] for n in kept] == ["node1", "node2"]
    assert kept[1]["state"] == "down" and kept[1]["responding"] is False
    assert kept[0]["partitions"] == ["debug", "other"]  # one entry per node, as parse_sinfo_nodes gives
    assert [n["name"] for n in cc.running_nodes(parsed, 3)] == ["node1", "node2", "node3"]
    assert cc.running_nodes(parsed[4:6], 3) == []  # only shaped nodes answered: none running


def test_shape_line_is_the_one_wording_of_up_and_status(capsys, monkeypatch, tmp_path) -> None:
    """`up` and `status` describe a shaped partition with one function (two copies before); each
    keeps its own framing: up prefixes `--test-only`, status appends `for sbatch --test-only`."""
    import argparse

    from dslurm import cluster
    from dslurm.cluster.show import format_status, shape_line
    from dslurm.cluster.state import ClusterInfo

    shape = cc.NodeShape(partition="gpu", nodes=16, cpus=96, memory_mb=2_097_152, gpus=8, gpu_type="h100")
    assert shape_line(shape) == "partition gpu: 16 never-started node(s) of 8 GPU(s), 96 CPUs, 2097152 MB"
    st = {"up": True, "state_dir": "/s", "host_cpus": 2, "nodes": [], "jobs": [],
          "settings": _spec(shapes=(shape,)).settings()}
    assert f"  {shape_line(shape)}, for sbatch --test-only" in format_status(st)

    info = ClusterInfo(state_dir=tmp_path, nodes=2, accounting=False, node_names=("node1", "node2"),
                       shapes=(shape,))
    monkeypatch.setattr(cluster, "up", lambda **kw: info)
    args = argparse.Namespace(cluster_command="up", nodes=2, accounting=False, state_dir=None, cpus=4,
                              gpus_per_node=None, site_shape=None, constrain_devices=None)
    assert cluster.run(args) == 0
    assert f"  --test-only {shape_line(shape)}\n" in capsys.readouterr().out


def test_a_conf_that_differs_only_in_job_requeue_is_a_runtime_change_put_back_by_up() -> None:
    on, off = cc.render_slurm_conf(_spec()), cc.render_slurm_conf(_spec(job_requeue=False))
    assert "JobRequeue=1" in on and "JobRequeue=0" in off
    assert cc.changed_keys(off, on) == {"JobRequeue"} <= cc.RUNTIME_KEYS
    assert cc.changed_keys(on, on) == set()
    more = cc.render_slurm_conf(_spec(nodes=3))  # another node: a restart, never a reconfigure
    assert not cc.changed_keys(on, more) <= cc.RUNTIME_KEYS
    assert cc.first_job_id_of(cc.render_slurm_conf(_spec(first_job_id=4242))) == 4242
    assert cc.first_job_id_of("ClusterName=x\n") is None


def test_device_constraint_mode_renders_task_cgroup_and_cgroup_conf() -> None:
    """`--constrain-devices`: slurmd's task/cgroup with ConstrainDevices only (the tests/cluster GPU
    tests show a step then opens only its own GPUs); off, the conf is as before."""
    on, off = _spec(gpus=2, constrain_devices=True), _spec(gpus=2)
    assert _kv(cc.render_slurm_conf(on))["TaskPlugin"] == "task/cgroup"
    assert _kv(cc.render_slurm_conf(off))["TaskPlugin"] == "task/none"
    assert _kv(cc.render_slurm_conf(on))["ProctrackType"] == "proctrack/pgid"  # cleanup as without it
    kv = _kv(cc.render_cgroup_conf(on))
    assert kv["ConstrainDevices"] == "yes" and kv["CgroupPlugin"] == "cgroup/v1"
    assert kv["ConstrainCores"] == kv["ConstrainRAMSpace"] == "no"
    assert _kv(cc.render_cgroup_conf(off))["ConstrainDevices"] == "no"
    # the cgroup tells GPUs apart by number: each placeholder its own, never /dev/null's 1:3
    assert [cc.gpu_device_number(i) for i in range(3)] == [(195, 0), (195, 1), (195, 2)]
    # recorded only when on: a cluster recorded before the mode existed equals one without it
    assert "constrain_devices" not in off.settings() and on.settings()["constrain_devices"] is True
