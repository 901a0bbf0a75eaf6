"""Many shards, many sources: the concatenated stream, the held-out rule, the mixture sampler,
the eval batches, and the errors that name the file, the field and the numbers (train/sources.py,
train/data.py). Pure or on tiny HDF5 files: milliseconds each."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dslurm.config import load_job, load_site
from dslurm.config.resolve import resolve
from dslurm.data import tokenize as tk
from dslurm.errors import UserError
from train.data import TokenSource, make_data, make_loader
from train.sources import (
    MIX_PERIOD,
    MixtureSampler,
    MixtureSchedule,
    SampleSpace,
    eval_indices,
    period_counts,
    split_held_out,
)

SITE = Path(__file__).resolve().parents[2] / "site-configs" / "local.yaml"


def resolved_for(tmp_path, train=None, **data):
    """A 1-node local job, tiny model, seq_len 16, global batch 8."""
    job = load_job(data={
        "name": "t", "nodes": 1, "model": {"preset": "tiny", "seq_len": 16},
        "train": {"global_batch": 8, "seed": 5, **(train or {})},
        "data": {"synthetic_tokens": 4096, **data},
        "checkpoint": {"run_dir": str(tmp_path / "run")}})
    return resolve(load_site(SITE), job)


def write_manifest(folder: Path, pieces: list[np.ndarray], vocab: int = 256) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    shards = []
    for i, toks in enumerate(pieces):
        tk._write_atomic(folder / f"shard-{i:05d}.h5", [toks], vocab_size=vocab, seq_len=0, source="t")
        shards.append({"path": f"shard-{i:05d}.h5", "n_tokens": int(toks.size)})
    raw = {"format": "dslurm-manifest", "version": 1, "vocab_size": vocab, "dtype": "uint16",
           "n_tokens": sum(s["n_tokens"] for s in shards), "shards": shards}
    (folder / "manifest.json").write_text(json.dumps(raw))
    return folder / "manifest.json"


def mixture(counts, weights, *, dp_rank=0, dp_size=1, batch=8, seed=3):
    return MixtureSampler(space=SampleSpace([None] * len(counts), list(counts)), weights=list(weights),
                          global_batch=batch, dp_rank=dp_rank, dp_size=dp_size, seed=seed)


# ------------------------------------------------------------------ shards as one stream


def test_a_manifest_reads_as_one_concatenated_stream_with_windows_across_shards(tmp_path):
    tokens = np.arange(1000) % 251
    src = TokenSource(write_manifest(tmp_path / "m", [tokens[:300], tokens[300:310], tokens[310:]]),
                      where="job.yaml: field 'data.path'")
    assert src.n_tokens == 1000 and src.samples(16) == 999 // 16
    for start, length in [(0, 17), (290, 17), (295, 30), (983, 17), (304, 3)]:
        assert src.window(start, length).tolist() == tokens[start:start + length].tolist()
    single = TokenSource(tmp_path / "m", where="w")  # the folder holding the manifest
    assert single.window(299, 12).tolist() == tokens[299:311].tolist()


def test_a_missing_or_short_shard_names_the_manifest_field_and_fix(tmp_path):
    man = write_manifest(tmp_path / "m", [np.arange(100) % 7, np.arange(50) % 7])
    (tmp_path / "m" / "shard-00001.h5").unlink()
    with pytest.raises(UserError, match=r"field 'data.path'.*shard-00001.h5 is missing.*Fix"):
        TokenSource(man, where="job.yaml: field 'data.path'")
    tk._write_atomic(tmp_path / "m" / "shard-00001.h5", [np.arange(40) % 7], vocab_size=256, seq_len=0, source="t")
    with pytest.raises(UserError, match=r"40 tokens but the manifest .* says 50.*Fix"):
        TokenSource(man, where="job.yaml: field 'data.path'")


def test_a_vocabulary_larger_than_the_model_names_both_numbers(tmp_path):
    write_manifest(tmp_path / "big", [np.arange(3000) % 1000], vocab=1000)
    tk.write_synthetic(tmp_path / "ok.h5", 5000, 256, seed=0)
    with pytest.raises(UserError, match=r"data.sources\[1\].path.*vocab_size 1000 > model vocab_size 256.*Fix"):
        make_loader(resolved_for(tmp_path, sources=[{"path": str(tmp_path / "ok.h5")},
                                                    {"path": str(tmp_path / "big"), "weight": 2}]), 0, 1, rank=0)
    tk.write_synthetic(tmp_path / "val.h5", 5000, 1000, seed=0)
    with pytest.raises(UserError, match=r"field 'data.val'.*vocab_size 1000 > model vocab_size 256"):
        make_data(resolved_for(tmp_path, {"eval_every": 2}, val=str(tmp_path / "val.h5")), 0, 1, rank=0)


# ------------------------------------------------------------------ held out


def test_held_out_is_a_fixed_hash_subset_of_about_the_fraction_never_trained_on(tmp_path):
    keep, hold = split_held_out(20000, 0.1)
    assert keep is not None and len(keep) + len(hold) == 20000 and not set(keep.tolist()) & set(hold.tolist())
    assert 0.09 < len(hold) / 20000 < 0.11
    k2, h2 = split_held_out(30000, 0.1)  # more data appended: the earlier samples keep their side
    assert h2[h2 < 20000].tolist() == hold.tolist()
    assert split_held_out(100, 0.0)[0] is None
    res = resolved_for(tmp_path, val_fraction=0.2)
    loader, ev = make_data(res, 0, 1, rank=0)
    space = loader.space
    assert space is not None and ev is None  # eval_every 0: no eval data
    seen = np.concatenate([loader.sampler.next_global() for _ in range(loader.sampler.steps_per_epoch)])
    _, samples = space.locate(seen)
    _, held = split_held_out(4095 // 16, 0.2)
    assert not set(samples.tolist()) & set(held.tolist())
    assert len(set(samples.tolist())) == len(samples)  # no sample twice within the epoch


def test_eval_batches_are_the_same_held_out_samples_every_time_and_split_by_dp(tmp_path):
    res = resolved_for(tmp_path, {"eval_every": 2, "eval_batches": 3}, val_fraction=0.2)
    _, one = make_data(res, 0, 1, rank=0)
    assert one is not None and one.label == "held_out" and one.ids.shape == (3, 8)
    halves = [make_data(res, r, 2, rank=0)[1] for r in range(2)]
    for b in range(3):
        full = one.batch(b)[0]
        parts = [h.batch(b)[0] for h in halves if h is not None]
        assert np.array_equal(np.concatenate([p.numpy() for p in parts]), full.numpy())
    _, held = split_held_out(4095 // 16, 0.2)
    assert set(one.loader.space.locate(one.ids.ravel())[1].tolist()) <= set(held.tolist())
    with pytest.raises(UserError, match="eval_every.*no evaluation data.*Fix"):
        make_data(resolved_for(tmp_path, {"eval_every": 2}), 0, 1, rank=0)


def test_eval_from_a_val_file_reads_it_in_order_from_its_start(tmp_path):
    tk.write_synthetic(tmp_path / "val.h5", 16 * 5 + 1, 256, seed=9)  # 5 samples, cycled to 16
    _, ev = make_data(resolved_for(tmp_path, {"eval_every": 1, "eval_batches": 2}, val=str(tmp_path / "val.h5")),
                      0, 1, rank=0)
    assert ev is not None and ev.label == "val" and ev.ids.ravel().tolist() == [i % 5 for i in range(16)]


# ------------------------------------------------------------------ the mixture


def test_period_counts_are_exact_and_every_source_gets_a_slot():
    c = period_counts([1.0, 2.0, 1.0])
    assert c.sum() == MIX_PERIOD and c.tolist() == [1024, 2048, 1024]
    c = period_counts([1e-6, 1.0, 1.0])
    assert c.sum() == MIX_PERIOD and c[0] == 1


def test_mixture_proportions_are_exact_over_a_period_and_a_pure_function_of_seed_and_slot():
    sched = MixtureSchedule([3.0, 1.0], seed=7)
    src, draw = sched.slots(0, MIX_PERIOD)
    assert np.bincount(src).tolist() == [3072, 1024]
    assert sorted(draw[src == 1].tolist()) == list(range(1024))  # each source's draws in order
    s2, d2 = MixtureSchedule([3.0, 1.0], seed=7).slots(1000, 5000)  # straddles a period, fresh cache
    assert s2[:MIX_PERIOD - 1000].tolist() == src[1000:].tolist()
    assert MixtureSchedule([3.0, 1.0], seed=8).slots(0, 64)[0].tolist() != src[:64].tolist()


def test_mixture_reads_no_sample_twice_within_a_source_epoch():
    m = mixture([50, 30], [1.0, 1.0])
    ids = np.concatenate([m.next_global() for _ in range(6)])  # 48 slots: ~24 per source, < both epochs
    src, _ = m.space.locate(ids)
    for s in (0, 1):
        got = ids[src == s].tolist()
        assert len(got) == len(set(got))
    m = mixture([5, 400], [1.0, 1.0])  # source 0 wraps many epochs: each epoch a permutation
    ids = np.concatenate([m.next_global() for _ in range(40)])
    small = ids[ids < 5]
    for e in range(len(small) // 5):
        assert sorted(small[e * 5:(e + 1) * 5].tolist()) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("dp", [2, 4])
def test_mixture_global_batch_is_the_same_under_any_dp_size(dp):
    ref = mixture([40, 60, 25], [1.0, 2.0, 0.5])
    ranks = [mixture([40, 60, 25], [1.0, 2.0, 0.5], dp_rank=r, dp_size=dp) for r in range(dp)]
    for _ in range(12):
        assert np.concatenate([m.next_ids() for m in ranks]).tolist() == ref.next_global().tolist()


def test_mixture_resume_mid_stream_equals_uninterrupted_even_under_another_dp_and_batch():
    straight = mixture([40, 60], [1.0, 3.0])
    ref = [straight.next_global().tolist() for _ in range(10)]
    first = mixture([40, 60], [1.0, 3.0])
    got = [first.next_global().tolist() for _ in range(4)]
    state = first.state_dict()
    again = [mixture([40, 60], [1.0, 3.0], dp_rank=r, dp_size=2) for r in range(2)]
    for m in again:
        m.load_state_dict(dict(state))
    for _ in range(6):
        got.append(np.concatenate([m.next_ids() for m in again]).tolist())
    assert got == ref
    wider = mixture([40, 60], [1.0, 3.0], batch=16)  # global batch doubled: the slot stream goes on
    wider.load_state_dict(dict(state))
    assert wider.next_global().tolist() == ref[4] + ref[5]
    with pytest.raises(UserError, match="weights=.*Fix"):
        mixture([40, 60], [1.0, 2.0]).load_state_dict(dict(state))


def test_a_single_stream_refuses_a_mixture_state_and_back(tmp_path):
    loader = make_loader(resolved_for(tmp_path), 0, 1, rank=0)
    with pytest.raises(UserError, match="mixture position"):
        loader.load_state_dict(mixture([40, 60], [1.0, 1.0]).state_dict())
    with pytest.raises(UserError, match="single-stream position"):
        mixture([40, 60], [1.0, 1.0]).load_state_dict(loader.state_dict())


def test_a_mixture_job_reads_both_sources_by_weight_through_the_loader(tmp_path):
    a, b = np.full(16 * 200 + 1, 3), np.full(16 * 300 + 1, 7)
    tk._write_atomic(tmp_path / "a.h5", [a], vocab_size=256, seq_len=0, source="t")
    write_manifest(tmp_path / "b", [b[:2000], b[2000:]])
    res = resolved_for(tmp_path, sources=[{"path": str(tmp_path / "a.h5"), "weight": 1},
                                          {"path": str(tmp_path / "b"), "weight": 3}])
    loader = make_loader(res, 0, 1, rank=0)
    rows = np.concatenate([loader.next_batch()[0].numpy() for _ in range(64)])  # 512 samples
    first = rows[:, 0]
    assert set(first.tolist()) == {3, 7} and (rows == rows[:, :1]).all()
    assert 0.2 < float((first == 3).mean()) < 0.3


def test_eval_indices_of_a_mixture_follow_its_weights_over_each_held_out_set_in_order():
    space = SampleSpace([np.array([4, 9]), np.array([1, 2, 3])], [2, 3])
    idx = eval_indices(space, 16, [1.0, 1.0], seed=0)
    src, sample = space.locate(idx)
    assert np.bincount(src, minlength=2).sum() == 16 and set(sample[src == 0].tolist()) <= {4, 9}
    assert eval_indices(space, 7, None, 0).tolist() == [0, 1, 2, 3, 4, 0, 1]


def test_mixture_ids_computed_ahead_equal_the_global_batches_past_a_plan_and_several_periods(monkeypatch):
    monkeypatch.setattr("train.sampler.AHEAD_IDS", 1024)
    ref = mixture([4000, 6000, 2500], [1.0, 2.0, 0.5], batch=16)
    ranks = [mixture([4000, 6000, 2500], [1.0, 2.0, 0.5], dp_rank=r, dp_size=8, batch=16) for r in (0, 5)]
    assert ranks[0].ahead_steps * ranks[0].global_batch >= 2 * MIX_PERIOD  # one plan spans periods
    assert mixture([40, 60, 25], [1.0, 2.0, 0.5], batch=16).ahead_steps < 10  # within a tiny source's epoch
    for _ in range(ranks[0].ahead_steps + 5):
        whole = ref.next_global()
        assert [m.next_ids().tolist() for m in ranks] == [m.local_share(whole).tolist() for m in ranks]


def test_a_block_shuffled_mixture_gives_each_group_of_slots_adjacent_samples_of_one_source():
    def mix(dp_rank: int = 0, dp_size: int = 1, block: int = 4):
        return MixtureSampler(space=SampleSpace.of([None, None], [400, 900]), weights=[1.0, 3.0],
                              global_batch=16, dp_rank=dp_rank, dp_size=dp_size, seed=2, shuffle_block=block)

    ref = mix()
    batches = [ref.next_global() for _ in range(256)]  # one period: 1024 groups of 4; both sources past an epoch
    src, sample = ref.space.locate(np.concatenate(batches))
    groups, ids = src.reshape(-1, 4), sample.reshape(-1, 4)
    assert (groups == groups[:, :1]).all()  # a group of 4 slots is one source's
    adjacent = (np.diff(ids, axis=1) == 1).all(axis=1)
    assert adjacent.mean() > 0.9, adjacent.mean()  # but where an epoch or the rotation cuts a block
    assert np.bincount(groups[:, 0], minlength=2).tolist() == [256, 768]  # exact over a period
    ranks = [mix(r, 4) for r in range(4)]  # the same stream under dp 4
    assert all(np.concatenate([m.next_ids() for m in ranks]).tolist() == b.tolist() for b in batches[:20])
    with pytest.raises(UserError, match="shuffle_block"):
        mix(block=1).load_state_dict(ref.state_dict())
    plain = mixture([400, 900], [1.0, 3.0], batch=16, seed=2)  # block 1: the order of every earlier run
    assert mix(block=1).next_global().tolist() == plain.next_global().tolist()
