"""Partner copies and the fingerprint check under torchrun: 2 processes, FSDP2 on a CPU gloo mesh,
each process its own "node" (SLURMD_NODENAME=node<rank>: its own scratch), so rank 0's shards go
to node1's scratch and rank 1's to node0's, over gloo. One launch makes the state every test
resumes from (a copy each):

"first": the uninterrupted reference, then a two-tier run with partner copies that saves at 2, K
and K+1 and is killed (DSLURM_FAULT_CKPT_KILL=1:mid_partner:3) in the middle of the partner transfer
of its save at K+1, after both local commits, before any durable copy of K+1.

- a kill -9 mid-transfer leaves no partner copy of K+1 that counts (no record), K's are whole;
- node1's scratch gone and K's durable copy deleted: the resume pulls rank 1's shards from the
  partner copy on node0, restores K (the durable tier has only 2 left) and ends bit-identically;
- a flipped byte in that partner shard: the pull is rejected (restore_rejected, copy partner),
  the copy withdrawn, the durable K restored;
- a wrong but well-checksummed tensor in rank 0's own local copy (record rewritten to agree): the
  fingerprint catches it after the load, before the first step; rank 0 takes its partner copy;
- the same with bytes that do not load at all: refused like a bad copy, never raised (a crash loop).

The worker scaffolding (two processes as two nodes) is node_pair.py's, shared with test_two_tier_dist.py.

This file is also the torchrun worker: `torchrun --nproc_per_node=2 THIS_FILE MODE RUN_DIR OUT_DIR`.
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from node_pair import (  # noqa: E402
    K,
    copy_base,
    first_run,
    node_local,
    resume_records,
    resumed,
    same_as_reference,
    scratch_kw,
    worker_main,
)
from node_pair import torchrun as _torchrun  # noqa: E402

pytestmark = pytest.mark.integration


class ListLedger:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def append(self, ev: Any) -> None:
        self.events.append({"event": ev.NAME, **{k: v for k, v in vars(ev).items() if not k.startswith("_")}})


def worker(mode: str, run_dir: Path, out: Path) -> None:
    from dslurm import checkpoint as ck
    from dslurm.checkpoint import replica
    world, ledger = dist.get_world_size(), ListLedger()
    kw = scratch_kw(run_dir, world, partner=True, ledger=ledger)
    if mode == "first":
        first_run(run_dir, out, kw, saves=(2, K, K + 1))
    elif mode == "resume":
        def held(mgr: Any) -> dict[str, Any]:
            copies = replica.held_copies(mgr.tier.local_dir, world, kw["layout"], [[0], [1]])
            return {"held_after_restore": {str(ck.parse_step(n)): v for n, v in copies.items()}}
        resumed(run_dir, out, kw, held)
        if dist.get_rank() == 0:
            (out / "events.json").write_text(json.dumps(ledger.events, default=str))


def torchrun(mode: str, run_dir: Path, out: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return _torchrun(__file__, mode, run_dir, out, env)


def _gen(root: Path, step: int) -> Path:
    from dslurm import checkpoint as ck
    return next(g.path for g in ck.list_generations(root) if g.step == step)


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    base = tmp_path_factory.mktemp("partner")
    res = torchrun("first", base / "run", base / "out", env={"DSLURM_FAULT_CKPT_KILL": "1:mid_partner:3"})
    assert (base / "out" / "ref-1.json").is_file(), res.stderr[-4000:]
    return base, base / "out", res


def test_kill_9_mid_partner_transfer_leaves_no_partner_copy_that_counts(first):
    base, _, res = first
    from dslurm import checkpoint as ck
    from dslurm.checkpoint import replica
    assert res.returncode != 0 and "killing myself at mid_partner" in res.stderr
    assert ck.read_pointer(base / "run").step == K
    for rank, node in enumerate(("node0", "node1")):
        held = replica.held_copies(node_local(base, node), 2, {"dp_shard": 2}, [[0], [1]])
        partner = {ck.parse_step(n): [r for r, kind in v.items() if kind == "partner"] for n, v in held.items()}
        assert partner == {2: [1 - rank], K: [1 - rank], K + 1: []}  # K+1: locally committed, no partner copy
        partial = replica.partner_root(node_local(base, node)) / "generations"
        assert any(ck.parse_step(p.name) == K + 1 for p in partial.iterdir())  # bytes, never a record


def _resume(first, tmp_path: Path, prepare: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Path]:
    base, _, _ = first
    new = tmp_path / "base"
    copy_base(base, new)
    prepare(new)
    res = torchrun("resume", new / "run", tmp_path / "out")
    assert res.returncode == 0, res.stderr[-4000:]
    return resume_records(tmp_path / "out"), json.loads((tmp_path / "out" / "events.json").read_text()), new


def _same_as_reference(first, tmp_path: Path, got: list[dict[str, Any]], start: int) -> None:
    same_as_reference(first[1], tmp_path / "out", got, start)


def _lose_node1(new: Path, durable_too: bool) -> None:
    shutil.rmtree(new / "scratch" / "node1")
    if durable_too:
        shutil.rmtree(_gen(new / "run", K))  # the newest durable copy is gone as well


def test_node_loss_restores_the_newest_from_the_partner_copy(first, tmp_path):
    got, evs, _ = _resume(first, tmp_path, lambda new: _lose_node1(new, durable_too=True))
    for rank in (0, 1):
        step, tier, why, _ = got[rank]["restored"]
        assert (step, tier) == (K, "partner"), why
        assert "rank 1 from the partner copy on node0" in why.replace("ranks 1", "rank 1")
    (restore,) = [e for e in evs if e["event"] in ("ckpt_restore", "ckpt_fallback")]
    assert restore["tier"] == "partner" and restore["copies"] == {"local": [0], "partner": [1]}
    assert restore["restore_s"] > 0
    assert not [e for e in evs if e["event"] == "restore_rejected"]
    _same_as_reference(first, tmp_path, got, K)
    partner_commits = [e for e in evs if e["event"] == "ckpt_partner_commit"]
    assert partner_commits and all(e["ok"] and e["bytes"] > 0 for e in partner_commits)


def _flip(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x01
    path.write_bytes(bytes(raw))


def test_flipped_byte_in_a_partner_shard_is_rejected_before_the_first_step(first, tmp_path):
    from dslurm.checkpoint import replica

    def prepare(new: Path) -> None:
        _lose_node1(new, durable_too=False)
        shard = _gen(replica.partner_root(node_local(new, "node0")), K) / "__1_0.distcp"
        _flip(shard, shard.stat().st_size // 2)

    got, evs, _ = _resume(first, tmp_path, prepare)
    for rank in (0, 1):
        assert got[rank]["restored"][:2] == [K, "durable"]
    (rej,) = [e for e in evs if e["event"] == "restore_rejected"]
    assert (rej["copy"], rej["node"], rej["ranks"]) == ("partner", "node0", [1]) and "crc32" in rej["reason"]
    # withdrawn: no later start pulls it again (no crash loop); the other copies stay
    assert got[0]["held_after_restore"][str(K)] == {"0": "local"}
    _same_as_reference(first, tmp_path, got, K)


def _forge(gen: Path, rank: int, garble: bool = False) -> str:
    """Rewrite one tensor of rank `rank`'s shard in local copy `gen` with other values of the same
    size (`garble`: with bytes that are no tensor at all), and its local commit record to agree:
    every crc32 checks, the state is wrong (or cannot load)."""
    from dslurm.checkpoint import tiers
    md = pickle.loads((gen / ".metadata").read_bytes())
    shard = f"__{rank}_0.distcp"
    key, info = next((k, v) for k, v in md.storage_data.items()
                     if v.relative_path == shard and k.fqn.endswith("weight") and v.length > 256)
    raw = bytearray((gen / shard).read_bytes())
    t = torch.load(io.BytesIO(bytes(raw[info.offset:info.offset + info.length])), weights_only=True)
    buf = io.BytesIO()
    torch.save(t + 1e-3, buf)
    assert len(buf.getvalue()) == info.length
    raw[info.offset:info.offset + info.length] = bytes(info.length) if garble else buf.getvalue()
    (gen / shard).write_bytes(bytes(raw))
    rec = json.loads(tiers.record_path(gen, rank).read_text())
    rec["files"][shard]["crc32"] = f"{zlib.crc32(bytes(raw)):08x}"
    tiers.record_path(gen, rank).write_text(json.dumps(rec))
    return str(key.fqn)


def test_wrong_but_well_checksummed_tensor_is_caught_by_the_fingerprint(first, tmp_path):
    from dslurm import checkpoint as ck
    forged: list[str] = []

    def prepare(new: Path) -> None:
        for node in ("node0", "node1"):  # K is the newest local generation
            ck.remove_generation(node_local(new, node), _gen(node_local(new, node), K + 1).name)
        forged.append(_forge(_gen(node_local(new, "node0"), K), 0))

    got, evs, _ = _resume(first, tmp_path, prepare)
    for rank in (0, 1):
        assert got[rank]["restored"][:2] == [K, "partner"]
    (rej,) = [e for e in evs if e["event"] == "restore_rejected"]
    assert (rej["copy"], rej["node"], rej["ranks"]) == ("local", "node0", [0])
    assert rej["tensor"].endswith(forged[0]) and "fingerprint" in rej["reason"]
    (restore,) = [e for e in evs if e["event"] in ("ckpt_restore", "ckpt_fallback")]
    assert restore["copies"] == {"local": [1], "partner": [0]}
    _same_as_reference(first, tmp_path, got, K)


def test_a_copy_that_fails_to_load_is_refused_not_raised(first, tmp_path):
    """Files that match their record but do not load (zeros where a tensor's zip record was): the
    copy is refused like a bad one and the restore goes on -- a raise here was a crash loop, every
    requeue meeting the same copy."""
    from dslurm import checkpoint as ck

    def prepare(new: Path) -> None:
        for node in ("node0", "node1"):
            ck.remove_generation(node_local(new, node), _gen(node_local(new, node), K + 1).name)
        _forge(_gen(node_local(new, "node0"), K), 0, garble=True)

    got, evs, _ = _resume(first, tmp_path, prepare)
    for rank in (0, 1):
        assert got[rank]["restored"][:2] == [K, "partner"]  # the partner copies, not a crash
    rejected = [e for e in evs if e["event"] == "restore_rejected"]
    assert rejected and all(e["copy"] == "local" and "dcp.load failed" in e["reason"] for e in rejected)
    assert [0] in [e["ranks"] for e in rejected]
    _same_as_reference(first, tmp_path, got, K)


def test_the_site_default_turns_partner_copies_on_unless_the_job_says_otherwise(tmp_path, caplog):
    """`checkpoint.partner` unset takes the site's `storage.partner`; a job's own value wins; one
    process is one node, so the resolved setting shows as the warning that no partner exists."""
    import logging

    from dslurm.checkpoint.dcp import CheckpointManager
    from dslurm.config.training import CheckpointSpec
    cases = [(None, True, True), (False, True, False), (True, False, True), (None, False, False)]
    for i, (job, site, warned) in enumerate(cases):
        caplog.clear()
        spec = CheckpointSpec(tiers="two_tier", partner=job)
        with caplog.at_level(logging.WARNING), CheckpointManager.from_spec(
                tmp_path / f"run{i}", spec, scratch=str(tmp_path / "scratch" / "%n"), site_partner=site) as mgr:
            assert mgr.tier.kind == "two_tier"
        assert ("has no partner node" in caplog.text) == warned, (job, site)


if __name__ == "__main__":
    worker_main(worker)
