"""The loader: HDF5 windows -> (inputs, targets), and `make_loader` from a resolved job."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dslurm.config import load_job, load_site
from dslurm.config.resolve import resolve
from dslurm.data import tokenize as tk
from dslurm.errors import UserError
from train.data import GlobalBatchSampler, TokenLoader, make_loader, synthetic_path

SITE = Path(__file__).resolve().parents[2] / "site-configs" / "local.yaml"


def resolved_for(tmp_path, **data):
    """A 1-node local job (2 processes, dp=2), tiny model, seq_len 16, global batch 8."""
    job = load_job(data={
        "name": "t", "nodes": 1, "model": {"preset": "tiny", "seq_len": 16},
        "train": {"global_batch": 8, "seed": 5},
        "data": {"synthetic_tokens": 4096, **data},
        "checkpoint": {"run_dir": str(tmp_path / "run")}})
    return resolve(load_site(SITE), job)


def test_batches_are_shifted_windows_of_the_sampled_ids(tmp_path):
    tokens = np.arange(1000) % 251
    tk._write_atomic(tmp_path / "a.h5", [tokens], vocab_size=256, seq_len=0, source="t")
    sampler = GlobalBatchSampler(num_samples=(1000 - 1) // 10, global_batch=4, seed=1)
    loader = TokenLoader(tk.TokenFile(tmp_path / "a.h5"), sampler, seq_len=10)
    ids = GlobalBatchSampler(num_samples=99, global_batch=4, seed=1).next_ids()
    inputs, targets = loader.next_batch()
    assert inputs.dtype == targets.dtype == torch.long and inputs.shape == (4, 10)
    for row, i in enumerate(ids):
        assert inputs[row].tolist() == tokens[i * 10:i * 10 + 10].tolist()
        assert targets[row].tolist() == tokens[i * 10 + 1:i * 10 + 11].tolist()


def test_make_loader_writes_the_synthetic_corpus_once_and_ranks_share_the_global_batch(tmp_path):
    res = resolved_for(tmp_path)
    path = synthetic_path(res.run_dir, 4096, 256, 5)
    with pytest.raises(TimeoutError, match="rank 0 writes it"):
        make_loader(res, 1, 2, rank=1, wait_s=0.05)  # rank 1 never writes
    assert not path.exists()
    rank0 = make_loader(res, 0, 2, rank=0)
    assert path.exists() and tk.read_info(path).seq_len == 16
    mtime = path.stat().st_mtime_ns
    rank1 = make_loader(res, 1, 2, rank=1, wait_s=0.05)
    single = make_loader(res, 0, 1, rank=0)
    assert path.stat().st_mtime_ns == mtime  # reused, not rewritten
    assert rank0.local_batch == 4 and single.local_batch == 8
    for _ in range(3):
        (x0, y0), (x1, y1), (x, y) = rank0.next_batch(), rank1.next_batch(), single.next_batch()
        assert torch.equal(torch.cat([x0, x1]), x) and torch.equal(torch.cat([y0, y1]), y)
        assert x.shape == (8, 16)


def test_loader_state_round_trip_continues_the_sequence(tmp_path):
    res = resolved_for(tmp_path)
    a = make_loader(res, 0, 1, rank=0)
    a.next_batch()
    state = a.state_dict()
    expected = a.next_batch()
    b = make_loader(res, 0, 1, rank=0)
    b.load_state_dict(state)
    got = b.next_batch()
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert b.padding_repeats == 0 and state["position"] == 8


def test_pad_policy_reaches_the_loader_counter(tmp_path):
    # 420 tokens, seq_len 16 -> 26 samples: the epoch pads to 32 with 6 repeats.
    tk.write_synthetic(tmp_path / "c.h5", 420, 256, seed=0)
    res = resolved_for(tmp_path, path=str(tmp_path / "c.h5"), policy="pad")
    loader = make_loader(res, 0, 2, rank=0)
    for _ in range(loader.sampler.steps_per_epoch):
        loader.next_batch()
    assert loader.padding_repeats == 32 - 26


def test_make_loader_rejects_unusable_files(tmp_path):
    tk.write_synthetic(tmp_path / "big_vocab.h5", 5000, 1000, seed=0)
    with pytest.raises(UserError, match="vocab_size 1000 > model vocab_size 256"):
        make_loader(resolved_for(tmp_path, path=str(tmp_path / "big_vocab.h5")), 0, 2, rank=0)
    tk.write_synthetic(tmp_path / "short.h5", 100, 256, seed=0)
    with pytest.raises(UserError, match="6 samples.*global_batch 8.*policy: pad"):
        make_loader(resolved_for(tmp_path, path=str(tmp_path / "short.h5")), 0, 2, rank=0)
    with pytest.raises(UserError, match="no such token file"):
        make_loader(resolved_for(tmp_path, path=str(tmp_path / "none.h5")), 0, 2, rank=0)
