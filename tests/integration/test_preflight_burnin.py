"""The burn-in runner under torchrun with gloo processes on this machine (no GPU, no cluster).
Pseudo-nodes (DSLURM_PSEUDO_NODES) stand in for hosts so localization can be exercised."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dslurm.preflight import EXIT_BAD_NODES, EXIT_OK
from dslurm.preflight.gate import load_report

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
ROOT = Path(__file__).resolve().parents[2]


def burnin(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> tuple[int, dict]:
    report = tmp_path / "burnin.json"
    proc = subprocess.run([sys.executable, "-m", "dslurm", "burnin", "--local", "--report",
                           str(report), *args], cwd=ROOT, env={**os.environ, **(env or {})},
                          capture_output=True, text=True, timeout=60)
    assert report.exists(), proc.stdout + proc.stderr
    return proc.returncode, load_report(report)


def test_one_node_two_processes_passes_with_positive_busbw(tmp_path):
    env = {"DSLURM_FAULT_SLOW_NODE": ""}
    rc, rep = burnin(tmp_path, "--nproc", "2", env=env)
    assert rc == EXIT_OK, rep["verdict"]
    [node] = rep["nodes"]
    assert node["ranks"] == [0, 1] and node["nvml"]["note"] == "no GPUs: NVML checks skipped"
    assert node["intra_busbw_gbps"] > 0
    assert all(p["busbw_gbps"] > 0 and p["ranks"] == 2 for p in node["intra"])
    assert all(g["tflops"] > 0 and g["device"] == "cpu" for g in node["gemm"])
    assert rep["inter"]["busbw_gbps"] is None  # one node: nothing crosses nodes


def test_fault_injected_node_is_localized(tmp_path):
    # Factor 8: the 50 ms fault is ~25x a ~2 ms pair, while noise on 2 shared cores stays < 3x.
    th = tmp_path / "th.json"
    th.write_text(json.dumps({"slow_link_factor": 8.0}))
    rc, rep = burnin(tmp_path, "--nproc", "4", "--pseudo-nodes", "4", "--thresholds", str(th),
                     env={"DSLURM_FAULT_SLOW_NODE": "pnode2:0.05"})
    assert [n["host"] for n in rep["nodes"]] == ["pnode0", "pnode1", "pnode2", "pnode3"]
    assert rep["inter"]["busbw_gbps"] > 0 and rep["inter"]["ranks"] == 4
    assert rep["localization"]["culprits"] == ["pnode2"]
    assert sorted(rep["localization"]["slow_pairs"]) == [["pnode1", "pnode2"], ["pnode2", "pnode3"]]
    assert rep["nodes"][2]["fault_delay_s"] == 0.05
    assert list(rep["verdict"]["bad_nodes"]) == ["pnode2"]
    assert rc == EXIT_BAD_NODES
