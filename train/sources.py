"""Many sources: the held-out rule, the mixture schedule and its sampler, the eval samples.

Pure (numpy only, no I/O); train/data.py opens the files and builds these.

Index spaces. A *source* is one token stream (a token file, or the shards of a manifest
read end to end; train/data.py). Its samples are numbered 0..n-1 as in a single file.
A `SampleSpace` lays the *kept* samples of its sources end to end: index x in
[0, total) names (source s, sample id) through per-source id maps (`IdMap`: a listed array, or
a `HashSplit` that numbers one side of the held-out split without listing it). Samplers hand
out indices of a space; the loader reads them through it. Nothing here is proportional to the
number of samples: orders and splits are computed per index (train/order.py).

Held out (`data.val_fraction` f). Block b of 1024 sample ids holds out floor(f*1024 + u_b) of
them (u_b a fixed hash of b), picked by a keyed permutation of the block (train/order.py): a
fixed pseudo-random subset of share f, the same for every seed, layout and restart, and a
sample stays held out when shards are appended. Held-out samples are never trained on;
neighbouring windows share one boundary token (stride seq_len).

The mixture (`data.sources`). Slot j of the endless slot stream (global batch k holds
slots [k*B, (k+1)*B)) comes from a source fixed by (seed, j) only: the stream is cut
into periods of MIX_PERIOD slots, each period holds exactly `counts[s]` slots of source
s (weights rounded by largest remainder, at least 1 each), shuffled by (seed, period).
The d-th slot of source s reads its d-th draw: epoch d // n_s of its own permutation
(a per-index `Permutation` keyed by (seed, s, epoch)), entry d % n_s. So which samples step k reads is a function
of (seed, k, B) alone: the state is the number of slots consumed, valid under any dp size
and after a change of global batch; no sample repeats within one source's epoch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dslurm.config.layout import Layout
from dslurm.errors import UserError
from train.order import ORDER, HashSplit, Order, mix_key, sample_order, warn_order
from train.sampler import DpShare, check_block

MIX_PERIOD = 4096
"""Slots per mixture period: the proportions are exact over each period (to 1/MIX_PERIOD)."""


IdMap = np.ndarray | HashSplit
"""k -> the k-th sample id of a source's side: a listed array, or a `HashSplit` (constant memory)"""


def held_out_split(n: int, fraction: float) -> tuple[IdMap | None, IdMap]:
    """(training side or None = all, held-out side) of a source of n samples, in constant memory:
    each side numbers its ids in ascending order (train/order.py)."""
    if fraction <= 0:
        return None, np.empty(0, dtype=np.int64)
    return HashSplit(n, fraction, held=False), HashSplit(n, fraction, held=True)


def split_held_out(n: int, fraction: float) -> tuple[np.ndarray | None, np.ndarray]:
    """`held_out_split` listed: (training ids or None = all, held-out ids), both ascending.
    n-proportional memory: for tests and small corpora; the trainer uses `held_out_split`."""
    if fraction <= 0:
        return None, np.empty(0, dtype=np.int64)
    return HashSplit(n, fraction, held=False).materialise(), HashSplit(n, fraction, held=True).materialise()


