"""The verdict: thresholds applied to measured results, the JSON report, the table a person reads.

Everything here works on the plain-dict report (what rank 0 gathered), so it is pure and
testable without a process group. Exit codes: see dslurm.preflight (EXIT_*).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

from dslurm.preflight import EXIT_BAD_NODES, EXIT_OK, EXIT_UNLOCALIZED
from dslurm.preflight.thresholds import Thresholds

SCHEMA = "dslurm.burnin/1"


def _judge_node(node: dict[str, Any], th: Thresholds) -> tuple[list[str], list[str]]:
    """(fail reasons, warn reasons) of one node from its own measurements."""
    fails: list[str] = []
    warns: list[str] = []
    nvml = node.get("nvml") or {}
    for f in nvml.get("findings", []):
        {"fail": fails, "warn": warns}.get(f["severity"], []).append(f["reason"])
    for g in nvml.get("gpus", []):
        for f in g["findings"]:
            {"fail": fails, "warn": warns}.get(f["severity"], []).append(
                f"gpu{g['index']} {f['reason']}")
    peak = th.gpu_peak_tflops
    for rank, g in zip(node.get("ranks", []), node.get("gemm", [])):
        # Peak is a GPU datasheet number: a CPU smoke GEMM is measured, never judged.
        if peak and g["device"].startswith("cuda") and g["tflops"] < th.gemm_min_fraction_of_peak * peak:
            fails.append(f"rank{rank} GEMM {g['tflops']:.0f} TFLOP/s = {g['tflops'] / peak:.0%} "
                         f"of peak {peak:.0f} < {th.gemm_min_fraction_of_peak:.0%}")
        if g["device"] == "cpu" and g["tflops"] * 1e3 < th.cpu_gemm_min_gflops:
            fails.append(f"rank{rank} CPU GEMM {g['tflops'] * 1e3:.2f} GFLOP/s < "
                         f"{th.cpu_gemm_min_gflops} GFLOP/s")
    intra = node.get("intra_busbw_gbps")
    if intra is not None and intra < th.busbw_intra_min_gbytes_per_s:
        fails.append(f"intra-node busbw {intra:.2f} GB/s < {th.busbw_intra_min_gbytes_per_s} GB/s")
    return fails, warns


def _intra_outliers(nodes: list[dict[str, Any]], factor: float) -> dict[str, str]:
    """Nodes whose own all-reduce is `factor`x slower than the best node's. Unlike the ring
    pass this needs no third node: with two nodes, a slow one still shows in its intra-node
    bandwidth (slow NVLink/PCIe, a throttled GPU, or the injected fault)."""
    measured = {n["host"]: n["intra_busbw_gbps"] for n in nodes if n.get("intra_busbw_gbps")}
    if len(measured) < 2:
        return {}
    best_host = max(measured, key=measured.__getitem__)
    best = measured[best_host]
    return {h: f"intra-node busbw {v:.3f} GB/s is {best / v:.1f}x below {best_host} ({best:.3f} GB/s)"
            for h, v in measured.items() if v * factor < best}


def judge(report: dict[str, Any], th: Thresholds) -> dict[str, Any]:
    """Verdict: {"ok", "bad_nodes": {host: [why]}, "warnings": {host: [why]}, "problems": [..]}."""
    bad: dict[str, list[str]] = {}
    warn: dict[str, list[str]] = {}
    problems: list[str] = []
    for node in report["nodes"]:
        fails, warns = _judge_node(node, th)
        if fails:
            bad[node["host"]] = fails
        if warns:
            warn[node["host"]] = warns
    for host, why in _intra_outliers(report["nodes"], th.slow_link_factor).items():
        bad.setdefault(host, []).append(why)
    loc = report.get("localization") or {}
    for host in loc.get("culprits", []):
        bad.setdefault(host, []).append(
            f"slow communication: both ring neighbour exchanges > {th.slow_link_factor}x the "
            f"fastest pair ({loc['baseline_s'] * 1e3:.2f} ms)")
    inter = (report.get("inter") or {}).get("busbw_gbps")
    inter_low = inter is not None and inter < th.busbw_inter_min_gbytes_per_s
    for a, b in loc.get("slow_links", []):
        # One slow link cannot tell which end is at fault: fail both only when it matters.
        for host, other in ((a, b), (b, a)):
            (bad if inter_low else warn).setdefault(host, []).append(f"slow link to {other}")
    if inter_low and not bad:
        problems.append(f"inter-node busbw {inter:.2f} GB/s < {th.busbw_inter_min_gbytes_per_s} GB/s "
                        "and no node localized")
    return {"ok": not bad and not problems, "bad_nodes": bad, "warnings": warn,
            "problems": problems}


def exit_code(verdict: dict[str, Any]) -> int:
    if verdict["bad_nodes"]:
        return EXIT_BAD_NODES
    return EXIT_UNLOCALIZED if verdict["problems"] else EXIT_OK


def bad_nodes(report: dict[str, Any]) -> list[str]:
    """Hostnames to exclude (sorted); the lead's launcher feeds these to --exclude/requeue."""
    return sorted(report["verdict"]["bad_nodes"])


def write_report(path: str | Path, report: dict[str, Any]) -> Path:
    """Atomic and durable (dslurm.durable): a reader sees the old report or the new one."""
    from dslurm.durable import atomic_write_text

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(report, indent=2, sort_keys=True) + "\n")
    return path


def load_report(path: str | Path) -> dict[str, Any]:
    report: dict[str, Any] = json.loads(Path(path).read_text())
    if report.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {report.get('schema')!r}, expected {SCHEMA!r}")
    return report


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def render_table(report: dict[str, Any]) -> str:
    """A short per-node table plus the verdict, as plain text (rich, imported here only)."""
    from rich.console import Console
    from rich.table import Table

    from dslurm.observe.table import WIDE, print_table

    verdict = report["verdict"]
    table = Table(title=f"burn-in: {len(report['nodes'])} node(s), {report['world_size']} ranks, "
                        f"{report['backend']}")
    for col in ("node", "ranks", "NVML", "GEMM TFLOP/s (min)", "intra busbw GB/s", "verdict"):
        table.add_column(col)
    for node in report["nodes"]:
        host = node["host"]
        gemm = min((g["tflops"] for g in node["gemm"]), default=None)
        nvml = node["nvml"]
        state = nvml["note"] if nvml["nvml"] == "skipped" else nvml["severity"]
        why = verdict["bad_nodes"].get(host) or verdict["warnings"].get(host) or []
        mark = "BAD" if host in verdict["bad_nodes"] else ("warn" if why else "ok")
        table.add_row(host, str(len(node["ranks"])), state, _fmt(gemm, ".3f"),
                      _fmt(node.get("intra_busbw_gbps"), ".2f"),
                      mark + ("" if not why else ": " + "; ".join(why)))
    console = Console(file=io.StringIO(), width=WIDE, record=True)
    print_table(console, table)
    inter = report.get("inter") or {}
    console.print(f"inter-node busbw: {_fmt(inter.get('busbw_gbps'), '.2f')} GB/s over "
                  f"{inter.get('ranks', 0)} ranks")
    loc = report.get("localization") or {}
    if loc.get("note"):
        console.print(f"localization: {loc['note']}")
    for p in verdict["problems"]:
        console.print(f"problem: {p}")
    console.print("PASS" if verdict["ok"] else f"FAIL: bad nodes {sorted(verdict['bad_nodes'])}")
    return console.export_text()
