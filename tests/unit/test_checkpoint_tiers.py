"""The torch-free half of two-tier checkpoints (dslurm.checkpoint.tiers): scratch expansion, which
local generation a restore may use, local retention, the checked and throttled copy."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest

from dslurm import checkpoint as ck
from dslurm.checkpoint import tiers
from dslurm.config import load_job, load_site
from dslurm.config.resolve import resolve
from dslurm.errors import UserError

G = [f"step-{s:08d}-20260101T000000Z-00000{s}" for s in range(6)]


def test_expand_scratch(monkeypatch):
    monkeypatch.setenv("SCR", "/local")
    assert tiers.expand_scratch("$SCR/%n/x%%y", "node2") == Path("/local/node2/x%y")
    assert tiers.expand_scratch("/tmp/%q", "n") == Path("/tmp/%q")  # unknown escapes stay
    assert tiers.node_name({"SLURMD_NODENAME": "node7"}) == "node7"


def test_local_run_dir_differs_for_runs_with_one_name(tmp_path):
    a = tiers.local_run_dir(Path("/s"), tmp_path / "a" / "run")
    b = tiers.local_run_dir(Path("/s"), tmp_path / "b" / "run")
    assert a != b and a.name.startswith("dslurm-run-") and a.parent == Path("/s")


def test_node_groups():
    assert tiers.node_groups(["/a", "/a", "/b", "/b"]) == [[0, 1], [2, 3]]
    assert tiers.node_groups(["/b", "/a", "/b"]) == [[0, 2], [1]]


def test_local_candidates_need_every_rank_and_not_older_than_the_pointer():
    ptr = ck.Pointer(G[3], 3)
    assert tiers.local_candidates([[G[2], G[4]], [G[4], G[2]]], ptr)[0] == [G[4]]
    assert tiers.local_candidates([[G[2], G[4]], [G[4], G[2]]], None)[0] == [G[4], G[2]]
    assert tiers.local_candidates([[G[3]], [G[3]]], ptr)[0] == [G[3]]  # the pointer's own: local is faster
    got, why = tiers.local_candidates([[G[4]], []], ptr)
    assert got == [] and "no local generation on 1 of 2 ranks" in why
    got, why = tiers.local_candidates([[G[4]], [G[5]]], ptr)
    assert got == [] and "held locally by every rank" in why
    got, why = tiers.local_candidates([[G[2]], [G[2]]], ptr)
    assert got == [] and "older than LATEST" in why


def test_local_retention_keeps_newest_and_in_flight():
    names = [(G[1], True), (G[2], False), (G[3], True), (G[4], True), (G[5], False)]
    assert tiers.plan_local_retention(names, 1, in_flight=[G[5]]) == [G[1], G[2], G[3]]
    assert tiers.plan_local_retention(names, 2, in_flight=[G[1], G[5]]) == [G[2]]


def test_copy_file_checks_and_throttles(tmp_path):
    src = tmp_path / "a"
    data = bytes(range(256)) * 4096  # 1 MiB
    src.write_bytes(data)
    slept: list[float] = []
    want = {"size": len(data), "crc32": f"{zlib.crc32(data):08x}"}
    got = tiers.copy_file(src, tmp_path / "b", want=want, mbps=1.0, sleep=slept.append)
    assert got == want and (tmp_path / "b").read_bytes() == data
    assert sum(slept) > 0.9  # 1 MiB at 1 MB/s: about a second of waiting
    with pytest.raises(OSError, match="altered since the local commit"):
        tiers.copy_file(src, tmp_path / "c", want={"size": len(data), "crc32": "00000000"})


def test_records_roundtrip_and_held(tmp_path):
    gen = ck.generations_dir(tmp_path) / G[2]
    gen.mkdir(parents=True)
    rec = tiers.LocalRecord(G[2], 2, 1, 2, {"dp_shard": 2}, {"__1_0.distcp": {"size": 3, "crc32": "0"}}, 1.0)
    tiers.write_record(gen, rec)
    assert tiers.read_record(gen, 1) == rec and tiers.read_record(gen, 0) is None
    assert tiers.held_generations(tmp_path, 1, 2, {"dp_shard": 2}) == [G[2]]
    assert tiers.held_generations(tmp_path, 1, 4, {"dp_shard": 4}) == []  # another layout
    tiers.drop_local(tmp_path, G[2], 1)
    assert tiers.held_generations(tmp_path, 1, 2, {"dp_shard": 2}) == []


def test_two_tier_needs_site_scratch(tmp_path):
    root = Path(__file__).resolve().parents[2]
    site = load_site(root / "site-configs" / "local.yaml")
    job_file = tmp_path / "job.yaml"
    job_file.write_text("name: t\nnodes: 1\nmodel: {preset: tiny}\ncheckpoint: {tiers: two_tier}\n")
    job = load_job(job_file)
    assert site.storage.scratch and "%n" in site.storage.scratch
    resolve(site, job, base_dir=tmp_path)
    site.storage.scratch = None
    with pytest.raises(UserError, match="storage.scratch"):
        resolve(site, job, base_dir=tmp_path)
