"""In-job burn-in runner: `torchrun ... -m dslurm.preflight.run --report PATH`.

One process per GPU (or per CPU process with gloo). Order matters: NVML health first (before
this job allocates GPU memory), then GEMM, intra-node all-reduce, inter-node all-reduce, the
ring-pair localization pass, and Xids drained last. Rank 0 writes the report atomically and
every rank exits with the verdict's code (dslurm.preflight.EXIT_*).

DSLURM_PSEUDO_NODES=N splits the local ranks of one machine into N pseudo-nodes named
pnode0..pnodeN-1, so localization can be tested without a cluster.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Mapping
from typing import Any

from dslurm.faults import slow_node_delay
from dslurm.preflight.comm import CPU_SIZES, GPU_SIZES, peak_busbw
from dslurm.preflight.gate import SCHEMA, exit_code, judge, render_table, write_report
from dslurm.preflight.localize import localize
from dslurm.preflight.thresholds import Thresholds

PSEUDO_ENV = "DSLURM_PSEUDO_NODES"


def node_identity(env: Mapping[str, str]) -> str:
    """This process's node name: the hostname, or a pseudo-node of it (tests)."""
    pseudo = int(env.get(PSEUDO_ENV, "0") or 0)
    if pseudo > 0:
        local_rank = int(env.get("LOCAL_RANK", "0"))
        local_world = int(env.get("LOCAL_WORLD_SIZE", "1"))
        return f"pnode{local_rank * pseudo // local_world}"
    return socket.gethostname()


def group_nodes(hosts: list[str]) -> tuple[list[str], list[list[int]]]:
    """Rank -> host list to (node names, ranks of each node), nodes ordered by first rank."""
    names: list[str] = []
    ranks: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        if host not in ranks:
            names.append(host)
            ranks[host] = []
        ranks[host].append(rank)
    return names, [ranks[n] for n in names]


def merge_pairs(per_rank: list[dict[tuple[int, int], float]]) -> dict[tuple[int, int], float]:
    """A node pair is as slow as its slowest rail (local-rank pair)."""
    out: dict[tuple[int, int], float] = {}
    for d in per_rank:
        for pair, t in d.items():
            out[pair] = max(t, out.get(pair, 0.0))
    return out


def _measure(args: argparse.Namespace, th: Thresholds, device: Any) -> dict[str, Any]:
    """Everything this rank measures; collective calls are made by every rank."""
    import torch.distributed as dist

    from dslurm.preflight.comm import allreduce_sweep
    from dslurm.preflight.gemm import measure_gemm
    from dslurm.preflight.localize import measure_pairs
    from dslurm.preflight.nvml import add_xids, check_node
    from dslurm.preflight.xid import XidWatcher

    rank, host = dist.get_rank(), node_identity(os.environ)
    hosts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, host)
    names, node_ranks = group_nodes(hosts)
    me = names.index(host)
    leader = node_ranks[me][0] == rank
    watcher = XidWatcher() if leader else None
    health = check_node(host, th).to_dict() if leader else None
    delay = slow_node_delay(host)
    sizes = tuple(args.sizes) if args.sizes else (GPU_SIZES if device.type == "cuda" else CPU_SIZES)
    rec: dict[str, Any] = {"rank": rank, "host": host, "delay": delay,
                           "gemm": _asdict(measure_gemm(device))}
    groups = [dist.new_group(r) for r in node_ranks]  # every rank creates every group
    intra = []
    if len(node_ranks[me]) > 1:
        intra = allreduce_sweep(groups[me], sizes, device, delay, iters=args.iters)
    inter = allreduce_sweep(None, sizes, device, delay, iters=args.iters) if len(names) > 1 else []
    pairs = measure_pairs(node_ranks, args.pair_bytes, device, delay) if len(names) > 2 else {}
    if leader:
        rec["health"] = add_xids(health, watcher.drain())  # type: ignore[arg-type,union-attr]  # leader: both set
        rec["intra"] = [_asdict(p) for p in intra]
    rec.update(names=names, node_ranks=node_ranks, pairs=pairs,
               inter=[_asdict(p) for p in inter], device=str(device),
               backend=dist.get_backend())
    return rec


