"""`dslurm site discover`, pure: recorded Slurm 22.05 answers and a probe record -> the site YAML.

The recordings are the local cluster's (`dslurm cluster up --cpus 2`, then `--gpus-per-node 2`, and a
`--site-shape site-configs/h100-ib.yaml` partition) plus a two-shape partition and an InfiniBand probe.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from dslurm.config import load_job, load_site
from dslurm.config.resolve import resolve
from dslurm.render import RenderRefs, render_sbatch
from dslurm.site.discover import Submitter, pick_interface, propose
from dslurm.site.probe import fs_type, interfaces
from dslurm.slurm import facts as F

ROOT = Path(__file__).resolve().parents[2]

CONFIG = """Configuration data as of 2026-12-02T01:57:06
AccountingStorageType   = accounting_storage/slurmdbd
ClusterName             = dslurm
GresTypes               = gpu
JobRequeue              = 1
KillWait                = 15 sec
SelectType              = select/cons_tres
SLURM_VERSION           = 22.05.8
"""
PARTITIONS = (
    "PartitionName=debug AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=YES QoS=N/A "
    "DefaultTime=NONE DisableRootJobs=NO MaxNodes=UNLIMITED MaxTime=UNLIMITED MinNodes=0 Nodes=node[1-3] "
    "State=UP TotalCPUs=6 TotalNodes=3\n"
    "PartitionName=gpu AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default=NO QoS=N/A "
    "DefaultTime=NONE MaxTime=UNLIMITED Nodes=gpu-n[1-16] State=UP TotalCPUs=1536 TotalNodes=16 "
    "TRES=cpu=1536,mem=32T,node=16,billing=1536,gres/gpu=128\n"
)


def node_line(name: str, cpus: int, mem: int, gres: str = "(null)", part: str = "debug",
              state: str = "IDLE", addr: str = "127.0.0.1") -> str:
    return (f"NodeName={name} Arch=x86_64 CoresPerSocket={cpus} CPUAlloc=0 CPUEfctv={cpus} CPUTot={cpus} "
            f"AvailableFeatures=(null) Gres={gres} NodeAddr={addr} NodeHostName={name} Version=22.05.8 "
            f"RealMemory={mem} State={state} ThreadsPerCore=1 TmpDisk=0 Partitions={part} CfgTRES=cpu={cpus}")


CPU_NODES = "\n".join(node_line(f"node{k}", 2, 4096) for k in (1, 2, 3))
GPU_NODES = "\n".join(node_line(f"node{k}", 4, 4096, "gpu:2") for k in (1, 2, 3))
SHAPE_NODES = "\n".join(node_line(f"gpu-n{k}", 96, 2048 * 1024, "gpu:8", "gpu", "IDLE+CLOUD+POWERED_DOWN")
                        for k in range(1, 17))


def probe_record(node: str = "node1", cpus: int = 2, nvml: dict | None = None, ifs: list | None = None) -> dict:
    return {"node": node, "role": "write", "cpus": cpus, "mem_gb": 23.5,
            "gpus": {"env": {}, "visible": 0, "nvml": nvml},
            "interfaces": ifs or [{"name": "eth0", "ipv4": "192.0.2.2", "state": "up", "kind": "ethernet"},
                                  {"name": "lo", "ipv4": "127.0.0.1", "state": "unknown", "kind": "loopback"}],
            "scratch_candidates": [{"path": "/tmp", "free_gb": 82.8, "fs": "ext4", "writable": True}],
            "software": {"python": "3.11.7", "torch": "2.13.0+cpu", "cuda": None}}


SUB = Submitter(user="alice", cwd="/work/main", venv="/work/main/.venv", cwd_fs="ext4")


def facts(nodes_text: str, partition: str = "debug", assoc: F.Associations | None = None,
          config: str = CONFIG) -> tuple[F.SlurmFacts, F.Partition]:
    parts = F.parse_partitions(PARTITIONS)
    part = F.pick_partition(parts, partition)
    nodes = F.parse_nodes(nodes_text, part.name) or F.hidden_nodes(part, [f"gpu-n{k}" for k in range(1, 17)])
    sf = F.SlurmFacts(config=F.parse_config(config), partitions=tuple(parts), nodes=tuple(nodes),
                      assoc=assoc or F.Associations(accounts=("root",), qos=("normal",), default_account="root",
                                                    available=True))
    return sf, part


def discovered(nodes_text: str, probe: dict | None, **kw) -> tuple[str, list[str]]:
    sf, part = facts(nodes_text, **kw)
    return propose(sf, part, probe, SUB, node_ip="127.0.0.1" if part.name == "debug" else None)


def sbatch_lines(site_path: str | None, text: str | None = None) -> list[str]:
    """The #SBATCH lines of one job rendered for a site. The job gives the time limit and the signal
    lead: neither is a Slurm fact (discover writes GUESSes), the shipped local sites chose theirs."""
    site = load_site(site_path) if site_path else load_site(data=yaml.safe_load(text or ""))
    job = load_job(data={"name": "same", "nodes": 2, "time": "00:10:00", "requeue": {"signal_lead": 30},
                         "preflight": {"enabled": False}})
    r = resolve(site, job, base_dir="/work/main")
    script = render_sbatch(r, RenderRefs(site="site.yaml", job="job.yaml"))
    return [ln for ln in script.splitlines() if ln.startswith("#SBATCH")]


def test_discovered_local_site_renders_the_shipped_local_sbatch_lines():
    text, notes = discovered(CPU_NODES, probe_record())
    assert sbatch_lines(None, text) == sbatch_lines(str(ROOT / "site-configs/local.yaml"))
    site = load_site(data=yaml.safe_load(text))
    assert (site.slurm.partition, site.node.gpus, site.node.cpus, site.network.backend) == ("debug", 0, 2, "gloo")
    assert site.env["GLOO_SOCKET_IFNAME"] == "lo"  # NodeAddr 127.0.0.1: every node is this host
    assert site.setup == ['source "$SLURM_SUBMIT_DIR/.venv/bin/activate"'] and site.python == "python"
    assert site.storage.scratch == "/tmp/dslurm-alice/%n" and site.requeue.enabled
    assert notes == []


def test_discover_comments_say_where_each_value_came_from_and_mark_guesses():
    text, _ = discovered(CPU_NODES, probe_record())
    lines = {ln.split(":")[0].strip(): ln for ln in text.splitlines() if ":" in ln and not ln.lstrip().startswith("#")}
    assert "Default=YES" in lines["partition"]
    assert "scontrol show node" in lines["cpus"] and "4096 MB" in lines["mem_gb"]
    assert "GUESS" in lines["default_time"] and "GUESS" in lines["signal_lead_s"]
    assert "JobRequeue=1" in lines["enabled"]
    assert "# account: root" in text  # the default account: said, not set (Slurm charges it anyway)


def test_discovered_gpu_site_follows_the_gpus_and_renders_local_gpu_lines():
    """`cluster up --gpus-per-node 2`: placeholder GPUs (no NVML): gpus 2, gpus-per-node, gloo."""
    text, _ = discovered(GPU_NODES, probe_record(cpus=2))
    site = load_site(data=yaml.safe_load(text))
    assert (site.node.gpus, site.slurm.gpu_directive, site.slurm.gres_name) == (2, "gpus-per-node", "gpu")
    assert site.network.backend == "gloo" and site.procs_per_node == 2
    assert sbatch_lines(None, text) == sbatch_lines(str(ROOT / "site-configs/local-gpu.yaml"))
    assert "#SBATCH --gpus-per-node=2" in sbatch_lines(None, text)


def test_real_gpus_seen_by_nvml_choose_nccl_and_the_infiniband_devices():
    nvml = {"count": 8, "models": ["NVIDIA H100 80GB HBM3"], "mem_gb": [79.6], "driver": "550"}
    ifs = [{"name": "ens1", "ipv4": "10.1.0.7", "state": "up", "kind": "ethernet"},
           {"name": "ib0", "ipv4": "10.2.0.7", "state": "up", "kind": "infiniband", "rdma_device": "mlx5_0"},
           {"name": "ib1", "ipv4": None, "state": "up", "kind": "infiniband", "rdma_device": "mlx5_1"}]
    sf, part = facts(SHAPE_NODES.replace("IDLE+CLOUD+POWERED_DOWN", "IDLE").replace("127.0.0.1", "10.1.0.7"),
                     partition="gpu")
    text, _ = propose(sf, part, probe_record("gpu-n1", 96, nvml, ifs), SUB, node_ip="10.1.0.7")
    site = load_site(data=yaml.safe_load(text))
    assert site.network.backend == "nccl" and site.node.gpu_model == "NVIDIA H100 80GB HBM3"
    assert site.env["NCCL_SOCKET_IFNAME"] == "ens1"  # the interface holding NodeAddr
    assert site.env["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"


def test_site_shape_partition_is_discovered_as_its_shape_without_a_probe():
    """`--site-shape site-configs/h100-ib.yaml`: its CLOUD nodes never start and `scontrol show node`
    hides them (recorded: "Node gpu-n1 not found"), so the shape comes from the partition's TRES."""
    assert F.parse_nodes("", "gpu") == []
    text, _ = discovered("", None, partition="gpu")
    site = load_site(data=yaml.safe_load(text))
    h100 = load_site(ROOT / "site-configs/h100-ib.yaml")
    assert (site.slurm.partition, site.node.gpus, site.node.cpus, site.node.mem_gb) == \
        (h100.slurm.partition, h100.node.gpus, h100.node.cpus, h100.node.mem_gb)
    assert site.slurm.gpu_directive == h100.slurm.gpu_directive and site.network.backend == "nccl"
    assert "No node was probed" in text and "TRES / TotalNodes" in text
    listed = F.parse_nodes(SHAPE_NODES, "gpu")  # a Slurm that lists them (PrivateData=cloud): the same shape
    assert len(listed) == 16 and not any(n.startable for n in listed)
    assert {n.shape for n in listed} == {F.Shape(cpus=96, mem_mb=2048 * 1024, gpus=8)}