@dataclass(slots=True)
class SampleSpace:
    """Kept samples of several sources end to end: index -> (source, sample id)."""

    ids: list[IdMap | None]
    """per source: the sample ids it contributes (k -> k-th id), or None for all of them"""
    counts: list[int]
    offsets: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)]).astype(np.int64)

    @classmethod
    def of(cls, ids: list[IdMap | None], sizes: list[int]) -> SampleSpace:
        return cls(ids, [len(i) if i is not None else n for i, n in zip(ids, sizes)])

    @property
    def total(self) -> int:
        return int(self.offsets[-1])

    def locate(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, sample id) of each index."""
        index = np.asarray(index, dtype=np.int64)
        src = np.searchsorted(self.offsets, index, side="right") - 1
        local = index - self.offsets[src]
        sample = local.copy()
        for s, ids in enumerate(self.ids):
            if ids is not None:
                sel = src == s
                sample[sel] = ids[local[sel]]
        return src, sample


def period_counts(weights: list[float], period: int = MIX_PERIOD) -> np.ndarray:
    """Slots per period of each source: weights x period by largest remainder, at least 1."""
    if not weights or any(not w > 0 for w in weights):
        raise ValueError(f"weights {weights} must be non-empty and positive")
    if len(weights) > period:
        raise ValueError(f"{len(weights)} sources exceed the {period} slots of a mixture period")
    share = np.asarray(weights, dtype=np.float64) / float(np.sum(weights)) * period
    counts = np.maximum(1, np.floor(share).astype(np.int64))
    while counts.sum() > period:  # the minimum of 1 overshot: take from the largest
        counts[int(np.argmax(counts))] -= 1
    rest = np.argsort(-(share - np.floor(share)), kind="stable")
    for i in range(int(period - counts.sum())):
        counts[rest[i % len(rest)]] += 1
    return counts


@dataclass(slots=True)
class MixtureSchedule:
    """Which source each slot comes from and which of that source's draws it is. Pure."""

    weights: list[float]
    seed: int = 0
    period: int = MIX_PERIOD
    counts: np.ndarray = field(init=False)
    _cache: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.counts = period_counts(self.weights, self.period)

    def _period(self, p: int) -> tuple[np.ndarray, np.ndarray]:
        """(source of each slot, its rank among the period's slots of that source)."""
        if p not in self._cache:
            src = np.random.default_rng([self.seed, 0x4D1C, p]).permutation(
                np.repeat(np.arange(len(self.counts)), self.counts))
            rank = np.empty(self.period, dtype=np.int64)
            for s in range(len(self.counts)):
                sel = src == s
                rank[sel] = np.arange(int(sel.sum()))
            if len(self._cache) > 4:
                self._cache.clear()
            self._cache[p] = (src, rank)
        return self._cache[p]

    def slots(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(source, draw index within that source) of slots [first, first+count)."""
        return self.at(np.arange(first, first + count, dtype=np.int64))

    def at(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, draw index within that source) of the given slot numbers (any shape)."""
        period, off = np.divmod(np.asarray(slots, dtype=np.int64), self.period)
        src, draw = np.empty_like(period), np.empty_like(period)
        for p in np.unique(period).tolist():
            sel = period == p
            p_src, p_rank = self._period(p)
            s = p_src[off[sel]]
            src[sel], draw[sel] = s, p * self.counts[s] + p_rank[off[sel]]
        return src, draw


@dataclass(kw_only=True, slots=True)
class MixtureSampler(DpShare):
    """The global-batch sampler of a mixture: indices of `space` (its sources' kept samples).

    The same interface as `GlobalBatchSampler` (train/sampler.py); `data.policy` does not apply:
    sources are consumed slot by slot, so no epoch has a tail to drop or pad.
    """

    space: SampleSpace
    weights: list[float]
    global_batch: int
    dp_rank: int = 0
    dp_size: int = 1
    seed: int = 0
    slot: int = 0
    """slots consumed: where the next global batch starts (the whole state)"""
    padding_repeats: int = 0
    shuffle_block: int = 1
    """`data.shuffle_block` k: slots go to sources k at a time (the schedule is over groups of k
    slots, its period MIX_PERIOD / k groups), and each source's order moves blocks of k adjacent
    samples, so a group is k adjacent windows of one source: one read"""
    schedule: MixtureSchedule = field(init=False)
    _perm: dict[tuple[int, int], Order] = field(default_factory=dict, init=False, repr=False)
    _ahead: dict[int, np.ndarray] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        Layout.dp_share(self.global_batch, self.dp_rank, self.dp_size)
        if len(self.weights) != len(self.space.counts) or min(self.space.counts) < 1:
            raise ValueError(f"{len(self.weights)} weights for sources of {self.space.counts} samples")
        self.schedule = MixtureSchedule(list(self.weights), self.seed, MIX_PERIOD // self.shuffle_block)

    @property
    def stream_position(self) -> int:
        return self.slot

    def _order(self, s: int, epoch: int) -> Order:
        """Source s's order in its epoch: a per-index permutation (train/order.py), O(1) memory."""
        key = (s, epoch)
        if key not in self._perm:
            for old in [k for k in self._perm if k[0] == s and k[1] < epoch - 1]:
                del self._perm[old]
            self._perm[key] = sample_order(self.space.counts[s], mix_key(self.seed, s, epoch, 0x313C),
                                           self.shuffle_block)
        return self._perm[key]

    def indices(self, first: int, count: int) -> np.ndarray:
        """Space indices of slots [first, first+count): a pure function of (seed, slots)."""
        return self.indices_at(np.arange(first, first + count, dtype=np.int64))

    def indices_at(self, slots: np.ndarray) -> np.ndarray:
        """Space indices of the given slot numbers (any shape): one vectorised pass."""
        k = self.shuffle_block
        if k > 1:  # the schedule is over groups of k slots; a group's slots are k consecutive draws
            group, within = np.divmod(np.asarray(slots, dtype=np.int64), k)
            src, draw = self.schedule.at(group)
            draw = draw * k + within
        else:
            src, draw = self.schedule.at(slots)
        n = np.asarray(self.space.counts, dtype=np.int64)[src]
        epoch, pos = np.divmod(draw, n)
        out = np.empty(slots.shape, dtype=np.int64)
        groups = src * (int(epoch.max(initial=0)) + 1) + epoch  # one group per (source, epoch)
        for g in np.unique(groups).tolist():
            sel = groups == g
            s, e = int(src[sel].flat[0]), int(epoch[sel].flat[0])
            out[sel] = self.space.offsets[s] + self._order(s, e)[pos[sel]]
        return out

    def next_global(self) -> np.ndarray:
        out = self.indices(self.slot, self.global_batch)
        self.step()
        return out

    @property
    def ahead_steps(self) -> int:
        """As `DpShare.ahead_steps`, within about one epoch of the smallest source (a source of a
        few samples would otherwise wrap many epochs in one plan, a permutation each)."""
        share = self.schedule.counts / self.schedule.period * self.global_batch  # draws per step
        epoch = int(np.min(np.asarray(self.space.counts, dtype=np.float64) / share))
        return max(1, min(self.ahead_by_ids(), epoch))

    def plan_ids(self, steps: int) -> np.ndarray:
        """This rank's slots of the next `steps` global batches, [steps, local_batch] (slots are a
        pure function of their number)."""
        lb = self.local_batch
        first = self.slot + self.dp_rank * lb + np.arange(steps, dtype=np.int64)[:, None] * self.global_batch
        return self.indices_at(first + np.arange(lb, dtype=np.int64)[None, :])

    def step(self) -> None:
        self.slot += self.global_batch

    def advance(self, steps: int) -> None:
        self.slot += steps * self.global_batch

    def state_dict(self) -> dict[str, Any]:
        return {"kind": "mixture", "slot": self.slot, "seed": self.seed, "weights": list(self.weights),
                "num_samples": list(self.space.counts), "global_batch": self.global_batch, "order": ORDER,
                "shuffle_block": self.shuffle_block}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the slot count; the sources, weights and seed must be the saving run's."""
        if state.get("kind") != "mixture":
            raise UserError("data state: the checkpoint holds a single-stream position but data.sources is a "
                            "mixture now. Fix: restore with the data section the run was saved with")
        mine = {"num_samples": list(self.space.counts), "seed": self.seed, "weights": list(self.weights)}
        for key, value in mine.items():
            if key in state and state[key] != value:
                raise UserError(f"data state: {key}={state[key]!r} in the checkpoint but {value!r} now; the "
                                "saved position does not apply. Fix: restore with the same data.sources "
                                "(paths, weights, val_fraction) and train.seed")
        check_block(state, self.shuffle_block)
        warn_order(state)
        self._ahead.clear()
        self.slot = int(state["slot"])


def eval_indices(space: SampleSpace, n: int, weights: list[float] | None, seed: int) -> np.ndarray:
    """The n space indices evaluation reads, always the same: the space in order (cycled when it
    is shorter), or for several sources the mixture's slots 0..n-1 over each source in order."""
    if space.total < 1:
        raise ValueError("no evaluation samples")
    if weights is None or len(space.counts) == 1:
        return np.arange(n, dtype=np.int64) % space.total
    src, draw = MixtureSchedule(list(weights), seed).slots(0, n)
    counts = np.asarray(space.counts, dtype=np.int64)
    return np.asarray(space.offsets[src] + draw % counts[src], dtype=np.int64)
