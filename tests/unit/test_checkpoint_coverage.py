"""Whole-file crc32s from the byte ranges ranks read (dslurm.checkpoint.coverage): pure, no torch."""

from __future__ import annotations

import random
import zlib
from pathlib import Path
from typing import Any

import pytest

from dslurm.checkpoint import coverage as cov


def test_combine_and_suffix_match_zlib():
    rng = random.Random(0)
    for n in [0, 1, 7, 8, 1000, 65537] + [rng.randrange(5000) for _ in range(50)]:
        a, b = rng.randbytes(rng.randrange(3000)), rng.randbytes(n)
        assert cov.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
        assert cov.crc32_suffix(zlib.crc32(a + b), zlib.crc32(a), len(b)) == zlib.crc32(b)
    # lengths beyond what a test can allocate: combining with zeros equals crc32 continuation
    zeros = bytes(1 << 20)
    assert cov.crc32_combine(123, zlib.crc32(zeros), len(zeros)) == zlib.crc32(zeros, 0) ^ cov._shift(
        123, len(zeros))


def _items(rng: random.Random, n: int) -> list[tuple[int, int]]:
    offs, pos = [], 0
    for _ in range(n):
        size = rng.randrange(1, 300)
        offs.append((pos, size))
        pos += size
    return offs


def _read(data: bytes, items: list[tuple[int, int]], picks: list[int]) -> cov.RangeSums:
    """What a rank records when DCP hands it these items (sorted by offset, as CrcReader does)."""
    sums = cov.RangeSums()
    for i in sorted(picks):
        off, size = items[i]
        sums.add("f", off, data[off:off + size])
    return sums


@pytest.mark.parametrize("seed", range(40))
def test_any_split_of_items_across_ranks_gives_the_file_crc(seed):
    rng = random.Random(seed)
    items = _items(rng, rng.randrange(1, 12))
    data = rng.randbytes(sum(s for _, s in items))
    ranks = rng.randrange(1, 4)
    picks = [[i for i in range(len(items)) if rng.random() < 0.6] for _ in range(ranks)]
    gathered = [_read(data, items, p).export() for p in picks]
    gaps = cov.plan_gaps({"f": len(data)}, gathered)
    unread = [i for i in range(len(items)) if not any(i in p for p in picks)]
    # exactly the bytes nobody read are read again, nothing more
    assert sum(e - s for _, s, e in gaps) == sum(items[i][1] for i in unread)
    crcs = {g: zlib.crc32(data[g[1]:g[2]]) for g in gaps}
    assert cov.whole_crcs({"f": len(data)}, gathered, crcs) == {"f": zlib.crc32(data)}


def test_partly_overlapping_runs_need_no_reread():
    """Rank A read items 0-2, rank B items 1-3: B's run is entered at an item boundary."""
    items = [(0, 10), (10, 20), (30, 5), (35, 40)]
    data = bytes(range(75))
    gathered = [_read(data, items, [0, 1, 2]).export(), _read(data, items, [1, 2, 3]).export()]
    assert cov.plan_gaps({"f": 75}, gathered) == []
    assert cov.whole_crcs({"f": 75}, gathered, {}) == {"f": zlib.crc32(data)}


def test_a_file_nobody_read_is_one_gap():
    assert cov.plan_gaps({"a": 5, "b": 0}, [{}]) == [("a", 0, 5)]


def test_the_same_item_read_twice_is_counted_once():
    sums = cov.RangeSums()
    sums.add("f", 0, b"abc")
    sums.add("f", 0, b"abc")
    sums.add("f", 3, b"de")
    assert sums.export() == {"f": [(0, [(3, zlib.crc32(b"abc")), (5, zlib.crc32(b"abcde"))])]}


class OneRank:
    rank, world = 0, 1

    def gather(self, obj: Any) -> list[Any]:
        return [obj]

    def bcast(self, obj: Any) -> Any:
        return obj


def test_verify_reads_names_the_altered_file(tmp_path: Path):
    good, bad = b"x" * 100, b"y" * 50
    (tmp_path / "__0_0.distcp").write_bytes(good)
    (tmp_path / "__1_0.distcp").write_bytes(bad[:-1] + b"z")  # altered after the manifest
    entries = {"__0_0.distcp": {"size": 100, "crc32": f"{zlib.crc32(good):08x}"},
               "__1_0.distcp": {"size": 50, "crc32": f"{zlib.crc32(bad):08x}"},
               "meta.json": {"size": 2, "crc32": "0"}}  # small files are not this function's job
    sums = cov.RangeSums()
    sums.add("__0_0.distcp", 0, good[:60])  # read half by the load; the rest is a gap
    problems, reread = cov.verify_reads(OneRank(), tmp_path, entries, sums)
    assert reread == 40 + 50
    assert problems == [f"{tmp_path / '__1_0.distcp'}: crc32 {zlib.crc32(bad[:-1] + b'z'):08x} != "
                        f"{zlib.crc32(bad):08x} in manifest (altered)"]


def test_verify_reads_reports_a_file_shorter_than_its_runs_say(tmp_path: Path):
    (tmp_path / "__0_0.distcp").write_bytes(b"abc")
    entries = {"__0_0.distcp": {"size": 10, "crc32": "0"}}
    problems, _ = cov.verify_reads(OneRank(), tmp_path, entries, cov.RangeSums())
    assert len(problems) == 1 and "unreadable at 0..10" in problems[0]
