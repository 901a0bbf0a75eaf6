"""The site's half of the config tree: `SiteConfig` (the cluster) and its sections: Slurm, the
node, the network, requeue and recovery defaults, storage, the burn-in thresholds, the remote
login.

Each section checks its own fields in `__post_init__` (FieldError names the field and the fix);
the checks that need the whole site (values that land in #SBATCH and export lines, the remote
login) run at loading, in `dslurm.config.load_site` (dslurm/config/__init__.py), which is also
where every other module imports these names from.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Literal

from dslurm.config.container import ContainerSpec
from dslurm.config.envvars import check_env
from dslurm.config.schema import FieldError, field


@dataclass(kw_only=True, slots=True)
class SlurmSpec:
    partition: str = field(help="partition (queue) to submit to")
    account: str | None = field(None, help="account to charge (--account)")
    qos: str | None = field(None, help="quality of service (--qos)")
    gpu_directive: Literal["gpus-per-node", "gres", "none"] = field(
        "gpus-per-node", help="how this site asks for GPUs: --gpus-per-node=N, --gres=NAME:N, or not at all")
    gres_name: str = field("gpu", help="gres name for gpu_directive=gres, e.g. gpu or gpu:h100")
    constraint: str | None = field(None, help="node feature constraint (--constraint)")
    default_time: str = field("01:00:00", help="time limit when the job gives none (Slurm format)")
    log_dir: str = field("logs", help="where --output/--error files go (relative to the submit dir)")


@dataclass(kw_only=True, slots=True)
class NodeSpec:
    gpus: int = field(help="GPUs per node (0 for CPU-only nodes)")
    cpus: int = field(help="CPU cores per node")
    mem_gb: int = field(help="memory per node in GB (informational: jobs ask for --mem=0, all of it)")
    procs_per_node: int | None = field(None, help="training processes per node; default: one per GPU")
    gpu_model: str | None = field(None, help="GPU model, e.g. H100-SXM5-80GB")
    gpu_mem_gb: float = field(0.0, help="memory per GPU in GB")
    peak_tflops_bf16: float = field(0.0, help="dense bf16 peak TFLOP/s per GPU (for MFU); 0 = unknown")
    nvlink_domain: int = field(1, help="GPUs that share one NVLink/NVSwitch domain (TP stays inside it)")

    def __post_init__(self) -> None:
        for name in ("gpus", "cpus", "mem_gb", "nvlink_domain"):
            low = 0 if name == "gpus" else 1
            if getattr(self, name) < low:
                raise FieldError(name, f"{getattr(self, name)} must be at least {low}",
                                 f"set node.{name} to what one node has ({low} or more)")
        if self.procs_per_node is not None and self.procs_per_node < 1:
            raise FieldError("procs_per_node", f"{self.procs_per_node} must be at least 1",
                             "set node.procs_per_node to 1 or more, or remove it (one per GPU)")
        if self.gpus == 0 and self.procs_per_node is None:
            raise FieldError(("gpus", "procs_per_node"), "gpus: 0 leaves the processes per node unknown",
                             "add node.procs_per_node: N (CPU processes per node)")


@dataclass(kw_only=True, slots=True)
class NetworkSpec:
    backend: Literal["nccl", "gloo"] = field("nccl", help="torch.distributed backend")
    intra_node_gbytes_per_s: float = field(0.0, help="per-GPU bandwidth inside a node (NVLink), GB/s")
    inter_node_gbytes_per_s: float = field(0.0, help="per-node bandwidth between nodes, GB/s")


@dataclass(kw_only=True, slots=True)
class SiteRequeueSpec:
    enabled: bool = field(True, help="ask Slurm to requeue jobs on preemption/time limit")
    signal_lead_s: int = field(120, help="seconds before the time limit that USR2 is sent")
    max_restarts: int = field(5, help="restart budget per job")
    no_progress_limit: int = field(3, help="stop after this many starts without the pointer advancing")
    max_stray_stops: int = field(3, help="requeues per job after a stray stop (a TERM that reached the job step "
                                         "but not the batch shell while Slurm still ran the job)")

    def __post_init__(self) -> None:
        if self.signal_lead_s < 1:
            raise FieldError("signal_lead_s", f"{self.signal_lead_s} seconds gives jobs no warning before the time "
                             "limit (killed mid-step, nothing saved)",
                             "give the seconds a step plus a save need, e.g. 120")
        for name in ("max_restarts", "no_progress_limit", "max_stray_stops"):
            if getattr(self, name) < 0:
                raise FieldError(name, f"{getattr(self, name)} must not be negative", "give 0 (none) or more")


@dataclass(kw_only=True, slots=True)
class SiteRecoverySpec:
    warm: bool | Literal["auto"] = field(
        "auto", help="warm restarts inside the allocation (jobs with spares) on this site: true = they work here, "
        "false = never, auto = where `dslurm site check` proved one (its record beside this file; docs/site.md)")


@dataclass(kw_only=True, slots=True)
class StorageSpec:
    durable: str = field("checkpoints", help="root of run directories (checkpoints, ledger); shared by all nodes")
    scratch: str | None = field(None, help="node-local fast storage, if any; %n is the node name "
                                "(SLURMD_NODENAME); used by checkpoint.tiers: two_tier")
    partner: bool = field(False, help="two_tier jobs copy each node's local checkpoint to a partner node unless "
                          "their checkpoint.partner says otherwise")

    def __post_init__(self) -> None:
        if not self.durable.strip():
            raise FieldError("durable", "is empty: every run directory would land in whatever directory a "
                             "command runs in", "give the root shared by all nodes, e.g. /shared/$USER/runs, or "
                             "remove it (the default: checkpoints, under the submit directory)")


_VERSION = re.compile(r"\d+(\.\d+)*")


def version_tuple(text: str) -> tuple[int, ...]:
    """"2.28.3" -> (2, 28, 3). Pure; `text` already matched _VERSION."""
    return tuple(int(p) for p in text.split("."))


@dataclass(kw_only=True, slots=True)
class RefuseSpec:
    """Versions a start refuses to train with (checked by the trainer at each start, where the
    version is known: docs/site.md). A range is inclusive, "2.28.3-2.28.8"; a single version
    "2.27.0" refuses that one."""

    nccl: list[str] = field(factory=list, help="NCCL versions or inclusive ranges a start refuses, e.g. "
                            "[\"2.28.3-2.28.8\"] (a start on a refused NCCL exits 2 naming it)")

    def __post_init__(self) -> None:
        for item in self.nccl:
            lo, _, hi = str(item).partition("-")
            if not _VERSION.fullmatch(lo) or (hi and not _VERSION.fullmatch(hi)):
                raise FieldError("nccl", f"{item!r} is not a version or a range of versions",
                                 'write "2.28.3" or an inclusive range "2.28.3-2.28.8"')
            if hi and version_tuple(hi) < version_tuple(lo):
                raise FieldError("nccl", f"{item!r} ends before it begins", "write the lower version first")

    def refused_nccl(self, version: str | None) -> str | None:
        """The site's entry that refuses NCCL `version`, None when none does (or it is unknown)."""
        if version is None or not _VERSION.fullmatch(version):
            return None
        v = version_tuple(version)
        for item in self.nccl:
            lo, _, hi = item.partition("-")
            if version_tuple(lo) <= v <= version_tuple(hi or lo):
                return item
        return None


