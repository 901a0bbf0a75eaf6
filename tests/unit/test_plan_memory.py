"""Training memory against seed 000's worked examples (sections 2.1 and 2.4)."""

import pytest

from dslurm.errors import UserError
from dslurm.plan.memory import (
    GB,
    ByteLayout,
    activation_bytes,
    activation_bytes_per_layer,
    logits_bytes,
    persistent_state,
    recompute_memory,
    sharded_state,
    train_memory,
)


def test_8b_adam_layout_is_128_gb_by_kind():
    s = persistent_state(8e9)
    assert (s.weights, s.grads, s.master, s.optimizer) == (16 * GB, 16 * GB, 32 * GB, 64 * GB)
    assert s.total == 128 * GB
    assert ByteLayout().total == 16


@pytest.mark.parametrize("acts_gb, total_gb", [(40, 168), (160, 288)])
def test_8b_with_activations(acts_gb, total_gb):
    assert train_memory(8e9, acts_gb * GB) == pytest.approx(total_gb * GB)


@pytest.mark.parametrize("params, persistent_tb, acts_tb, totals_tb", [
    (70e9, 1.12, (0.3, 1.4), (1.4, 2.5)),
    (405e9, 6.48, (1.5, 8.0), (8.0, 14.5)),
])
def test_scale_examples(params, persistent_tb, acts_tb, totals_tb):
    assert persistent_state(params).total == pytest.approx(persistent_tb * 1e12)
    for a, t in zip(acts_tb, totals_tb):
        # The seed rounds the totals to one decimal ("rough totals").
        assert train_memory(params, a * 1e12) / 1e12 == pytest.approx(t, abs=0.05)


@pytest.mark.parametrize("sharding, per_rank_gb", [
    ("ddp", 128), ("zero1", 56), ("zero2", 44), ("zero3", 32), ("fsdp", 32)])
def test_zero_stages_on_four_ranks(sharding, per_rank_gb):
    assert sharded_state(8e9, 4, sharding).total == pytest.approx(per_rank_gb * GB)


def test_zero1_splits_only_master_and_moments():
    s = sharded_state(8e9, 4, "zero1")
    assert (s.weights, s.grads, s.master + s.optimizer) == (16 * GB, 16 * GB, 24 * GB)


def test_byte_layout_is_a_parameter():
    fp32_adam = ByteLayout(weights=4, grads=4, master=0, optimizer=8)
    assert persistent_state(1e9, fp32_adam).total == 16 * GB
    assert sharded_state(1e9, 2, "zero2", fp32_adam).total == pytest.approx((4 + 12 / 2) * GB)


def test_recomputation_arithmetic_of_the_seed():
    per_layer = 160 * GB / 32
    assert per_layer == 5 * GB
    assert recompute_memory(layers=32, per_layer_bytes=per_layer, layer_input_bytes=0.3 * GB) \
        == pytest.approx(14.6 * GB)  # "about 15 GB instead of 160 GB"


LLAMA8B = dict(dim=4096, ffn_dim=14336, n_heads=32, kv_dim=1024)


def test_gpt_shape_is_korthikanti_without_dropout_masks():
    s, b, h, a = 2048, 2, 1024, 16
    shape = dict(seq_len=s, micro_batch=b, dim=h, ffn_dim=4 * h, n_heads=a, gated_mlp=False)
    # 34·s·b·h less two 1-byte dropout masks (sbh each).
    assert activation_bytes_per_layer(**shape) == (34 - 2) * s * b * h
    assert activation_bytes_per_layer(**shape, tp=4) == 32 * s * b * h / 4
    # Without flash attention the 16-bit softmax output adds 2·a·s²·b (5 with dropout).
    assert activation_bytes_per_layer(**shape, flash_attention=False) == 32 * s * b * h + 2 * a * s * s * b
    # Selective recomputation drops exactly that attention-core term.
    assert activation_bytes_per_layer(**shape, flash_attention=False, recompute="selective") \
        == 32 * s * b * h
    # SwiGLU keeps one more ffn-wide tensor: +2·f bytes per token.
    assert activation_bytes_per_layer(**{**shape, "gated_mlp": True}) == (32 + 8) * s * b * h


def test_8b_shape_estimate_lands_near_the_seed_illustration():
    # Seq 8192, micro-batch 4: the seed's "longer sequence" case (160 GB, 5 GB/layer, 0.3 GB input).
    shape = dict(seq_len=8192, micro_batch=4, **LLAMA8B)
    assert activation_bytes_per_layer(**shape) / GB == pytest.approx(5.0, rel=0.12)
    assert activation_bytes_per_layer(**shape, recompute="full") / GB == pytest.approx(0.3, rel=0.12)
    assert activation_bytes(layers=32, **shape) / GB == pytest.approx(160, rel=0.12)
    assert activation_bytes(layers=32, recompute="full", **shape) / GB == pytest.approx(15, rel=0.15)


def test_logits_are_fp32_and_split_by_tp():
    assert logits_bytes(seq_len=8192, micro_batch=1, vocab_size=128256) == 4 * 8192 * 128256
    assert logits_bytes(seq_len=8192, micro_batch=1, vocab_size=128256, tp=8) == 4 * 8192 * 128256 / 8


@pytest.mark.parametrize("call, field", [
    (lambda: persistent_state(-1), "params=-1"),
    (lambda: sharded_state(8e9, 0), "ranks=0"),
    (lambda: sharded_state(8e9, 4, "zero4"), "zero4"),
    (lambda: ByteLayout(weights=-2), "bytes.weights=-2"),
    (lambda: activation_bytes_per_layer(seq_len=0, micro_batch=1, dim=8, ffn_dim=8, n_heads=1), "seq_len=0"),
    (lambda: activation_bytes_per_layer(seq_len=8, micro_batch=1, dim=8, ffn_dim=8, n_heads=1,
                                        recompute="some"), "some"),
])
def test_invalid_inputs_name_the_field(call, field):
    with pytest.raises(UserError, match=field):
        call()
