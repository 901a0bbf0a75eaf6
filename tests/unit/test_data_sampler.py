"""The global-batch sampler: tail policies, save/restore, a change of data-parallel size."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from dslurm.config.layout import Layout
from dslurm.errors import UserError
from train.data import GlobalBatchSampler

N, B = 37, 8  # 37 % 8 = 5: an uneven tail on purpose


def samplers(dp_size: int, policy: str = "drop", n: int = N, b: int = B, seed: int = 3):
    return [GlobalBatchSampler(num_samples=n, global_batch=b, dp_rank=r, dp_size=dp_size,
                               seed=seed, policy=policy) for r in range(dp_size)]


def step_all(ranks: list[GlobalBatchSampler]) -> np.ndarray:
    """One step on every rank; the shares concatenated in rank order."""
    return np.concatenate([s.next_ids() for s in ranks])


def reference(steps: int, policy: str = "drop") -> list[np.ndarray]:
    (single,) = samplers(1, policy)
    return [single.next_global() for _ in range(steps)]


def test_drop_no_sample_repeated_or_lost_across_ranks_within_an_epoch():
    ranks = samplers(4)
    assert ranks[0].steps_per_epoch == 4 and ranks[0].local_batch == 2
    seen = np.concatenate([step_all(ranks) for _ in range(ranks[0].steps_per_epoch)])
    assert len(seen) == len(set(seen.tolist())) == N - N % B  # nothing repeated
    # Every sample the epoch order keeps is seen; only the 5-sample tail is missing.
    assert set(seen.tolist()) == set(ranks[0].epoch_order(0).tolist())
    assert all(s.epoch == 1 and s.position == 0 and s.padding_repeats == 0 for s in ranks)


def test_drop_epochs_differ_and_ranks_get_disjoint_contiguous_shares():
    ranks = samplers(4)
    assert not np.array_equal(ranks[0].epoch_order(0), ranks[0].epoch_order(1))
    shares = [s.next_ids() for s in ranks]
    assert not set(shares[0].tolist()) & set(shares[1].tolist())
    np.testing.assert_array_equal(np.concatenate(shares), reference(1)[0])


def test_every_layout_sees_the_single_process_global_batch():
    for dp in (1, 2, 4, 8):
        ranks = samplers(dp)
        got = [step_all(ranks) for _ in range(6)]  # crosses the epoch boundary at step 4
        for a, b in zip(got, reference(6)):
            np.testing.assert_array_equal(a, b)


def test_pad_counts_the_repeats_when_they_are_consumed():
    ranks = samplers(4, "pad")
    assert ranks[0].epoch_length == 40 and ranks[0].steps_per_epoch == 5
    seen = [step_all(ranks) for _ in range(4)]
    assert ranks[0].padding_repeats == 0  # the padded batch is the last one
    seen.append(step_all(ranks))
    assert [s.padding_repeats for s in ranks] == [3, 3, 3, 3]  # global count on every rank
    counts = Counter(np.concatenate(seen).tolist())
    assert len(counts) == N  # every sample seen
    assert sum(c - 1 for c in counts.values()) == 3  # 40 slots, 37 samples
    for _ in range(5):
        step_all(ranks)
    assert ranks[0].padding_repeats == 6  # keeps counting over epochs


def test_restore_continues_the_exact_sequence():
    ranks = samplers(2)
    for _ in range(3):
        step_all(ranks)
    states = [s.state_dict() for s in ranks]
    expected = [step_all(ranks) for _ in range(4)]
    restored = samplers(2)
    for s, st in zip(restored, states):
        s.load_state_dict(st)
    for want in expected:
        np.testing.assert_array_equal(step_all(restored), want)


@pytest.mark.parametrize("policy", ["drop", "pad"])
@pytest.mark.parametrize("old_dp,new_dp", [(4, 2), (2, 8), (8, 1)])
def test_restore_under_another_dp_size_neither_repeats_nor_skips(policy, old_dp, new_dp):
    before = samplers(old_dp, policy)
    got = [step_all(before) for _ in range(3)]
    state = before[0].state_dict()
    assert all(s.state_dict() == state for s in before)  # the state is rank-independent
    after = samplers(new_dp, policy)
    for s in after:
        s.load_state_dict(state)
    got += [step_all(after) for _ in range(5)]
    want = [np.asarray(b) for b in reference(8, policy)]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    assert after[0].padding_repeats == (3 if policy == "pad" else 0)


def test_restore_with_another_global_batch_keeps_the_sample_position():
    (old,) = samplers(1, b=8)
    first = np.concatenate([old.next_global() for _ in range(2)])
    (new,) = samplers(1, b=4)
    new.load_state_dict(old.state_dict())
    nxt = new.next_global()
    np.testing.assert_array_equal(nxt, old.epoch_order(0)[16:20])
    assert not set(nxt.tolist()) & set(first.tolist())


def test_restore_refuses_another_corpus_or_seed():
    (s,) = samplers(1)
    with pytest.raises(UserError, match="num_samples=99"):
        s.load_state_dict({**s.state_dict(), "num_samples": 99})
    with pytest.raises(UserError, match="seed"):
        s.load_state_dict({**s.state_dict(), "seed": 4})


def test_invalid_samplers_are_rejected_with_the_numbers():
    with pytest.raises(ValueError, match=r"global_batch\(6\).*dp_size\(4\)"):
        GlobalBatchSampler(num_samples=N, global_batch=6, dp_size=4)
    with pytest.raises(ValueError, match="cannot fill"):
        GlobalBatchSampler(num_samples=5, global_batch=8, policy="drop")
    with pytest.raises(ValueError, match="dp_rank"):
        GlobalBatchSampler(num_samples=N, global_batch=8, dp_rank=2, dp_size=2)
    small = GlobalBatchSampler(num_samples=5, global_batch=8, policy="pad")
    assert sorted(set(small.next_global().tolist())) == [0, 1, 2, 3, 4]
    assert small.padding_repeats == 3


def test_dp_coords_follow_the_layout():
    layout = Layout(pp=2, dp_replicate=2, dp_shard=2, tp=2)
    coords = [layout.dp_coords(r) for r in range(layout.world_size)]
    assert {size for _, size in coords} == {4}
    assert Counter(dp for dp, _ in coords) == {0: 4, 1: 4, 2: 4, 3: 4}
    for r in range(0, layout.world_size, 2):  # tp peers are consecutive ranks: same batch
        assert coords[r] == coords[r + 1]
    assert layout.dp_coords(layout.rank_of(dp_replicate=1, dp_shard=0)) == (2, 4)


@pytest.mark.parametrize("policy", ["drop", "pad"])
def test_ids_computed_ahead_are_the_global_batch_share_across_plans_epochs_a_skip_and_a_batch_change(
        policy, monkeypatch):
    """next_ids hands out ids computed for ahead_steps steps at once (plan_ids): past a plan's end,
    over many epochs, after a skipped batch and after a restore under another global batch and dp."""
    monkeypatch.setattr("train.sampler.AHEAD_IDS", 64)  # plans of 32 steps: many plan ends in a few steps
    ref, ranks = samplers(1, policy)[0], samplers(4, policy)
    steps = 3 * ranks[0].ahead_steps + 9
    for k in range(steps):
        if k == 40:  # the loop's skip_positions path: a batch taken by next_global, not next_ids
            ref.next_global(), [s.next_global() for s in ranks]
        np.testing.assert_array_equal(step_all(ranks), ref.next_global())
        assert {s.padding_repeats for s in ranks} == {ref.padding_repeats}
    state = ref.state_dict()
    ref6, ranks6 = samplers(1, policy, b=6)[0], samplers(3, policy, b=6)
    for s in (ref6, *ranks6):
        s.load_state_dict(dict(state))
    for _ in range(40):  # the tail moved with the batch: batches straddle epochs now
        np.testing.assert_array_equal(step_all(ranks6), ref6.next_global())
    assert Layout.dp_share(8, 3, 4) == 2


@pytest.mark.parametrize("policy", ["drop", "pad"])
def test_take_hands_out_the_steps_of_next_ids_and_advances_like_them(policy):
    one, bulk = samplers(3, policy, b=6)[1], samplers(3, policy, b=6)[1]
    for steps in (1, 5, 17):
        positions, ids = bulk.take(steps)
        want = [(one.stream_position, one.next_ids()) for _ in range(steps)]
        assert positions == [p for p, _ in want] and ids.tolist() == [i.tolist() for _, i in want]
        assert (bulk.epoch, bulk.position, bulk.padding_repeats) == (one.epoch, one.position, one.padding_repeats)


@pytest.mark.parametrize("old_dp,new_dp", [(4, 2), (1, 8)])
def test_a_block_shuffle_resumes_under_another_dp_size_and_refuses_another_block(old_dp, new_dp):
    def ranks(dp: int, block: int = 4) -> list[GlobalBatchSampler]:
        return [GlobalBatchSampler(num_samples=203, global_batch=8, dp_rank=r, dp_size=dp, seed=3,
                                   shuffle_block=block) for r in range(dp)]

    (single,) = ranks(1)
    want = [single.next_global() for _ in range(60)]  # past two epochs of 25 steps
    before = ranks(old_dp)
    got = [step_all(before) for _ in range(7)]
    state = before[0].state_dict()
    after = ranks(new_dp)
    for s in after:
        s.load_state_dict(state)
    got += [step_all(after) for _ in range(53)]
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    epoch0 = np.concatenate(want[:25])
    assert len(set(epoch0.tolist())) == 200  # drop: 203 - 3, no sample twice
    runs = sum(bool((np.diff(w.reshape(-1, 4), axis=1) == 1).all(axis=1).all()) for w in want)
    assert runs >= 55  # a step's blocks are 4 adjacent samples (but the block the rotation wraps)
    with pytest.raises(UserError, match="data.shuffle_block 4.*now sets 1"):
        GlobalBatchSampler(num_samples=203, global_batch=8, seed=3).load_state_dict(state)
    old = {k: v for k, v in samplers(1)[0].state_dict().items() if k != "shuffle_block"}  # saved before the field
    samplers(1)[0].load_state_dict(old)
