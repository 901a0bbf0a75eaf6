"""`dslurm site discover`: Slurm's answers and one node's probe -> a commented site YAML.

`propose` is pure: SlurmFacts (dslurm/slurm/facts.py), the probe's record (probe.py) and what the submitting
shell knows (its virtual environment) in, the YAML text out, every value with a comment naming
where it came from and GUESS on what no answer decided. The text is written by hand (a YAML
dumper drops comments) and loaded back through dslurm.config.load_site before it is written.
`gather` is the shell: the Slurm commands through slurm.run_cmd and the one-node srun.
"""

from __future__ import annotations

import getpass
import json
import os
import shlex
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dslurm import slurm
from dslurm.errors import SlurmError, UserError
from dslurm.site.probe import TAG
from dslurm.slurm import facts as F

PROBE_TIMEOUT_S = 180.0  # a one-node srun: queue wait + `import torch` on the node


@dataclass(frozen=True, kw_only=True, slots=True)
class Submitter:
    """What the shell that runs discover knows: where Python comes from, where it stands."""

    user: str
    cwd: str
    venv: str | None = None  # sys.prefix of a virtual environment, when discover runs in one
    modules: tuple[str, ...] = ()  # LOADEDMODULES (Lmod / Environment Modules)
    cwd_fs: str = "unknown"

    def setup_lines(self) -> list[tuple[str, str]]:
        """(line, why) for the proposed setup: the modules loaded here, then the venv."""
        out = []
        if self.modules:
            out.append((f"module load {' '.join(self.modules)}", "GUESS: the modules loaded where discover ran"))
        if self.venv:
            rel = os.path.relpath(self.venv, self.cwd)
            if not rel.startswith(".."):  # inside the submit dir: the job finds it there on any node
                out.append((f'source "$SLURM_SUBMIT_DIR/{rel}/bin/activate"',
                            "the virtual environment discover ran from, under the submit dir"))
            else:
                out.append((f"source {shlex.quote(self.venv)}/bin/activate",
                            "the virtual environment discover ran from (every node must see this path)"))
        return out


def submitter() -> Submitter:
    from dslurm.site.probe import fs_type

    venv = sys.prefix if sys.prefix != getattr(sys, "base_prefix", sys.prefix) else os.environ.get("VIRTUAL_ENV")
    mods = tuple(m for m in os.environ.get("LOADEDMODULES", "").split(":") if m)
    return Submitter(user=getpass.getuser(), cwd=os.getcwd(), venv=venv, modules=mods, cwd_fs=fs_type(os.getcwd()))


@dataclass(slots=True)
class Doc:
    """The YAML being written: lines with their comments, and what to tell the user."""

    lines: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def put(self, indent: int, key: str, value: object, why: str) -> None:
        self.lines.append(f"{'  ' * indent}{key}: {_scalar(value)}" + (f"  # {why}" if why else ""))

    def comment(self, indent: int, text: str) -> None:
        self.lines.append(f"{'  ' * indent}# {text}")


