"""Planner inputs from the project's site and job files (dslurm.config / dslurm.config.resolve).

Kept apart from the arithmetic so the pure functions never depend on the YAML schema:
this module is the only place that knows which config field feeds which planner input.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dslurm.config.models import ModelShape
from dslurm.errors import UserError
from dslurm.plan.layout import Cluster, Layout, Workload

if TYPE_CHECKING:
    from dslurm.config.resolve import Resolved


@dataclass(kw_only=True, slots=True)
class ConfigInputs:
    """What `dslurm plan --site --job` reads: the machine, the model, the work, the layout."""

    model: ModelShape
    cluster: Cluster
    work: Workload
    layout: Layout
    """The job's own parallel degrees (dp_shard resolved), to be validated."""


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
    # Sequences each data-parallel rank processes per step, split into micro-batches by the
    # pipeline schedule (pp > 1) or by gradient accumulation.
    splits = job.parallel.microbatches if lay.pp > 1 else job.train.grad_accum
    per_step = lay.dp * splits
    if job.train.global_batch % per_step:
        raise UserError(f"{job_path}: field 'train.global_batch' is {job.train.global_batch}: it does "
                        f"not split into dp({lay.dp}) x {'microbatches' if lay.pp > 1 else 'grad_accum'}"
                        f"({splits}). Fix: make it a multiple of {per_step}")
    recompute = job.train.activation_checkpoint
    work = Workload(micro_batch=job.train.global_batch // per_step, global_batch=job.train.global_batch,
                    microbatches=splits if lay.pp > 1 else None, recompute=recompute)
    cluster = Cluster(nodes=res.nnodes, gpus_per_node=res.procs_per_node, gpu_mem_gb=node.gpu_mem_gb,
                      nvlink_domain=node.nvlink_domain, peak_tflops=node.peak_tflops_bf16)
    layout = Layout(tp=lay.tp, pp=lay.pp, dp_shard=lay.dp_shard, dp_replicate=lay.dp_replicate,
                    recompute=recompute, microbatches=splits if lay.pp > 1 else 1)
    return ConfigInputs(model=res.shape, cluster=cluster, work=work, layout=layout)
