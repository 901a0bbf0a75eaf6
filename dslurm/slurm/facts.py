"""Slurm's own answers about a partition, read into typed facts. Pure: text in, dataclasses out.

`scontrol show config` (Key = Value lines), `scontrol -o show partition|node` (one Key=Value
record a line; slurm.parse_scontrol_records), `sacctmgr -nP show assoc|user` (pipe-separated).
The unit tests drive these with output recorded from Slurm 22.05; `gather` (dslurm.site.discover)
runs the commands through slurm.run_cmd.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dslurm.slurm import parse_scontrol_records

_UNSET = ("", "NONE", "UNLIMITED", "INFINITE", "(null)", "N/A")


@dataclass(frozen=True, slots=True)
class Shape:
    """What one node offers a job, as Slurm declares it."""

    cpus: int
    mem_mb: int
    gpus: int = 0
    gpu_type: str | None = None  # the gres type (gpu:h100:8 -> h100)

    def describe(self) -> str:
        gpu = f", {self.gpus} GPU(s) (gres gpu{':' + self.gpu_type if self.gpu_type else ''})" if self.gpus else ""
        return f"{self.cpus} CPUs, {self.mem_mb // 1024} GB{gpu}"


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    shape: Shape
    state: str
    addr: str
    features: tuple[str, ...] = ()
    source: str = "scontrol show node"

    @property
    def startable(self) -> bool:
        """Can a probe run there now: not down, drained, or powered down (a CLOUD node)."""
        s = self.state.upper()
        return not any(w in s for w in ("DOWN", "DRAIN", "FAIL", "CLOUD", "POWERED", "POWER_DOWN", "NOT_RESP"))


@dataclass(frozen=True, slots=True)
class Partition:
    name: str
    default: bool
    nodes_expr: str
    state: str
    default_time: str | None
    max_time: str | None
    allow_accounts: str
    allow_qos: str
    qos: str | None
    total_nodes: int = 0
    total_cpus: int = 0
    tres: str = ""


@dataclass(frozen=True, slots=True)
class Associations:
    """The user's accounts and QOS from sacctmgr (empty when the site keeps no accounting)."""

    accounts: tuple[str, ...] = ()
    qos: tuple[str, ...] = ()
    default_account: str | None = None
    available: bool = False


@dataclass(frozen=True, slots=True)
class SlurmFacts:
    config: Mapping[str, str]
    partitions: tuple[Partition, ...]
    nodes: tuple[Node, ...]  # the chosen partition's nodes
    assoc: Associations = field(default_factory=Associations)

    @property
    def version(self) -> str:
        return self.config.get("SLURM_VERSION", "unknown")

    def shapes(self) -> dict[Shape, list[Node]]:
        """Node shapes of the partition, the most common first (ties: the larger shape first)."""
        groups: dict[Shape, list[Node]] = {}
        for n in self.nodes:
            groups.setdefault(n.shape, []).append(n)
        order = sorted(groups, key=lambda s: (-len(groups[s]), -s.gpus, -s.cpus, -s.mem_mb))
        return {s: groups[s] for s in order}


