"""Planner inputs from the project's site and job files (dslurm.config / dslurm.config.resolve).

Kept apart from the arithmetic so the pure functions never depend on the YAML schema:
this module is the only place that knows which config field feeds which planner input.
Command-line values (`MachineFlags`) are applied before any check that mentions them, so a
"Fix: pass --gpu-mem-gb" is a fix that works.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dslurm.config.layout import Layout
from dslurm.config.models import ModelShape
from dslurm.errors import UserError
from dslurm.plan.layout import Cluster, Workload
from dslurm.plan.memory import trainer_bytes

if TYPE_CHECKING:
    from dslurm.config import SiteConfig
    from dslurm.config.resolve import Resolved


@dataclass(kw_only=True, slots=True)
class MachineFlags:
    """Machine values given on the command line; None = take the site's."""

    gpus_per_node: int | None = None
    gpu_mem_gb: float | None = None
    nvlink_domain: int | None = None
    peak_tflops: float | None = None
    intra_gbytes_per_s: float | None = None
    inter_gbytes_per_s: float | None = None


@dataclass(kw_only=True, slots=True)
class ConfigInputs:
    """What `dslurm plan --site --job` reads: the machine, the model, the work, the layout."""

    model: ModelShape
    cluster: Cluster
    work: Workload
    layout: Layout
    """The job's own layout (`Resolved.layout` itself), to be validated."""


def _pick(flag: float | None, site_value: float) -> float:
    return site_value if flag is None else flag


def cluster_from_site(site: SiteConfig, site_path: str, *, nodes: int, procs_per_node: int,
                      flags: MachineFlags | None = None) -> Cluster:
    """The machine of `nodes` nodes of `site`, command-line values first, then checked.

    A CPU-only site (node.gpus 0, no GPU memory given) plans each process against its share of
    the node's memory, node.mem_gb / procs_per_node, and says so in `Cluster.memory_note`.
    """
    f = flags or MachineFlags()
    node, net = site.node, site.network
    mem, note = (f.gpu_mem_gb, "") if f.gpu_mem_gb is not None else (node.gpu_mem_gb, "")
    if f.gpu_mem_gb is None and mem <= 0 and node.gpus == 0:
        mem = node.mem_gb / procs_per_node
        note = (f"CPU site {site.name!r}: node.mem_gb({node.mem_gb}) / {procs_per_node} processes per node "
                f"= {mem:g} GB per process")
    if f.gpu_mem_gb is None and mem <= 0:
        raise UserError(f"{site_path}: field 'node.gpu_mem_gb' is {node.gpu_mem_gb}: the planner needs the memory "
                        "of one GPU. Fix: set node.gpu_mem_gb in the site file, --site-set node.gpu_mem_gb=80, "
                        "or pass --gpu-mem-gb 80")
    return Cluster(nodes=nodes,
                   gpus_per_node=f.gpus_per_node if f.gpus_per_node is not None else procs_per_node,
                   gpu_mem_gb=mem,
                   nvlink_domain=node.nvlink_domain if f.nvlink_domain is None else f.nvlink_domain,
                   peak_tflops=_pick(f.peak_tflops, node.peak_tflops_bf16),
                   intra_gbytes_per_s=_pick(f.intra_gbytes_per_s, net.intra_node_gbytes_per_s),
                   inter_gbytes_per_s=_pick(f.inter_gbytes_per_s, net.inter_node_gbytes_per_s),
                   memory_note=note)


def from_site(site_path: str, site_overrides: list[str] | None = None, *, nodes: int = 1,
              flags: MachineFlags | None = None) -> Cluster:
    """`dslurm plan --site S` without a job: the site's machine, `nodes` of it."""
    from dslurm.config import load_site

    site = load_site(site_path, site_overrides)
    return cluster_from_site(site, site_path, nodes=nodes, procs_per_node=site.procs_per_node, flags=flags)


def from_files(site_path: str, job_path: str, overrides: list[str] | None = None,
               site_overrides: list[str] | None = None, flags: MachineFlags | None = None) -> ConfigInputs:
    """Load and resolve a site and a job (with `--set` / `--site-set`), and map them onto planner inputs."""
    from dslurm.config.resolve import load, naming_overrides  # the config tree is only needed on this path

    res = load(site_path, job_path, overrides, site_overrides)
    with naming_overrides(overrides, site_overrides):
        return from_resolved(res, flags)


def from_resolved(res: Resolved, flags: MachineFlags | None = None) -> ConfigInputs:
    """Map an already resolved site + job onto planner inputs."""
    job_path, job, lay = res.job_path, res.job, res.layout
    # The one batch rule (dslurm.config.layout), already checked by resolve: this only reads
    # the micro-batch it implies.
    grad_accum = job.train.grad_accum
    micro_batch = lay.micro_batch(job.train.global_batch, grad_accum, where=f"{job_path}: field 'train.global_batch': ")
    work = Workload(micro_batch=micro_batch, global_batch=job.train.global_batch,
                    microbatches=lay.microbatches if lay.pp_enabled else None, grad_accum=grad_accum,
                    recompute=job.train.activation_checkpoint, schedule=job.parallel.pp_schedule,
                    bytes=trainer_bytes(job.train.dtype))
    cluster = cluster_from_site(res.site, res.site_path, nodes=res.nnodes, procs_per_node=res.procs_per_node,
                                flags=flags)
    return ConfigInputs(model=res.shape, cluster=cluster, work=work, layout=lay)
