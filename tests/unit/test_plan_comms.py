"""Collectives, pipeline bubble, tensor-parallel shapes and MFU against the seeds."""

import math

import pytest

from dslurm.errors import UserError
from dslurm.plan.comms import (
    all_gather_bytes,
    allreduce_mean,
    allreduce_time_s,
    collective_spans,
    fsdp_step_bytes,
    reduce_scatter_bytes,
    ring_allreduce_bytes,
    transfer_time_s,
)
from dslurm.plan.mfu import RECOMPUTE_FLOPS_FACTOR, mfu, model_flops_per_token, tokens_per_s_at
from dslurm.plan.pipeline import bubble_fraction, microbatches_for_bubble, tp_shard_shapes

GB = 1e9


def test_allreduce_average_of_four_ranks():
    assert allreduce_mean([0.8, 1.2, 1.0, 1.4]) == pytest.approx(1.1)


def test_ring_eight_ranks_one_gb_bucket_sends_1_75_gb():
    assert ring_allreduce_bytes(1 * GB, 8) == pytest.approx(1.75 * GB)
    assert reduce_scatter_bytes(1 * GB, 8) + all_gather_bytes(1 * GB, 8) == pytest.approx(1.75 * GB)


def test_ring_volume_tends_to_twice_the_tensor():
    assert ring_allreduce_bytes(16 * GB) == 32 * GB  # seed 004: "about 32 GB per step"
    assert ring_allreduce_bytes(16 * GB, 16384) == pytest.approx(32 * GB, rel=1e-3)
    assert ring_allreduce_bytes(16 * GB, 1) == 0  # one rank talks to nobody


@pytest.mark.parametrize("link, expect_ms", [(900, 36), (50, 640)])
def test_8b_gradients_over_nvlink_and_between_nodes(link, expect_ms):
    assert allreduce_time_s(16 * GB, link) * 1e3 == pytest.approx(expect_ms, rel=0.02)


def test_3b_model_ddp_bytes_per_gpu():
    # Seed 004's check-yourself question: 3B BF16 gradients → about 12 GB sent per GPU.
    assert ring_allreduce_bytes(3e9 * 2, 64) / GB == pytest.approx(11.8, abs=0.05)


def test_fsdp_moves_one_and_a_half_times_ddp():
    assert fsdp_step_bytes(16 * GB, 16 * GB, 8) == pytest.approx(1.5 * ring_allreduce_bytes(16 * GB, 8))


def test_straggler_spans():
    spans = collective_spans([0.045] * 7 + [0.130], 0.070)
    assert spans[:7] == pytest.approx([0.155] * 7)  # 85 ms wait + 70 ms transfer
    assert spans[7] == pytest.approx(0.070)


@pytest.mark.parametrize("m, frac, pct", [(4, 3 / 7, 43), (16, 3 / 19, 16)])
def test_bubble_four_stages(m, frac, pct):
    assert bubble_fraction(4, m) == pytest.approx(frac)
    assert round(100 * bubble_fraction(4, m)) == pct
    assert bubble_fraction(1, m) == 0


def test_microbatches_for_bubble_inverts_it():
    assert microbatches_for_bubble(4, 3 / 19) == 16
    assert microbatches_for_bubble(4, 0.10) == 27
    assert bubble_fraction(4, 27) <= 0.10 < bubble_fraction(4, 26)


def test_tp_mlp_split():
    assert tp_shard_shapes(4096, 16384, 4) == ((4096, 4096), (4096, 4096))
    with pytest.raises(UserError, match="tp=3"):
        tp_shard_shapes(4096, 16384, 3)


def test_mfu_thirty_percent():
    assert 20_000 * 120e9 == pytest.approx(2.4e15)
    assert mfu(20_000, 120e9, 8e15) == pytest.approx(0.30)
    assert tokens_per_s_at(0.30, 120e9, 8e15) == pytest.approx(20_000)


def test_palm_model_flops_and_recompute_excluded():
    # 6N plus 12·L·H·Q·T; Llama-3-8B shape (N without the input embedding).
    n = 8.03e9 - 128256 * 4096
    f = model_flops_per_token(params=n, layers=32, heads=32, head_dim=128, seq_len=8192)
    assert f == pytest.approx(6 * n + 12 * 32 * 32 * 128 * 8192)
    assert f / 1e9 == pytest.approx(57.9, abs=0.1)
    assert RECOMPUTE_FLOPS_FACTOR == pytest.approx(4 / 3)  # one extra forward of three units


@pytest.mark.parametrize("call, field", [
    (lambda: ring_allreduce_bytes(-1, 8), "size_bytes=-1"),
    (lambda: ring_allreduce_bytes(1, 0), "ranks=0"),
    (lambda: transfer_time_s(1, 0), "link_gbytes_per_s=0"),
    (lambda: bubble_fraction(0, 4), "stages=0"),
    (lambda: mfu(1, 1, math.inf), "peak_flops=inf"),
    (lambda: allreduce_mean([]), "ranks=0"),
])
def test_invalid_inputs(call, field):
    with pytest.raises(UserError, match=field):
        call()
