"""Constant-memory sample orders and held-out splits, computed per index. Pure (numpy only).

An epoch's order over n samples is `Permutation(n, key)`: a keyed Feistel network on the
smallest even-bit domain 2**(2h) >= n, restricted to [0, n) by cycle walking (an output >= n
is fed through the network again until it lands inside; a bijection of the big domain
restricted this way is a bijection of [0, n)). Six rounds with a splitmix64 round function:
the same statistics as a shuffle for training purposes (every sample exactly once per epoch,
neighbours scattered), in O(1) memory and O(len(positions)) time per lookup, whatever n is
(a trillion tokens at seq_len 4096 are 2.4e8 samples: the old materialised order was 2 GB
of int64 per rank).

The held-out split (`data.val_fraction` f) is stratified by blocks of BLOCK = 1024 sample ids:
block b holds out m_b = floor(f*BLOCK + u_b) of its samples (u_b = splitmix64(b)/2**64, so the
expected share is exactly f and every block is within one sample of it), namely the ids
b*BLOCK + Q_b(r) for r < m_b, Q_b a keyed permutation of [0, BLOCK). The rule depends on the
sample id alone: the same for every seed, layout and restart, and a sample keeps its side when
shards are appended (the last, partial block is decided as if full, its ids >= n left out).
`HashSplit` numbers one side's samples 0..count-1 (block by block) without listing them: a
prefix count per block (n/BLOCK int64: 2 MB at 2.4e8 samples, built from n/BLOCK hashes in
milliseconds) and, per lookup, one Q_b evaluation.
"""

from __future__ import annotations

import logging
import math

import numpy as np

log = logging.getLogger(__name__)

ORDER = "feistel-1"
"""Names the sample orders in a saved data state: a state without it (or with another) was
saved on another order, and resuming it is warned about (its position is kept, its epoch
order is not the one it was saved on)."""
M64 = (1 << 64) - 1
ROUNDS = 6
BLOCK = 1024
"""ids per block of a HashSplit's prefix counts: memory n/BLOCK x 8 bytes, a lookup hashes BLOCK ids"""
_CHUNK = 1 << 22


def splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser of each uint64 (wrapping arithmetic): a cheap, good hash."""
    z = x.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)  # a new array, then in place (half the temporaries)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def warn_order(state: dict[str, object]) -> None:
    """A saved data state from another order: say what resuming it means (once per restore)."""
    if state.get("order") != ORDER:
        log.warning("data state: saved on sample order %r, this dslurm uses %r; the run resumes at the "
                    "saved position on the new order, so the current epoch may repeat or skip samples "
                    "(from the next epoch on nothing is lost)", state.get("order", "listed (numpy) permutation"),
                    ORDER)


def _splitmix_int(x: int) -> int:
    """splitmix64 of one Python int (what `splitmix64` does to each uint64)."""
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def mix_key(*parts: int) -> int:
    """One 64-bit key from a tuple of ints (seed, epoch, source, ...); any sign, any size."""
    h = 0x243F6A8885A308D3
    for p in parts:
        h = _splitmix_int(h ^ (p & M64)) ^ ((p >> 64) & M64)  # ints beyond 64 bits still change the key
    return h


class Permutation:
    """A seeded bijection of [0, n): `perm[positions]` -> the sample at each position."""

    __slots__ = ("n", "half", "mask", "keys", "int_keys")

    def __init__(self, n: int, key: int) -> None:
        if n < 1:
            raise ValueError(f"a permutation of {n} elements")
        self.n = n
        self.half = max(1, (max(1, (n - 1).bit_length()) + 1) // 2)
        self.mask = np.uint64((1 << self.half) - 1)
        self.int_keys = [mix_key(key, r) for r in range(ROUNDS)]
        self.keys = [np.uint64(k) for k in self.int_keys]

    def _one(self, x: int) -> int:
        """The same bijection on one Python int: a step's few ids cost microseconds, not the ~50 us
        of numpy calls on tiny arrays."""
        h, mask = self.half, (1 << self.half) - 1
        while True:
            left, right = x >> h, x & mask
            for k in self.int_keys:
                left, right = right, left ^ (_splitmix_int(right ^ k) & mask)
            x = (left << h) | right
            if x < self.n:
                return x

    def _feistel(self, x: np.ndarray) -> np.ndarray:
        h = np.uint64(self.half)
        left, right = x >> h, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (splitmix64(right ^ k) & self.mask)
        out: np.ndarray = (left << h) | right
        return out

    def __getitem__(self, positions: np.ndarray) -> np.ndarray:
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= self.n):
            raise IndexError(f"positions outside [0, {self.n})")
        if pos.size <= _SMALL:
            return np.array([self._one(int(p)) for p in pos.ravel()], dtype=np.int64).reshape(pos.shape)
        y = self._feistel(pos.astype(np.uint64))
        n = np.uint64(self.n)
        out = y >= n
        while out.any():  # cycle walking: the domain is < 4n, so a few rounds at most on average
            if int(out.sum()) <= _SMALL:  # the last few walk on in Python (numpy's per-call cost dominates)
                idx = np.flatnonzero(out)
                y[idx] = [self._one(int(v)) for v in y[idx]]
                break
            y[out] = self._feistel(y[out])
            out[out] = y[out] >= n
        return y.astype(np.int64)

    def __len__(self) -> int:
        return self.n


_SMALL = 16
"""Up to this many lookups run on Python ints: numpy's per-call cost dominates a step's few."""


class BlockPermutation:
    """A seeded bijection of [0, n) that moves blocks of k adjacent ids (`data.shuffle_block`).

    The n // k full blocks are ordered by a `Permutation` of their own, each block's ids kept
    in order; the last n % k positions keep their ids; then every id is rotated by a keyed
    shift s in [0, n): sample (x + s) mod n. So k consecutive positions starting at a multiple
    of k are k adjacent samples, one contiguous read (one block per epoch wraps past the end
    and reads as two); the shift moves the block boundaries and the left-over tail every epoch,
    so which windows share a block, and which are left over, changes from epoch to epoch.
    Every sample still comes exactly once per epoch; what a block shuffle gives up is only the
    independence of the k windows of a block (adjacent windows of the corpus, usually of one
    document or its neighbours, land in the same global batch).
    """

    __slots__ = ("n", "k", "full", "shift", "blocks")

    def __init__(self, n: int, key: int, k: int) -> None:
        if n < 1 or k < 1:
            raise ValueError(f"a block permutation of {n} elements in blocks of {k}")
        self.n, self.k, self.full = n, k, n // k
        self.shift = mix_key(key, 0xB10C) % n
        self.blocks = Permutation(self.full, key) if self.full else None

    def __getitem__(self, positions: np.ndarray) -> np.ndarray:
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= self.n):
            raise IndexError(f"positions outside [0, {self.n})")
        flat = pos.ravel()
        out = flat.copy()
        inb = flat < self.full * self.k
        if self.blocks is not None and inb.any():
            p = flat[inb]
            b = p // self.k
            if b.size > _SMALL:  # a plan's positions come in runs of one block: one lookup per run
                first = np.empty(b.size, dtype=bool)
                first[0], first[1:] = True, b[1:] != b[:-1]
                head = self.blocks[b[first]]
                out[inb] = head[np.cumsum(first) - 1] * self.k + p % self.k
            else:
                out[inb] = self.blocks[b] * self.k + p % self.k
        moved: np.ndarray = ((out + self.shift) % self.n).reshape(pos.shape)
        return moved

    def __len__(self) -> int:
        return self.n


Order = Permutation | BlockPermutation


def sample_order(n: int, key: int, block: int = 1) -> Order:
    """The epoch order over n samples: every sample on its own (block 1: the `Permutation`, as
    every run before `data.shuffle_block`), or blocks of `block` adjacent ones."""
    return Permutation(n, key) if block <= 1 else BlockPermutation(n, key, block)


def _block_perm_one(b: int, r: int, inverse: bool) -> int:
    keys = [_splitmix_int((((b * ROUNDS) & M64) + rnd) & M64 ^ 0x5EED_B10C) for rnd in range(ROUNDS)]
    left, right = r >> 5, r & 31
    if not inverse:
        for k in keys:
            left, right = right, left ^ (_splitmix_int(right ^ k) & 31)
    else:
        for k in reversed(keys):
            left, right = right ^ (_splitmix_int(left ^ k) & 31), left
    return (left << 5) | right


def _block_perm(block: np.ndarray, r: np.ndarray, inverse: bool = False) -> np.ndarray:
    """Q_b(r) (or its inverse) for each (block, r): a Feistel network on BLOCK = 2**10 values,
    keyed per block (no cycle walk: the domain is exactly the block)."""
    if block.size <= _SMALL:
        return np.array([_block_perm_one(int(b), int(x), inverse) for b, x in zip(block.ravel(), r.ravel())],
                        dtype=np.int64).reshape(block.shape)
    h, mask = np.uint64(5), np.uint64(31)
    b = block.astype(np.uint64)
    keys = [splitmix64(b * np.uint64(ROUNDS) + np.uint64(rnd) ^ np.uint64(0x5EED_B10C)) for rnd in range(ROUNDS)]
    x = r.astype(np.uint64)
    left, right = x >> h, x & mask
    if not inverse:
        for k in keys:
            left, right = right, left ^ (splitmix64(right ^ k) & mask)
    else:
        for k in reversed(keys):
            left, right = right ^ (splitmix64(left ^ k) & mask), left
    out: np.ndarray = ((left << h) | right).astype(np.int64)
    return out


def _held_counts(blocks: np.ndarray, fraction: float) -> np.ndarray:
    """m_b: how many of block b's BLOCK ids are held out."""
    if blocks.size <= _SMALL:
        return np.array([math.floor(fraction * BLOCK + (_splitmix_int(int(b) ^ 0xC0FFEE) >> 11) / 2.0 ** 53)
                         for b in blocks.ravel()], dtype=np.int64).reshape(blocks.shape)
    u = (splitmix64(blocks.astype(np.uint64) ^ np.uint64(0xC0FFEE)) >> np.uint64(11)).astype(np.float64) / 2.0 ** 53
    m: np.ndarray = np.floor(fraction * BLOCK + u).astype(np.int64)
    return m


