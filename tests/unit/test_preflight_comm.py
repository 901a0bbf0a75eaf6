"""Bandwidth and GEMM arithmetic, fault-injection parsing, rank -> node grouping (pure)."""

from __future__ import annotations

import pytest

from dslurm.errors import UserError
from dslurm.faults import SLOW_NODE as FAULT_ENV
from dslurm.faults import parse_slow_nodes as parse_fault
from dslurm.faults import slow_node_delay as fault_delay
from dslurm.preflight.comm import algbw_gbps, busbw_gbps, make_point, peak_busbw
from dslurm.preflight.gemm import fraction_of_peak, gemm_tflops
from dslurm.preflight.run import group_nodes, merge_pairs, node_identity


def test_algbw_is_bytes_over_time_in_gb():
    assert algbw_gbps(1_000_000_000, 0.5) == pytest.approx(2.0)
    assert algbw_gbps(8 << 20, 1e-3) == pytest.approx(8.388608)


@pytest.mark.parametrize("n, factor", [(1, 0.0), (2, 1.0), (4, 1.5), (8, 1.75), (16, 1.875)])
def test_busbw_is_algbw_times_2_n_minus_1_over_n(n, factor):
    # nccl-tests PERFORMANCE.md: all-reduce busbw = algbw * 2(n-1)/n
    assert busbw_gbps(10.0, n) == pytest.approx(10.0 * factor)


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="positive"):
        algbw_gbps(100, 0.0)
    with pytest.raises(ValueError, match=">= 1"):
        busbw_gbps(1.0, 0)
    with pytest.raises(ValueError, match="positive"):
        gemm_tflops(1, 1, 1, -1.0)


def test_sweep_point_and_peak_uses_largest_size_not_best_value():
    small = make_point(1 << 20, 4, 1e-4)   # tiny message, fast-looking
    large = make_point(64 << 20, 4, 0.1)
    assert small.busbw_gbps == pytest.approx(small.algbw_gbps * 1.5)
    assert peak_busbw([small, large]) == large.busbw_gbps
    assert peak_busbw([]) is None


def test_gemm_tflops_and_fraction():
    assert gemm_tflops(8192, 8192, 8192, 2 * 8192**3 / 500e12) == pytest.approx(500.0)
    assert fraction_of_peak(500.0, 1000.0) == 0.5
    assert fraction_of_peak(500.0, None) is None


def test_parse_fault_several_hosts():
    assert parse_fault("node2:0.05, node5:1") == {"node2": 0.05, "node5": 1.0}
    assert parse_fault("") == {} and parse_fault(None) == {}


@pytest.mark.parametrize("bad", ["node2", "node2:abc", ":0.1", "node2:-1", "a:1,,b:2"])
def test_parse_fault_rejects_malformed_naming_the_variable(bad):
    with pytest.raises(UserError, match=FAULT_ENV):
        parse_fault(bad)


def test_fault_delay_only_for_the_named_host():
    env = {FAULT_ENV: "node2:0.05"}
    assert fault_delay("node2", env) == 0.05
    assert fault_delay("node1", env) == 0.0
    assert fault_delay("node2", {}) == 0.0


def test_group_nodes_orders_by_first_rank_and_handles_uneven_nodes():
    names, ranks = group_nodes(["b", "b", "a", "c", "a"])
    assert names == ["b", "a", "c"]
    assert ranks == [[0, 1], [2, 4], [3]]


def test_merge_pairs_takes_slowest_rail():
    assert merge_pairs([{(0, 1): 1.0}, {(0, 1): 3.0, (1, 2): 2.0}, {}]) == {(0, 1): 3.0, (1, 2): 2.0}


@pytest.mark.parametrize("local_rank, expected", [(0, "pnode0"), (1, "pnode0"), (2, "pnode1"),
                                                  (5, "pnode2")])
def test_pseudo_nodes_split_local_ranks_contiguously(local_rank, expected):
    env = {"DSLURM_PSEUDO_NODES": "3", "LOCAL_RANK": str(local_rank), "LOCAL_WORLD_SIZE": "6"}
    assert node_identity(env) == expected


def test_without_pseudo_nodes_identity_is_the_hostname(mocker):
    mocker.patch("socket.gethostname", return_value="gpu-017")
    assert node_identity({"LOCAL_RANK": "3"}) == "gpu-017"
