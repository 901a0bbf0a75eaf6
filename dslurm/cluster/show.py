"""`dslurm cluster status` for a person: plain aligned lines (pure, no Slurm calls).

The local cluster's nodes *declare* their CPUs and memory in slurm.conf (slurmd runs with
config_overrides): node1..nodeN all share this one machine's cores. The listing says so next to
the numbers, so 3 x 4 CPUs on a 2-core machine is not read as real capacity.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dslurm.cluster.conf import NodeShape, shapes_from_settings


def columns(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows as left-aligned columns two spaces apart (the last column is not padded)."""
    if not rows:
        return []
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return ["  ".join([*(c.ljust(w) for c, w in zip(r, widths)), r[-1]]).rstrip() for r in rows]


def shape_line(shape: NodeShape) -> str:
    """A never-started shaped partition in words (`up` and `status` both print it)."""
    return (f"partition {shape.partition}: {shape.nodes} never-started node(s) of {shape.gpus} GPU(s), "
            f"{shape.cpus} CPUs, {shape.memory_mb} MB")


def format_status(st: Mapping[str, Any]) -> list[str]:
    """The lines of `dslurm cluster status` from `dslurm.cluster.status()`."""
    if not st["up"]:
        return [f"no cluster running (state dir {st['state_dir']})"]
    cfg = st["settings"]
    nodes, jobs = st["nodes"], st["jobs"]
    host = st.get("host_cpus")
    lines = [f"cluster up: {cfg['nodes']} node(s), accounting {'on' if cfg['accounting'] else 'off'} "
             f"(state dir {st['state_dir']})",
             f"  each node declares {cfg['cpus']} CPUs and {cfg['memory_mb']} MB in slurm.conf: not real "
             f"capacity;", f"  all {cfg['nodes']} nodes share this machine's "
             f"{host if host else 'unknown number of'} CPU core(s)"]
    if cfg.get("gpus"):
        lines.append(f"  each node declares {cfg['gpus']} placeholder GPU(s) (gres gpu): jobs get Slurm's GPU "
                     "environment, their processes run on the CPU")
    if cfg.get("constrain_devices"):
        lines.append("  devices constrained (task/cgroup, ConstrainDevices=yes): a step opens only the GPUs "
                     "it was given")
    for shape in shapes_from_settings(cfg.get("shapes")):  # `up` prints the same line its own way
        lines.append(f"  {shape_line(shape)}, for sbatch --test-only")
    lines.append("")
    lines += columns([("NODE", "STATE", "CPUS(DECLARED)", "MEMORY_MB(DECLARED)", "PARTITIONS")] + [
        (str(n["name"]), str(n["state"]) + ("" if n.get("responding", True) else " (not responding)"),
         str(n["cpus"]), str(n["memory_mb"]), ",".join(n["partitions"]) or "-") for n in nodes])
    lines.append("")
    if not jobs:
        return [*lines, "no jobs"]
    return lines + columns([("JOB", "NAME", "STATE", "NODES", "NODELIST/REASON", "TIME")] + [
        (str(j["job_id"]), str(j["name"]), str(j["state"]), str(j["num_nodes"]), str(j["nodes_or_reason"]),
         str(j["time"])) for j in jobs])