@dataclass(kw_only=True, slots=True)
class NodeEvidenceSpec:
    """The site's memory of its nodes (`dslurm site nodes`, docs/site.md): what evidence against a
    node makes new jobs leave it out."""

    exclude_after: int = field(2, help="a node with at least this much recent evidence (decayed weight) is "
                               "excluded from new jobs (--exclude at submit); 0 = never excluded")
    half_life_h: float = field(72.0, help="evidence weighs half as much after this many hours (decay)")

    def __post_init__(self) -> None:
        if self.exclude_after < 0:
            raise FieldError("exclude_after", f"{self.exclude_after} is negative", "give 0 (never) or a count >= 1")
        if not self.half_life_h > 0:
            raise FieldError("half_life_h", f"{self.half_life_h} is not positive", "give hours > 0, e.g. 72")


@dataclass(kw_only=True, slots=True)
class BurninSpec:
    """The burn-in's thresholds: what a healthy node must reach (docs/burnin.md). The one
    definition: `dslurm.preflight.thresholds.Thresholds` is this plus what it takes from the
    node description (GPU count, bf16 peak)."""

    gemm_min_fraction_of_peak: float = field(0.6, help="a GPU whose bf16 GEMM reaches less than this fraction of "
                                             "node.peak_tflops_bf16 fails (no peak: measured, not judged)")
    cpu_gemm_min_gflops: float = field(0.5, help="floor of the fp32 CPU smoke-test GEMM in GFLOP/s (CPU sites); "
                                       "0 = not judged")
    busbw_intra_min_gbytes_per_s: float = field(0.0, help="all-reduce bus bandwidth floor inside a node at the "
                                                "largest size, GB/s; 0 = any")
    busbw_inter_min_gbytes_per_s: float = field(0.0, help="all-reduce bus bandwidth floor across all nodes at the "
                                                "largest size, GB/s; 0 = any")
    slow_link_factor: float = field(3.0, help="a node pair slower than this x the fastest pair is a slow link (the "
                                    "fastest, not the median: in a 3-node ring one slow node makes 2 of 3 pairs slow)")
    max_temp_c: float = field(85.0, help="GPU core temperature ceiling, C: above it fails (it throttles soon)")
    max_ecc_uncorrected: int = field(0, help="uncorrected ECC errors tolerated (volatile or aggregate); more fails")
    min_pcie_gen: int = field(0, help="lowest acceptable current PCIe generation, a warning only (idle GPUs "
                              "downshift the link); 0 = not checked")
    min_free_mem_fraction: float = field(0.9, help="free/total GPU memory below this means someone else holds "
                                         "the GPU (warn)")
    min_power_limit_fraction: float = field(0.9, help="an enforced power limit below this fraction of the default "
                                            "means a capped GPU (warn)")
    allow_drain: bool = field(False, help="may a job drain bad nodes (needs Slurm operator rights); launcher "
                              "policy, not a threshold")

    def __post_init__(self) -> None:
        if not 0.0 < self.gemm_min_fraction_of_peak <= 1.0:
            raise FieldError("gemm_min_fraction_of_peak", f"{self.gemm_min_fraction_of_peak} must be in (0, 1]",
                             "give the fraction of peak a healthy GPU reaches, e.g. 0.6")
        if self.slow_link_factor <= 1.0:
            raise FieldError("slow_link_factor", f"{self.slow_link_factor} must be > 1",
                             "give how many times slower than the fastest pair is slow, e.g. 3")
        for name in ("min_free_mem_fraction", "min_power_limit_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise FieldError(name, f"{getattr(self, name)} must be in [0, 1]", "give a fraction, e.g. 0.9")


@dataclass(kw_only=True, slots=True)
class RemoteSpec:
    workdir: str | None = field(None, help="with `login`: absolute directory on the cluster that relative run "
                                "directories (storage.durable, checkpoint.run_dir) resolve against there")
    dslurm: str = field("dslurm", help="with `login`: the command that runs dslurm on the login host, after the "
                        "site's setup lines, split like a shell: /opt/venv/bin/dslurm or python3 -m dslurm")
    ssh_config: str | None = field(None, help="with `login`: an ssh config file to use instead of ~/.ssh/config "
                                   "(ssh -F)")


@dataclass(kw_only=True, slots=True)
class SiteConfig:
    name: str = field(help="short name of the cluster")
    description: str = field("", help="free text")
    slurm: SlurmSpec = field(help="scheduler settings")
    node: NodeSpec = field(help="what one node has")
    network: NetworkSpec = field(factory=NetworkSpec, help="interconnect")
    env: dict[str, str] = field(factory=dict, help="environment exported in every job (NCCL_* etc.)")
    setup: list[str] = field(factory=list, help="shell lines run before launch (modules, venv, container)")
    python: str = field("python3", help="Python interpreter inside the job (after setup), with any "
                        "arguments, split like a shell: python3 -X dev")
    requeue: SiteRequeueSpec = field(factory=SiteRequeueSpec, help="requeue policy")
    recovery: SiteRecoverySpec = field(factory=SiteRecoverySpec, help="recovery inside the allocation")
    storage: StorageSpec = field(factory=StorageSpec, help="where run state lives")
    burnin: BurninSpec = field(factory=BurninSpec, help="pre-flight thresholds")
    container: ContainerSpec | None = field(None, help="run the launcher, burn-in and training in a container "
                                            "(apptainer, singularity or pyxis); docs/containers.md")
    login: str | None = field(None, help="drive this cluster from another machine: the ssh host alias of its "
                              "login node (your ssh config and agent are used); docs/remote.md")
    remote: RemoteSpec = field(factory=RemoteSpec, help="with `login`: where runs live on the cluster and how "
                               "dslurm runs there")
    refuse: RefuseSpec = field(factory=RefuseSpec, help="software versions a start refuses (nccl ranges)")
    nodes: NodeEvidenceSpec = field(factory=NodeEvidenceSpec, help="the site's memory of its nodes: when evidence "
                                    "excludes a node from new jobs (`dslurm site nodes`)")

    def __post_init__(self) -> None:
        check_env(self.env)

    @property
    def procs_per_node(self) -> int:
        return self.node.procs_per_node or self.node.gpus

    @property
    def python_argv(self) -> list[str]:
        """`python` as words: an interpreter may come with arguments (`python3 -X dev`,
        `apptainer exec img.sif python3`); each word is quoted on its own when rendered."""
        return shlex.split(self.python)
