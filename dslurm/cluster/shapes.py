"""`--site-shape FILE[:NODES]`: a site config read into the NodeShape of a never-started partition.

Apart from `dslurm.cluster` (which starts and stops daemons) because this is only about reading a
site config: the argument's syntax, the site file and how its partition, GPUs, CPUs, memory and
gres type map onto a `NodeShape`. conf.py says how a shape is declared in slurm.conf.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dslurm.cluster.conf import NodeShape
from dslurm.errors import UserError

if TYPE_CHECKING:
    from dslurm.config import SiteConfig

DEFAULT_SHAPE_NODES = 16  # the largest shipped GPU example (llama70b-h100) asks for 16 nodes


def site_shape(site: SiteConfig, nodes: int) -> NodeShape:
    """The NodeShape of a site config (dslurm.config.SiteConfig): its partition, per-node GPUs,
    CPUs and memory, and the gres type its `--gres` directive names (gres_name `gpu:a100`)."""
    gpu_type = None
    if site.slurm.gpu_directive == "gres":
        name, _, gpu_type = site.slurm.gres_name.partition(":")
        if name != "gpu":
            raise ValueError(f"site {site.name!r}: slurm.gres_name={site.slurm.gres_name!r} is not a gpu gres; "
                             "the local cluster declares only gpu")
    return NodeShape(partition=site.slurm.partition, nodes=nodes, cpus=site.node.cpus,
                     memory_mb=site.node.mem_gb * 1024, gpus=site.node.gpus, gpu_type=gpu_type or None)


def parse_site_shape(arg: str) -> NodeShape:
    """`--site-shape FILE[:NODES]` -> the site's NodeShape (a bad file or count is a UserError)."""
    from dslurm.config import load_site

    path, sep, count = arg.rpartition(":")
    if not (sep and count.isascii() and count.isdigit()):
        path, count = arg, str(DEFAULT_SHAPE_NODES)
    nodes = int(count)
    if nodes < 1:
        raise UserError(f"--site-shape {arg}: NODES={nodes} must be at least 1")
    site = load_site(path)
    try:
        return site_shape(site, nodes)
    except ValueError as exc:
        raise UserError(f"--site-shape {arg}: {exc}") from exc