def _scalar(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    text = str(value)
    if '"' in text and "'" not in text:
        return f"'{text}'"  # YAML single quotes: no escapes inside
    return json.dumps(text)  # a JSON string is a YAML double-quoted scalar


SHARED_FS = frozenset({"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "fuse.sshfs", "ceph",
                       "fuse.ceph", "wekafs", "panfs", "fuse.glusterfs", "9p", "virtiofs"})


def pick_interface(probe: dict[str, Any], node_ip: str | None) -> tuple[str | None, str]:
    """The interface carrying the address Slurm reaches the node at (NodeAddr), with the why."""
    ifs = probe.get("interfaces", [])
    if node_ip and node_ip.startswith("127."):
        return "lo", f"the nodes' NodeAddr is {node_ip} (loopback): every node is this one host"
    for i in ifs:
        if node_ip and i.get("ipv4") == node_ip:
            return i["name"], f"it carries {node_ip}, the address Slurm reaches {probe.get('node')} at (NodeAddr)"
    up = [i for i in ifs if i.get("kind") != "loopback" and i.get("ipv4") and i.get("state") in ("up", "unknown")]
    if up:
        return up[0]["name"], f"GUESS: the first interface with an IPv4 address on {probe.get('node')}"
    return None, "the probe saw no interface with an IPv4 address"


def propose(sf: F.SlurmFacts, part: F.Partition, probe: dict[str, Any] | None, sub: Submitter,
            node_ip: str | None = None, probe_note: str = "") -> tuple[str, list[str]]:
    """The site YAML text and the notes for the user (mixed shapes, guesses that matter). Pure."""
    d = Doc()
    shapes = sf.shapes()
    if not shapes:
        raise ValueError(f"partition {part.name!r} has no nodes (Nodes={part.nodes_expr or 'none'})")
    shape, members = next(iter(shapes.items()))
    cluster = sf.config.get("ClusterName", "cluster")
    d.comment(0, f"Written by `dslurm site discover` on cluster {cluster} (Slurm {sf.version}), partition "
                 f"{part.name}. Each value says where it came from;")
    d.comment(0, "GUESS marks a value no answer decided: check those. `dslurm site check` tests the file on the "
                 "cluster.")
    if len(shapes) > 1:
        d.comment(0, f"Partition {part.name} has {len(shapes)} node shapes; this file describes the first:")
        for s, ns in shapes.items():
            d.comment(0, f"  {len(ns)} node(s) with {s.describe()}: {', '.join(n.name for n in ns[:6])}"
                         f"{' ...' if len(ns) > 6 else ''}")
        d.comment(0, "For another: set node.* to its numbers and slurm.constraint to a feature only those nodes have.")
        d.notes.append(f"partition {part.name} mixes {len(shapes)} node shapes ("
                       + "; ".join(f"{len(ns)} x {s.describe()}" for s, ns in shapes.items())
                       + f"); the site describes the {len(members)} node(s) with {shape.describe()}: pick yours")
    d.put(0, "name", f"{cluster}-{part.name}", "the cluster (ClusterName) and the partition")
    d.put(0, "description", f"{shape.describe()} per node; discovered by dslurm site discover", "")
    _slurm_section(d, sf, part, shape)
    gpu_real = _node_section(d, shape, members, probe, probe_note)
    _network_env(d, shape, probe, node_ip, gpu_real)
    d.lines.append("setup:")
    lines = sub.setup_lines()
    for line, why in lines:
        d.lines.append(f"  - {_scalar(line)}  # {why}")
    if not lines:
        d.lines[-1] = "setup: []  # GUESS: discover ran outside a virtual environment and loaded no modules"
    d.put(0, "python", "python" if sub.venv else sys.executable,
          "the interpreter of that environment" if sub.venv else "GUESS: the interpreter discover ran with")
    _requeue_storage(d, sf, probe, sub)
    return "\n".join(d.lines) + "\n", d.notes


def _slurm_section(d: Doc, sf: F.SlurmFacts, part: F.Partition, shape: F.Shape) -> None:
    d.lines.append("slurm:")
    d.put(1, "partition", part.name, "scontrol show partition: Default=YES" if part.default
          else "the partition asked for (--partition)")
    a = sf.assoc
    if a.available:
        others = f"; yours: {', '.join(a.accounts)}" if a.accounts else ""
        d.comment(1, f"account: {a.default_account or (a.accounts[0] if a.accounts else '?')}  # sacctmgr: your "
                     f"default account, charged when none is given{others}")
        if a.qos:
            d.comment(1, f"qos: {a.qos[0]}  # sacctmgr: your QOS: {', '.join(a.qos)}; the default applies when none "
                         "is given")
    else:
        d.comment(1, "account, qos: this cluster keeps no accounting (AccountingStorageType=none); none needed")
    if shape.gpus and F.gpus_per_node_supported(sf.config):
        d.put(1, "gpu_directive", "gpus-per-node", f"nodes have gres gpu; SelectType={sf.config.get('SelectType')}")
    elif shape.gpus:
        d.put(1, "gpu_directive", "gres", f"SelectType={sf.config.get('SelectType')} knows only --gres")
    else:
        d.put(1, "gpu_directive", "none", "the nodes have no gpu gres")
    d.put(1, "gres_name", f"gpu:{shape.gpu_type}" if shape.gpu_type else "gpu",
          "scontrol show node: Gres=" + (f"gpu:{shape.gpu_type}:{shape.gpus}" if shape.gpu_type else
                                         f"gpu:{shape.gpus}" if shape.gpus else "(none)"))
    if part.default_time:
        d.put(1, "default_time", part.default_time, "scontrol show partition: DefaultTime")
    else:
        limit = f"MaxTime={part.max_time}" if part.max_time else "MaxTime=UNLIMITED"
        d.put(1, "default_time", "01:00:00", f"GUESS: the partition has no DefaultTime ({limit})")
    d.put(1, "log_dir", "logs", "dslurm's default: relative to the submit dir")


def _node_section(d: Doc, shape: F.Shape, members: list[F.Node], probe: dict[str, Any] | None,
                  probe_note: str) -> bool:
    """node: ...; returns whether the GPUs are real CUDA devices (NVML saw them)."""
    d.lines.append("node:")
    nvml = (probe or {}).get("gpus", {}).get("nvml") or None
    where = f"{members[0].source}: {len(members)} node(s) of this shape"
    d.put(1, "gpus", shape.gpus, f"{where} (Gres)" + (f"; NVML on {probe['node']} counts {nvml['count']}"
                                                        if probe and nvml else ""))
    seen = f"; the probe's process may use {probe['cpus']}" if probe else ""
    d.put(1, "cpus", shape.cpus, f"{where} (CPUs){seen}")
    d.put(1, "mem_gb", shape.mem_mb // 1024, f"{where} ({shape.mem_mb} MB)")
    if not shape.gpus:
        procs = max(1, min(shape.cpus, 8))
        d.put(1, "procs_per_node", procs, "GUESS: no GPUs: one process per CPU (at most 8)")
    if nvml and nvml.get("models"):
        d.put(1, "gpu_model", nvml["models"][0], f"NVML on {probe['node'] if probe else '?'}")
        d.put(1, "gpu_mem_gb", nvml["mem_gb"][0], "NVML: total memory of GPU 0")
    elif shape.gpu_type:
        d.put(1, "gpu_model", shape.gpu_type, "GUESS: the gres type; no NVML answer")
    if shape.gpus:
        d.put(1, "nvlink_domain", shape.gpus, "GUESS: all GPUs of a node share NVLink/NVSwitch (SXM); 1 for PCIe cards")
    else:
        d.put(1, "nvlink_domain", max(1, min(shape.cpus, 8)), "CPU processes of one node share its memory")
    if probe is None:
        d.comment(1, f"No node was probed ({probe_note or 'not asked'}): the values above are Slurm's declarations.")
    return bool(nvml and nvml.get("count"))


def _network_env(d: Doc, shape: F.Shape, probe: dict[str, Any] | None, node_ip: str | None, gpu_real: bool) -> None:
    nccl = bool(shape.gpus) and (gpu_real or probe is None)
    d.lines.append("network:")
    why = ("GPUs NVML can see" if gpu_real else "GUESS: GPUs declared, no probe" if nccl
           else "GPUs declared but NVML saw none on the probed node: processes run on the CPU"
           if shape.gpus else "no GPUs")
    d.put(1, "backend", "nccl" if nccl else "gloo", why)
    d.lines.append("env:")
    var = "NCCL_SOCKET_IFNAME" if nccl else "GLOO_SOCKET_IFNAME"
    if probe is not None:
        iface, why = pick_interface(probe, node_ip)
        if iface:
            d.put(1, var, iface, why)
        ib = [i for i in probe.get("interfaces", [])
              if i.get("kind") in ("infiniband", "roce") and i.get("rdma_device")]
        if nccl and ib:
            devs = ",".join(sorted({str(i["rdma_device"]) for i in ib}))
            d.put(1, "NCCL_IB_HCA", devs, "the probe: RDMA devices behind " + ", ".join(
                f"{i['name']} ({i['kind']})" for i in ib))
        elif nccl:
            d.comment(1, "the probe saw no InfiniBand/RoCE device: NCCL will use TCP sockets between nodes")
    else:
        d.comment(1, f"{var}: set it to the interface between the nodes (no node was probed)")
    if not shape.gpus or not nccl:
        d.put(1, "OMP_NUM_THREADS", "1", "CPU processes: one thread each, so they do not fight over cores")
    if nccl:
        d.put(1, "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1", "a failed collective ends the process (dslurm's watchdog)")


def _requeue_storage(d: Doc, sf: F.SlurmFacts, probe: dict[str, Any] | None, sub: Submitter) -> None:
    d.lines.append("requeue:")
    on = F.requeue_enabled(sf.config)
    d.put(1, "enabled", on, f"scontrol show config: JobRequeue={sf.config.get('JobRequeue', '1 (default)')}")
    d.put(1, "signal_lead_s", 120, "GUESS: seconds a checkpoint save needs, with margin; "
          "`requeue.signal_lead: auto` in a job measures it")
    d.lines.append("storage:")
    shared = sub.cwd_fs in SHARED_FS
    d.put(1, "durable", "checkpoints", f"{'' if shared else 'GUESS: '}relative to the submit dir, on "
          f"{sub.cwd_fs}{' (a shared filesystem)' if shared else ': every node must see it'}")
    local = [c for c in (probe or {}).get("scratch_candidates", [])
             if c.get("writable") and c.get("fs") not in SHARED_FS]
    if local:
        best = max(local, key=lambda c: (c["path"] != "/tmp", c["free_gb"]))
        d.put(1, "scratch", f"{best['path'].rstrip('/')}/dslurm-{sub.user}/%n",
              f"the probe: {best['path']} is {best['fs']} with {best['free_gb']} GB free on "
              f"{probe['node'] if probe else '?'}; %n keeps nodes apart")
    else:
        d.comment(1, "scratch: no node-local candidate seen" + ("" if probe else " (no node was probed)"))


# ------------------------------------------------------------------------------ the shell


def gather(partition: str | None, timeout: float = 60) -> tuple[F.SlurmFacts, F.Partition]:
    """Run the Slurm commands (read-only) and parse them; a wrong partition is a UserError."""
    cfg = F.parse_config(slurm.run_cmd(["scontrol", "show", "config"], timeout=timeout).stdout)
    parts = F.parse_partitions(slurm.run_cmd(["scontrol", "-o", "show", "partition"], timeout=timeout).stdout)
    try:
        part = F.pick_partition(parts, partition)
    except ValueError as exc:
        raise UserError(f"site discover --partition: {exc}. Fix: pass one of them") from None
    nodes = partition_nodes(part, timeout)
    assoc = associations(cfg, timeout)
    return F.SlurmFacts(config=cfg, partitions=tuple(parts), nodes=tuple(nodes), assoc=assoc), part


def partition_nodes(part: F.Partition, timeout: float = 60) -> list[F.Node]:
    """The partition's nodes as `scontrol show node` lists them, else as its totals say (hidden nodes)."""
    from dslurm.slurm.hosts import expand_hosts

    nodes = F.parse_nodes(slurm.run_cmd(["scontrol", "-o", "show", "node"], timeout=timeout).stdout, part.name)
    return nodes or F.hidden_nodes(part, expand_hosts(part.nodes_expr) if part.nodes_expr else [])


def associations(cfg: dict[str, str], timeout: float = 60) -> F.Associations:
    if not F.has_accounting(cfg):
        return F.Associations()
    user = getpass.getuser()
    proc = slurm.run_cmd(["sacctmgr", "-nP", "show", "assoc", f"user={user}", "format=account,qos"],
                         check=False, timeout=timeout)
    if proc.returncode != 0:
        return F.Associations()
    accounts, qos = F.parse_assoc(proc.stdout)
    dflt = slurm.run_cmd(["sacctmgr", "-nP", "show", "user", user, "format=defaultaccount"],
                         check=False, timeout=timeout).stdout.strip().splitlines()
    return F.Associations(accounts=tuple(accounts), qos=tuple(qos), default_account=(dflt[0] if dflt else None) or None,
                          available=True)


def probe_command(sub: Submitter, python: str, extra: list[str] | None = None) -> str:
    """The shell line a probe step runs: the proposed setup lines, then the probe."""
    setup = "; ".join(line for line, _ in sub.setup_lines())
    probe = f"{python} -m dslurm.site.probe {' '.join(shlex.quote(a) for a in extra or [])}".strip()
    return f"{setup}; {probe}" if setup else probe


def run_probe(part: F.Partition, node: F.Node, sub: Submitter, timeout: float = PROBE_TIMEOUT_S,
              ) -> tuple[dict[str, Any] | None, str]:
    """One-node srun of the probe on `node`; (record, why-not)."""
    gres = [f"--gres=gpu{':' + node.shape.gpu_type if node.shape.gpu_type else ''}:{node.shape.gpus}"] \
        if node.shape.gpus else []
    python = "python" if sub.venv else sys.executable
    args = ["srun", f"--partition={part.name}", "--nodes=1", "--ntasks=1", "--exclusive", f"--nodelist={node.name}",
            "--time=00:05:00", "--job-name=dslurm-site-discover", *gres,
            "bash", "-c", probe_command(sub, python)]
    try:
        proc = slurm.run_cmd(args, timeout=timeout, check=False)
    except SlurmError as exc:
        return None, str(exc)
    for line in proc.stdout.splitlines():
        if line.startswith(TAG):
            return json.loads(line[len(TAG):]), ""
    return None, f"srun exit {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-300:]}"


def node_ip(addr: str) -> str | None:
    try:
        return socket.gethostbyname(addr)
    except OSError:
        return None


def discover(partition: str | None, probe: bool = True) -> tuple[str, list[str]]:
    """Everything `dslurm site discover` does but writing: the YAML text and the notes."""
    sf, part = gather(partition)
    sub = submitter()
    shape_nodes = next(iter(sf.shapes().values()), [])
    record, why = None, "--no-probe"
    if probe:
        ready = sorted((n for n in shape_nodes if n.startable), key=lambda n: not n.state.upper().startswith("IDLE"))
        if ready:
            record, why = run_probe(part, ready[0], sub)
        else:
            states = sorted({n.state for n in shape_nodes})
            why = f"no node of this shape can start a job now (state {', '.join(states) or 'none'})"
    addr = (next((n.addr for n in shape_nodes if record and n.name == record.get("node")), None)
            or (shape_nodes[0].addr if shape_nodes else None))
    text, notes = propose(sf, part, record, sub, node_ip=node_ip(addr) if addr else None, probe_note=why)
    if record is None:
        notes.append(f"no node was probed ({why}); node values are Slurm's declarations")
    return text, notes


def validate_and_write(text: str, out: str | None) -> None:
    """Load the text as a site (so a file discover writes always loads), then write it durably."""
    import yaml

    from dslurm.config import load_site
    from dslurm.durable import atomic_write_text

    load_site(data=yaml.safe_load(text))
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, text)
