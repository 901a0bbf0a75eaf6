"""Constant-memory orders and splits (train/order.py) and a trillion-token store a rank starts on
(a chunked HDF5 dataset left unallocated: a few KB on disk). Pure or one tiny file: milliseconds,
the trillion-token start a fraction of a second."""

from __future__ import annotations

import time
import tracemalloc
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch  # imported before the clock starts: a rank has torch loaded before its data

from dslurm.config import load_job, load_site
from dslurm.config.resolve import resolve
from dslurm.data import tokenize as tk
from train.data import GlobalBatchSampler, make_loader
from train.order import BLOCK, HashSplit, Permutation, held_flags
from train.sources import held_out_split, split_held_out

SITE = Path(__file__).resolve().parents[2] / "site-configs" / "local.yaml"


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 1000, 4097])
def test_permutation_is_a_bijection_for_any_size(n):
    got = Permutation(n, key=11)[np.arange(n)]
    assert sorted(got.tolist()) == list(range(n))


def test_permutation_scatters_like_a_shuffle_and_depends_on_the_key():
    n = 50_000
    a, b = Permutation(n, 1)[np.arange(n)], Permutation(n, 2)[np.arange(n)]
    assert abs(np.corrcoef(np.arange(n), a)[0, 1]) < 0.02  # no trace of the identity
    assert (a == np.arange(n)).sum() < 10 and (np.abs(np.diff(a)) == 1).sum() < 20  # few fixed points, neighbours
    assert (a == b).mean() < 0.01
    # a position's sample spreads uniformly over keys: the first slot lands in each tenth ~equally often
    first = np.array([Permutation(1000, k)[np.array([0])][0] for k in range(500)])
    assert np.bincount(first // 100, minlength=10).min() > 25  # 50 expected in each
    with pytest.raises(IndexError):
        Permutation(10, 0)[np.array([10])]


def test_a_sampler_over_a_trillion_token_corpus_holds_no_index_and_answers_at_once():
    n = 10**12 // 4096  # samples of 4096 tokens in a trillion
    s = GlobalBatchSampler(num_samples=n, global_batch=1024, dp_rank=3, dp_size=8, seed=1)
    tracemalloc.start()
    t0 = time.perf_counter()
    ids = [s.next_ids() for _ in range(4)]
    elapsed = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert elapsed < 1.0 and peak < 4 << 20  # the old listed order: 2 GB of int64
    assert all(x.shape == (128,) and x.max() < n for x in ids)
    assert len(set(np.concatenate(ids).tolist())) == 512


@pytest.mark.parametrize("n", [5, 1000, 1024, 3000, 20000])
@pytest.mark.parametrize("f", [0.01, 0.2])
def test_hash_split_numbers_each_side_exactly_once_without_listing(n, f):
    held, kept = HashSplit(n, f, held=True), HashSplit(n, f, held=False)
    h, k = held[np.arange(len(held))], kept[np.arange(len(kept))]
    assert len(h) + len(k) == n and not set(h.tolist()) & set(k.tolist())
    assert np.array_equal(np.sort(h), held.materialise()) and np.array_equal(held_flags(h, f), np.ones(len(h), bool))
    if n >= BLOCK:  # stratified: every full block within one sample of its share
        per_block = np.bincount(h[h < n // BLOCK * BLOCK] // BLOCK, minlength=n // BLOCK)
        assert per_block.min() >= int(f * BLOCK) and per_block.max() <= int(f * BLOCK) + 1


def test_held_out_split_is_stable_when_shards_are_appended_and_small_at_scale():
    _, small = split_held_out(20_500, 0.1)
    _, big = split_held_out(31_000, 0.1)
    assert big[big < 20_500].tolist() == small.tolist()  # the partial block decided as if full
    t0 = time.perf_counter()
    keep, held = held_out_split(10**12 // 4096, 0.01)
    assert keep is not None and isinstance(keep, HashSplit) and isinstance(held, HashSplit)
    assert time.perf_counter() - t0 < 2.0 and keep.prefix.nbytes < 4 << 20
    got = keep[np.array([0, 5, len(keep) - 1])]
    assert not held_flags(got, 0.01).any()


def _resolved(tmp_path, path, **data):
    job = load_job(data={
        "name": "t", "nodes": 1, "model": {"preset": "tiny", "seq_len": 4096},
        "train": {"global_batch": 8, "seed": 5},
        "data": {"path": str(path), **data},
        "checkpoint": {"run_dir": str(tmp_path / "run")}})
    return resolve(load_site(SITE), job)


def test_a_rank_starts_on_a_trillion_token_store_in_constant_memory(tmp_path):
    path = tmp_path / "huge.h5"
    with h5py.File(path, "w") as f:  # chunked, never written: the chunks stay unallocated (no disk)
        f.create_dataset(tk.DATASET, shape=(10**12,), dtype=np.uint16, chunks=(1 << 20,))
        f.attrs.update({"format": tk.FORMAT, "format_version": 1, "vocab_size": 256, "seq_len": 4096})
    assert path.stat().st_size < 1 << 20
    for data in ({}, {"val_fraction": 0.01}):
        tracemalloc.start()
        t0 = time.perf_counter()
        loader = make_loader(_resolved(tmp_path, path, prefetch=0, **data), 3, 8, rank=3)
        inputs, targets = loader.next_batch()
        elapsed = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert isinstance(inputs, torch.Tensor) and inputs.shape == (1, 4096)
        assert int(inputs.sum()) == 0  # unallocated chunks read as the fill value
        print(f"trillion-token store {data}: first batch after {elapsed:.2f}s, peak {peak / 2**20:.1f} MB")
        assert elapsed < 10.0, f"{data}: {elapsed:.1f}s to the first batch"
        assert peak < 64 << 20, f"{data}: {peak / 2**20:.1f} MB of index memory"


@pytest.mark.parametrize("n,k", [(1, 4), (3, 4), (4, 4), (103, 4), (4096, 8), (1000, 7), (77, 1)])
def test_a_block_shuffle_is_a_bijection_whose_blocks_are_adjacent_samples(n, k):
    from train.order import BlockPermutation, sample_order

    order = sample_order(n, 1234, k)
    ids = order[np.arange(n)]
    assert sorted(ids.tolist()) == list(range(n))  # every sample exactly once
    if k == 1:  # block 1 is the per-sample order every earlier run has: unchanged
        assert isinstance(order, Permutation) and ids.tolist() == Permutation(n, 1234)[np.arange(n)].tolist()
        return
    assert isinstance(order, BlockPermutation)
    full = n // k
    blocks = ids[:full * k].reshape(full, k) if full else np.empty((0, k), np.int64)
    steps = np.diff(blocks, axis=1)
    # inside a block consecutive ids, but for the one block the rotation wraps past the end
    wrapped = [r for r in range(full) if not (steps[r] == 1).all()]
    assert len(wrapped) <= 1 and all(((steps[r] == 1) | (steps[r] == 1 - n)).all() for r in wrapped)
    for lookups in ([0], [n - 1], list(range(min(n, 20)))):  # one at a time (Python ints) = all at once
        assert order[np.array(lookups)].tolist() == ids[lookups].tolist()


def test_a_block_shuffle_scatters_blocks_and_moves_their_boundaries_every_epoch():
    from train.order import mix_key, sample_order

    n, k = 1 << 16, 4
    e0, e1 = (sample_order(n, mix_key(7, e), k)[np.arange(n)] for e in (0, 1))
    assert not np.array_equal(e0, e1)
    # blocks land anywhere: the first positions' blocks are far apart, not in corpus order
    heads = e0[:4096:k]
    assert np.corrcoef(np.arange(len(heads)), heads)[0, 1] ** 2 < 0.01
    # a block's start mod k is the epoch's shift: it changes, so neighbours regroup
    assert len({int(e0[0]) % k, *(int(sample_order(n, mix_key(7, e), k)[np.array([0])][0]) % k
                                  for e in range(1, 8))}) > 1
