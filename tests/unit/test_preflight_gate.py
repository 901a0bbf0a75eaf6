"""Thresholds, the verdict, exit codes, the atomic JSON report and the table (pure)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import re

import pytest

from dslurm.config import BurninSpec
from dslurm.errors import UserError
from dslurm.preflight import EXIT_BAD_NODES, EXIT_OK, EXIT_UNLOCALIZED
from dslurm.preflight.gate import SCHEMA, bad_nodes, exit_code, judge, load_report, render_table, write_report
from dslurm.preflight.thresholds import NOT_THRESHOLDS, Thresholds


def gemm(device="cuda:0", tflops=700.0):
    return {"device": device, "dtype": "bfloat16", "m": 8192, "n": 8192, "k": 8192,
            "seconds": 1.0, "tflops": tflops}


def node(host, ranks=(0, 1), intra=400.0, nvml=None):
    return {"host": host, "ranks": list(ranks), "gemm": [gemm() for _ in ranks],
            "intra": [], "intra_busbw_gbps": intra, "fault_delay_s": 0.0,
            "nvml": nvml or {"nvml": "ok", "note": "", "severity": "ok", "findings": [],
                             "gpus": [{"index": 0, "findings": [
                                 {"check": "ecc", "severity": "ok", "reason": "0"}]}]}}


def report(nodes=None, inter=200.0, loc=None):
    nodes = nodes or [node("n0", (0, 1)), node("n1", (2, 3)), node("n2", (4, 5))]
    return {"schema": SCHEMA, "world_size": 6, "backend": "nccl", "nodes": nodes,
            "inter": {"ranks": 6, "points": [], "busbw_gbps": inter},
            "localization": loc or {"culprits": [], "slow_links": [], "baseline_s": 1e-3,
                                    "note": "", "pairs": {}, "slow_pairs": []}}


TH = Thresholds(gpu_peak_tflops=989.0, busbw_intra_min_gbytes_per_s=300,
                busbw_inter_min_gbytes_per_s=150)


def test_healthy_cluster_passes():
    v = judge(report(), TH)
    assert v == {"ok": True, "bad_nodes": {}, "warnings": {}, "problems": []}
    assert exit_code(v) == EXIT_OK == 0


def test_nvml_failure_makes_node_bad_with_gpu_reason():
    r = report()
    r["nodes"][1]["nvml"]["gpus"][0]["findings"][0] = {
        "check": "ecc", "severity": "fail", "reason": "uncorrected ECC errors {'volatile': 2} > 0"}
    v = judge(r, TH)
    assert v["bad_nodes"] == {"n1": ["gpu0 uncorrected ECC errors {'volatile': 2} > 0"]}
    assert exit_code(v) == EXIT_BAD_NODES == 3
    r["verdict"] = v
    assert bad_nodes(r) == ["n1"]


def test_slow_gpu_gemm_fails_cpu_gemm_judged_by_cpu_floor_only():
    r = report()
    r["nodes"][2]["gemm"][1] = gemm(tflops=400.0)   # 40% of 989 < 60%
    v = judge(r, TH)
    assert list(v["bad_nodes"]) == ["n2"] and "rank5 GEMM 400 TFLOP/s = 40%" in v["bad_nodes"]["n2"][0]
    cpu = report([node("c0", (0,)), node("c1", (1,))], inter=None)
    for n in cpu["nodes"]:
        n["gemm"] = [gemm("cpu", tflops=0.0003)]         # 0.3 GFLOP/s: peak is not applied
    assert judge(cpu, Thresholds(gpu_peak_tflops=989.0, cpu_gemm_min_gflops=0.2))["ok"]
    v = judge(cpu, Thresholds(cpu_gemm_min_gflops=0.5))
    assert sorted(v["bad_nodes"]) == ["c0", "c1"] and "0.30 GFLOP/s < 0.5" in v["bad_nodes"]["c0"][0]


def test_low_intra_busbw_fails_that_node():
    r = report()
    r["nodes"][0]["intra_busbw_gbps"] = 120.0
    v = judge(r, TH)
    assert list(v["bad_nodes"]) == ["n0"]
    assert v["bad_nodes"]["n0"][0] == "intra-node busbw 120.00 GB/s < 300 GB/s"
    assert "3.3x below n1" in v["bad_nodes"]["n0"][1]  # and, relative to its peers, an outlier


def test_localized_culprit_is_bad_even_if_busbw_passes():
    r = report(loc={"culprits": ["n1"], "slow_links": [], "baseline_s": 2e-3, "note": ""})
    v = judge(r, TH)
    assert list(v["bad_nodes"]) == ["n1"] and "both ring neighbour" in v["bad_nodes"]["n1"][0]


def test_slow_link_warns_unless_inter_busbw_is_low():
    loc = {"culprits": [], "slow_links": [["n0", "n1"]], "baseline_s": 1e-3, "note": ""}
    v = judge(report(loc=loc), TH)
    assert v["ok"] and v["warnings"] == {"n0": ["slow link to n1"], "n1": ["slow link to n0"]}
    v = judge(report(inter=100.0, loc=loc), TH)
    assert sorted(v["bad_nodes"]) == ["n0", "n1"] and exit_code(v) == EXIT_BAD_NODES


def test_low_inter_busbw_without_culprit_is_unlocalized():
    v = judge(report(inter=100.0), TH)
    assert not v["ok"] and v["bad_nodes"] == {}
    assert v["problems"] == ["inter-node busbw 100.00 GB/s < 150 GB/s and no node localized"]
    assert exit_code(v) == EXIT_UNLOCALIZED == 4


def test_thresholds_are_the_config_burnin_section_with_one_set_of_defaults():
    # One definition (dslurm/config/site.py BurninSpec): every threshold there, same defaults.
    config_fields = {f.name for f in dataclasses.fields(BurninSpec)} - NOT_THRESHOLDS
    assert config_fields | {"expected_gpus_per_node", "gpu_peak_tflops"} == set(Thresholds().to_dict())
    assert {k: getattr(Thresholds(), k) for k in config_fields} == {k: getattr(BurninSpec(), k) for k in config_fields}
    assert Thresholds().cpu_gemm_min_gflops == 0.5  # was 0.0 here and 0.5 in the config
    Thresholds.from_mapping(dataclasses.asdict(BurninSpec()))


def test_the_slow_link_help_says_what_localize_compares_with():
    help_text = next(f.metadata["help"] for f in dataclasses.fields(BurninSpec) if f.name == "slow_link_factor")
    assert "fastest pair" in help_text and "x the median" not in help_text


def test_min_power_limit_fraction_is_settable_in_the_site_and_checked():
    from dslurm.config import load_site

    site = load_site("site-configs/h100-ib.yaml", ["burnin.min_power_limit_fraction=0.5"])
    assert Thresholds.from_site(site).min_power_limit_fraction == 0.5
    with pytest.raises(UserError, match=r"burnin\.min_power_limit_fraction.*1\.5 must be in \[0, 1\]"):
        load_site("site-configs/h100-ib.yaml", ["burnin.min_power_limit_fraction=1.5"])


def test_unknown_threshold_key_lists_valid_ones():
    with pytest.raises(UserError, match=r"unknown key\(s\) \['max_temp'\].*max_temp_c"):
        Thresholds.from_mapping({"max_temp": 80})


@pytest.mark.parametrize("field, value", [("slow_link_factor", 1.0),
                                          ("gemm_min_fraction_of_peak", 1.5),
                                          ("min_free_mem_fraction", -0.1)])
def test_out_of_range_threshold_names_field_and_value(field, value):
    with pytest.raises(UserError, match=rf"field 'burnin\.{field}': {re.escape(str(value))} must be"):
        Thresholds.from_mapping({field: value})


def test_from_site_takes_gpu_count_and_peak_from_the_node():
    from dslurm.config import load_site

    site = load_site("site-configs/h100-ib.yaml")
    th = Thresholds.from_site(site)
    assert th.expected_gpus_per_node == site.node.gpus
    assert th.gpu_peak_tflops == site.node.peak_tflops_bf16
    assert th.busbw_inter_min_gbytes_per_s == site.burnin.busbw_inter_min_gbytes_per_s
    assert Thresholds.from_site(load_site("site-configs/local.yaml")).expected_gpus_per_node is None


def test_report_written_atomically_and_read_back(tmp_path):
    r = report()
    r["verdict"] = judge(r, TH)
    path = write_report(tmp_path / "sub" / "burnin.json", r)
    assert load_report(path) == json.loads(json.dumps(r))
    assert os.listdir(path.parent) == ["burnin.json"]  # no temp file left


def test_failed_write_keeps_the_old_report_and_no_temp(tmp_path):
    r = report()
    r["verdict"] = judge(r, TH)
    path = write_report(tmp_path / "burnin.json", r)
    broken = copy.deepcopy(r)
    broken["nodes"][0]["oops"] = object()  # not JSON-serialisable
    with pytest.raises(TypeError):
        write_report(path, broken)
    assert load_report(path) == json.loads(json.dumps(r))
    assert os.listdir(tmp_path) == ["burnin.json"]


def test_load_report_rejects_other_schema(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"schema": "other/1"}')
    with pytest.raises(ValueError, match="dslurm.burnin/1"):
        load_report(p)


def test_table_names_bad_node_and_why():
    r = report(inter=100.0, loc={"culprits": ["n2"], "slow_links": [], "baseline_s": 1e-3,
                                 "note": ""})
    r["verdict"] = judge(r, TH)
    text = render_table(r)
    assert "n2" in text and "BAD" in text and "both ring neighbour" in text
    assert "FAIL: bad nodes ['n2']" in text and "100.00 GB/s" in text
    r = report()
    r["verdict"] = judge(r, TH)
    assert render_table(r).rstrip().endswith("PASS")


def test_intra_node_outlier_is_blamed_even_with_two_nodes():
    from dslurm.preflight.gate import _intra_outliers

    nodes = [{"host": "node1", "intra_busbw_gbps": 0.02}, {"host": "node2", "intra_busbw_gbps": 0.9}]
    out = _intra_outliers(nodes, factor=5.0)
    assert list(out) == ["node1"] and "45.0x below node2" in out["node1"]
    assert _intra_outliers([{"host": "a", "intra_busbw_gbps": 0.5}, {"host": "b", "intra_busbw_gbps": 0.2}],
                           factor=5.0) == {}  # 2.5x: machine noise, not a fault
    assert _intra_outliers([{"host": "a", "intra_busbw_gbps": 0.5}], factor=5.0) == {}