def parse_config(text: str) -> dict[str, str]:
    """`scontrol show config`: `Key = Value` lines (the header line and blank lines skipped)."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() and " " not in key.strip():
            out[key.strip()] = value.strip()
    return out


def _opt(value: str | None) -> str | None:
    return None if value is None or value.strip() in _UNSET else value.strip()


def parse_partitions(text: str) -> list[Partition]:
    return [Partition(name=r["PartitionName"], default=r.get("Default") == "YES", nodes_expr=r.get("Nodes", ""),
                      state=r.get("State", "UNKNOWN"), default_time=_opt(r.get("DefaultTime")),
                      max_time=_opt(r.get("MaxTime")), allow_accounts=r.get("AllowAccounts", "ALL"),
                      allow_qos=r.get("AllowQos", "ALL"), qos=_opt(r.get("QoS")),
                      total_nodes=int(r.get("TotalNodes") or 0), total_cpus=int(r.get("TotalCPUs") or 0),
                      tres=r.get("TRES", ""))
            for r in parse_scontrol_records(text) if r.get("PartitionName")]


def parse_gres(gres: str) -> tuple[int, str | None]:
    """`gpu:2`, `gpu:h100:8(S:0-1)`, `gpu:a100:4,nic:1` -> (GPUs, type or None). Pure."""
    count, types = 0, set()
    for item in re.sub(r"\([^)]*\)", "", gres or "").split(","):
        parts = item.strip().split(":")
        if parts[0] != "gpu" or len(parts) < 2:
            continue
        if parts[-1].isdigit():
            count += int(parts[-1])
            if len(parts) == 3:
                types.add(parts[1])
        else:
            count += 1
            types.add(parts[1])
    return count, (types.pop() if len(types) == 1 else None)


def parse_nodes(text: str, partition: str | None = None) -> list[Node]:
    """`scontrol -o show node`: every node (of `partition`, when given)."""
    out = []
    for r in parse_scontrol_records(text):
        if not r.get("NodeName"):
            continue
        if partition is not None and partition not in r.get("Partitions", "").split(","):
            continue
        gpus, gtype = parse_gres(r.get("Gres", ""))
        cpus = int(r.get("CPUEfctv") or r.get("CPUTot") or 0)
        feats = tuple(f for f in (_opt(r.get("AvailableFeatures")) or "").split(",") if f)
        out.append(Node(name=r["NodeName"], shape=Shape(cpus=cpus, mem_mb=int(r.get("RealMemory") or 0),
                                                        gpus=gpus, gpu_type=gtype),
                        state=r.get("State", "UNKNOWN"), addr=r.get("NodeAddr") or r["NodeName"], features=feats))
    return out


_UNITS = {"K": 1 / 1024, "M": 1, "G": 1024, "T": 1024**2, "P": 1024**3}


def _mb(text: str) -> int:
    """`32T`, `4G`, `4096M`, `4096` (MB) -> MB."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([KMGTP]?)", text.strip())
    return int(float(m.group(1)) * _UNITS[m.group(2) or "M"]) if m else 0


def hidden_nodes(part: Partition, names: Sequence[str]) -> list[Node]:
    """Nodes `scontrol show node` does not list (CLOUD nodes while powered down) as the partition's
    totals say: its TRES divided by its node count, one shape for all (no gres type: TRES has none)."""
    if not part.total_nodes or not names:
        return []
    tres = dict(kv.partition("=")[::2] for kv in part.tres.split(",") if "=" in kv)
    n = part.total_nodes
    shape = Shape(cpus=part.total_cpus // n, mem_mb=_mb(tres.get("mem", "0")) // n,
                  gpus=int(tres.get("gres/gpu", "0") or 0) // n)
    return [Node(name=x, shape=shape, state="HIDDEN", addr=x,
                 source="scontrol show partition (TRES / TotalNodes: its nodes are hidden, e.g. CLOUD)")
            for x in names]


def parse_assoc(text: str) -> tuple[list[str], list[str]]:
    """`sacctmgr -nP show assoc user=U format=account,qos` -> (accounts, QOS), each once."""
    accounts: list[str] = []
    qos: list[str] = []
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 2 or not parts[0]:
            continue
        accounts += [parts[0]] if parts[0] not in accounts else []
        qos += [q for q in parts[1].split(",") if q and q not in qos]
    return accounts, qos


def has_accounting(config: Mapping[str, str]) -> bool:
    return config.get("AccountingStorageType", "accounting_storage/none") != "accounting_storage/none"


def requeue_enabled(config: Mapping[str, str]) -> bool:
    """slurm.conf JobRequeue (1, the default, when Slurm omits it)."""
    return config.get("JobRequeue", "1").strip() not in ("0", "NO", "no")


def gpus_per_node_supported(config: Mapping[str, str]) -> bool:
    """`--gpus-per-node` needs select/cons_tres (Slurm >= 19.05); select/cons_res knows only --gres."""
    return "cons_tres" in config.get("SelectType", "select/cons_tres")


def pick_partition(partitions: Sequence[Partition], wanted: str | None) -> Partition:
    """The partition asked for, else Slurm's default one. ValueError names the ones there are."""
    names = ", ".join(p.name for p in partitions) or "(none)"
    if wanted is not None:
        for p in partitions:
            if p.name == wanted:
                return p
        raise ValueError(f"partition {wanted!r} does not exist on this cluster; its partitions: {names}")
    for p in partitions:
        if p.default:
            return p
    raise ValueError(f"this cluster has no default partition; choose one with --partition (of {names})")