def test_mixed_node_shapes_are_said_plainly():
    mixed = "\n".join([node_line("a1", 64, 512 * 1024, "gpu:a100:4", "gpu"), node_line("a2", 64, 512 * 1024,
                       "gpu:a100:4", "gpu"), node_line("h1", 96, 2048 * 1024, "gpu:h100:8(S:0-1)", "gpu")])
    text, notes = discovered(mixed, None, partition="gpu")
    assert len(notes) == 1 and "mixes 2 node shapes" in notes[0] and "pick yours" in notes[0]
    assert "2 node(s) with 64 CPUs, 512 GB, 4 GPU(s) (gres gpu:a100)" in text
    assert "1 node(s) with 96 CPUs, 2048 GB, 8 GPU(s) (gres gpu:h100)" in text
    site = load_site(data=yaml.safe_load(text))
    assert (site.node.gpus, site.slurm.gres_name) == (4, "gpu:a100")  # the most common shape


def test_gres_strings_parse_to_count_and_type():
    assert F.parse_gres("gpu:2") == (2, None)
    assert F.parse_gres("gpu:h100:8(S:0-1)") == (8, "h100")
    assert F.parse_gres("gpu:a100:4,nic:1") == (4, "a100")
    assert F.parse_gres("(null)") == (0, None)


