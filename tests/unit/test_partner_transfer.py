"""The partner transfer's pure parts (dslurm/checkpoint/partner.py): how a stream's files are cut
into rounds, and the landing gate a load streamed from a pull waits on."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from dslurm.checkpoint.landing import Landed
from dslurm.checkpoint.partner import CHUNK, Stream


def test_small_files_share_the_first_round_and_shards_go_in_chunks():
    files = {".metadata": 3000, "meta.json": 500, "ranks/rank-00001.json": 800, "empty.json": 0,
             "__1_0.distcp": 2 * CHUNK + 123, "__1_1.distcp": CHUNK // 2}
    s = Stream(0, Path("/x"), {n: {"size": v, "crc32": "0"} for n, v in files.items()})
    # the small files first, all in one round (one round trip), then the shards in CHUNK pieces
    assert [p[0] for p in s.rounds[0]] == [".metadata", "meta.json", "ranks/rank-00001.json"]
    assert all(sum(p[2] for p in r) <= CHUNK for r in s.rounds)
    for name, size in files.items():  # every byte once, in order
        pieces = [(off, n) for r in s.rounds for (f, off, n) in r if f == name]
        assert [off for off, _ in pieces] == list(range(0, size, CHUNK)) if size else pieces == []
        assert sum(n for _, n in pieces) == size
    # the small files; shard 0 in two full chunks; its last 123 bytes share a round with shard 1
    assert [[p[0] for p in r] for r in s.rounds[1:]] == [["__1_0.distcp"], ["__1_0.distcp"],
                                                         ["__1_0.distcp", "__1_1.distcp"]]


def test_a_read_waits_until_its_bytes_landed():
    landed = Landed({"a": 100, ".metadata": 10})
    got: list[str] = []
    t = threading.Thread(target=lambda: (landed.wait("a", 60), got.append("a")))
    t.start()
    landed.advance("a", 50)
    t.join(0.2)
    assert not got  # 50 of 60 bytes: still waiting
    landed.advance("a", 10)
    t.join(5)
    assert got == ["a"]


def test_a_pull_that_ends_short_fails_the_read_never_hangs_it():
    landed = Landed({"a": 100})
    landed.advance("a", 40)
    landed.close()
    landed.wait("a", 40)  # what landed is readable
    with pytest.raises(OSError, match="a: the pull ended at 40 of 100 bytes"):
        landed.wait("a")
    landed.wait("__3_0.distcp", 1261)  # not this pull's: a node peer's, or the node's own


def test_held_shards_read_as_a_file_and_spill_to_disk_whole(tmp_path):
    from dslurm.checkpoint.landing import HeldFile
    data = bytes(range(256)) * 40  # 10240 bytes in pieces of 4096, as the rounds bring them
    landed = Landed({"__1_0.distcp": len(data), "meta.json": 3}, held={"__1_0.distcp"})
    assert landed.holds("__1_0.distcp") and not landed.holds("meta.json")
    for off in range(0, len(data), 4096):
        landed.put("__1_0.distcp", off, memoryview(data)[off:off + 4096])
    f = HeldFile(landed, "__1_0.distcp", str(tmp_path / "__1_0.distcp"))
    f.seek(4000)
    assert f.read(200) == data[4000:4200]  # across two pieces
    f.seek(-10, 2)
    assert f.read() == data[-10:]
    assert landed.held_size("__1_0.distcp") == len(data)
    landed.spill(tmp_path)
    assert (tmp_path / "__1_0.distcp").read_bytes() == data and not landed.holds("__1_0.distcp")