def held_flags(ids: np.ndarray, fraction: float) -> np.ndarray:
    """Is each sample id held out (`data.val_fraction` fraction)? The block rule above."""
    ids = np.asarray(ids, dtype=np.int64)
    block = ids // BLOCK
    flags: np.ndarray = _block_perm(block, ids % BLOCK, inverse=True) < _held_counts(block, fraction)
    return flags


class HashSplit:
    """One side (held out, or kept) of the held-out split of n samples, numbered block by block.

    `split[k]` is the sample id of the side's k-th member (k an array); `len(split)` their count.
    Within a full block the members come in Q_b order; the last, partial block is listed.
    """

    __slots__ = ("n", "fraction", "held", "prefix", "full", "tail")

    def __init__(self, n: int, fraction: float, *, held: bool) -> None:
        self.n, self.fraction, self.held = n, fraction, held
        self.full = n // BLOCK
        m = _held_counts(np.arange(self.full, dtype=np.int64), fraction)
        counts = m if held else BLOCK - m
        self.tail = np.empty(0, dtype=np.int64)
        if n % BLOCK:  # the partial block: its side's ids, ascending (< BLOCK of them)
            ids = np.arange(self.full * BLOCK, n, dtype=np.int64)
            flags = held_flags(ids, fraction)
            self.tail = ids[flags if held else ~flags]
        self.prefix = np.concatenate([[0], np.cumsum(counts), [int(np.sum(counts)) + len(self.tail)]]).astype(np.int64)

    def __len__(self) -> int:
        return int(self.prefix[-1])

    def __getitem__(self, k: np.ndarray) -> np.ndarray:
        k = np.asarray(k, dtype=np.int64)
        if k.size and (int(k.min()) < 0 or int(k.max()) >= len(self)):
            raise IndexError(f"index outside [0, {len(self)})")
        block = np.minimum(np.searchsorted(self.prefix, k, side="right") - 1, self.full)
        r = k - self.prefix[block]
        in_tail = block == self.full
        full = ~in_tail
        out = np.empty(k.shape, dtype=np.int64)
        b = block[full]
        if not self.held:  # the kept members of a block are Q_b(m_b), Q_b(m_b + 1), ...
            r_full = r[full] + _held_counts(b, self.fraction)
        else:
            r_full = r[full]
        out[full] = b * BLOCK + _block_perm(b, r_full)
        out[in_tail] = self.tail[r[in_tail]]
        return out

    def materialise(self) -> np.ndarray:
        """Every id on this side, ascending (tests and small corpora; n-proportional memory)."""
        parts = []
        for lo in range(0, self.n, _CHUNK):
            ids = np.arange(lo, min(self.n, lo + _CHUNK), dtype=np.int64)
            flags = held_flags(ids, self.fraction)
            parts.append(ids[flags if self.held else ~flags])
        return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
