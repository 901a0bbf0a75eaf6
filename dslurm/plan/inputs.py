"""Planner inputs from the project's site and job files (dslurm.config / dslurm.config.resolve).

Kept apart from the arithmetic so the pure functions never depend on the YAML schema:
this module is the only place that knows which config field feeds which planner input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dslurm.config.layout import Layout
from dslurm.config.models import ModelShape
from dslurm.errors import UserError
from dslurm.plan.layout import Cluster, Workload

if TYPE_CHECKING:
    from dslurm.config.resolve import Resolved


@dataclass(kw_only=True, slots=True)
class ConfigInputs:
    """What `dslurm plan --site --job` reads: the machine, the model, the work, the layout."""

    model: ModelShape
    cluster: Cluster
    work: Workload
    layout: Layout
    """The job's own layout (`Resolved.layout` itself), to be validated."""


def from_files(site_path: str, job_path: str) -> ConfigInputs:
    """Load and resolve a site and a job, and map them onto planner inputs."""
    from dslurm.config.resolve import load  # the config tree is only needed on this path

    return from_resolved(load(site_path, job_path))


def from_resolved(res: Resolved) -> ConfigInputs:
    """Map an already resolved site + job onto planner inputs."""
    site_path, job_path = res.site_path, res.job_path
    node, job, lay = res.site.node, res.job, res.layout
    if node.gpu_mem_gb <= 0:
        raise UserError(f"{site_path}: field 'node.gpu_mem_gb' is {node.gpu_mem_gb}: the planner "
                        "needs the memory of one GPU. Fix: set it in the site file, or pass --gpu-mem-gb")
    if lay.cp != 1:
        raise UserError(f"{job_path}: field 'parallel.cp' is {lay.cp}: the planner does not model "
                        "context parallelism yet. Fix: plan with cp=1")
    # The one batch rule (dslurm.config.layout), already checked by resolve: this only reads
    # the micro-batch it implies.
    grad_accum = job.train.grad_accum
    micro_batch = lay.micro_batch(job.train.global_batch, grad_accum, where=f"{job_path}: field 'train.global_batch': ")
    work = Workload(micro_batch=micro_batch, global_batch=job.train.global_batch,
                    microbatches=lay.microbatches if lay.pp_enabled else None, grad_accum=grad_accum,
                    recompute=job.train.activation_checkpoint)
    cluster = Cluster(nodes=res.nnodes, gpus_per_node=res.procs_per_node, gpu_mem_gb=node.gpu_mem_gb,
                      nvlink_domain=node.nvlink_domain, peak_tflops=node.peak_tflops_bf16)
    return ConfigInputs(model=res.shape, cluster=cluster, work=work, layout=lay)