def test_unknown_partition_names_the_ones_there_are():
    with pytest.raises(ValueError, match=r"'nope' does not exist.*debug, gpu"):
        F.pick_partition(F.parse_partitions(PARTITIONS), "nope")


def test_sacctmgr_and_config_parse():
    accounts, qos = F.parse_assoc("root|normal\nml|normal,high\n")
    assert accounts == ["root", "ml"] and qos == ["normal", "high"]
    cfg = F.parse_config(CONFIG)
    assert cfg["JobRequeue"] == "1" and F.requeue_enabled(cfg) and F.has_accounting(cfg)
    assert not F.requeue_enabled({"JobRequeue": "0"})


def test_interface_choice_follows_nodeaddr():
    p = probe_record()
    assert pick_interface(p, "192.0.2.2")[0] == "eth0"
    assert pick_interface(p, "127.0.0.1")[0] == "lo"
    assert "GUESS" in pick_interface(p, None)[1]


def test_probe_reads_sysfs_interfaces_and_mounts(tmp_path):
    net, ib = tmp_path / "net", tmp_path / "ib"
    for name, kind in (("lo", "772"), ("ib0", "32"), ("eth2", "1"), ("eth0", "1")):
        (net / name).mkdir(parents=True)
        (net / name / "type").write_text(kind + "\n")
        (net / name / "operstate").write_text("up\n")
    (ib / "mlx5_0" / "device" / "net" / "ib0").mkdir(parents=True)
    (ib / "mlx5_2" / "device" / "net" / "eth2").mkdir(parents=True)
    kinds = {i["name"]: (i["kind"], i["rdma_device"]) for i in interfaces(str(net), str(ib))}
    assert kinds == {"lo": ("loopback", None), "ib0": ("infiniband", "mlx5_0"), "eth2": ("roce", "mlx5_2"),
                     "eth0": ("ethernet", None)}
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\nserver:/home /home nfs4 rw 0 0\n")
    assert fs_type("/home/alice/x", str(mounts)) == "nfs4" and fs_type("/tmp", str(mounts)) == "ext4"


def test_discovered_text_has_no_unquoted_surprises():
    """Every value line is `key: scalar  # why`; YAML reads the text back to the same numbers."""
    text, _ = discovered(GPU_NODES, probe_record())
    data = yaml.safe_load(text)
    assert data["node"]["gpus"] == 2 and data["slurm"]["default_time"] == "01:00:00"
    assert all(re.match(r"^\s*(#|- |[a-zA-Z_]+:)", ln) for ln in text.splitlines() if ln.strip())