def _asdict(obj: Any) -> dict[str, Any]:
    return {k: getattr(obj, k) for k in obj.__slots__}


def build_report(records: list[dict[str, Any]], th: Thresholds) -> dict[str, Any]:
    """Rank 0: assemble gathered per-rank records into the report and judge it."""
    from dslurm.preflight.comm import SweepPoint

    r0 = records[0]
    names, node_ranks = r0["names"], r0["node_ranks"]
    nodes = []
    for name, ranks in zip(names, node_ranks):
        lead = records[ranks[0]]
        intra = lead.get("intra", [])
        nodes.append({"host": name, "ranks": ranks, "nvml": lead["health"],
                      "gemm": [records[r]["gemm"] for r in ranks], "intra": intra,
                      "intra_busbw_gbps": peak_busbw([SweepPoint(**p) for p in intra]),
                      "fault_delay_s": lead["delay"]})
    inter = r0["inter"]
    pair_s = merge_pairs([r["pairs"] for r in records])
    loc = localize(pair_s, len(names), th.slow_link_factor)
    report = {
        "schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "world_size": len(records), "backend": r0["backend"], "device": r0["device"],
        "thresholds": th.to_dict(), "nodes": nodes,
        "inter": {"ranks": len(records) if inter else 0, "points": inter,
                  "busbw_gbps": peak_busbw([SweepPoint(**p) for p in inter])},
        "localization": {
            "pairs": {f"{names[a]}-{names[b]}": t for (a, b), t in sorted(pair_s.items())},
            "baseline_s": loc.baseline_s, "note": loc.note,
            "slow_pairs": [[names[a], names[b]] for a, b in loc.slow_pairs],
            "culprits": [names[i] for i in loc.culprits],
            "slow_links": [[names[a], names[b]] for a, b in loc.slow_links]},
    }
    report["verdict"] = judge(report, th)
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m dslurm.preflight.run", description=__doc__)
    p.add_argument("--report", required=True, help="JSON report path (written by rank 0)")
    p.add_argument("--site", help="site config YAML: thresholds from its burnin and node sections")
    p.add_argument("--thresholds", help="JSON file with a burnin section (instead of --site)")
    p.add_argument("--expected-gpus", type=int, help="override expected_gpus_per_node")
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")],
                   help="all-reduce sizes in bytes, comma separated")
    p.add_argument("--pair-bytes", type=int, default=1 << 20)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--exit-zero", action="store_true",
                   help="exit 0 once the report is written (torchrun folds any worker code "
                        "into 1, so a caller under torchrun reads the verdict from the report)")
    return p.parse_args(argv)


def load_thresholds(args: argparse.Namespace) -> Thresholds:
    if args.site:
        from dslurm.config import load_site

        data = Thresholds.from_site(load_site(args.site)).to_dict()
    else:
        data = json.loads(open(args.thresholds).read()) if args.thresholds else {}
    if args.expected_gpus is not None:
        data["expected_gpus_per_node"] = args.expected_gpus
    return Thresholds.from_mapping(data, source=args.site or args.thresholds or "burnin")


def run_in_group(args: argparse.Namespace, th: Thresholds, device: Any) -> dict[str, Any]:
    """Measure on every rank of the existing default process group; rank 0 writes the
    report. Returns the verdict on every rank (broadcast), so all ranks act alike."""
    import torch.distributed as dist

    rec = _measure(args, th, device)
    records = [None] * dist.get_world_size() if rec["rank"] == 0 else None
    dist.gather_object(rec, records, dst=0)
    out: list[Any] = [None]
    if rec["rank"] == 0:
        report = build_report(records, th)  # type: ignore[arg-type]  # filled by gather_object
        write_report(args.report, report)
        print(render_table(report), flush=True)
        out = [report["verdict"]]
    dist.broadcast_object_list(out, src=0)
    verdict: dict[str, Any] = out[0]
    return verdict


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    th = load_thresholds(args)
    import torch.distributed as dist

    from dslurm.health.process_group import init_process_group

    device = init_process_group()
    try:
        verdict = run_in_group(args, th, device)
        return 0 if args.exit_zero else exit_code(verdict)  # every task exits alike
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
