"""Partner copies, the pure parts (dslurm/checkpoint/replica.py): the ring, which copy each rank
restores from, what a restore says about it, partner retention; the fingerprint's comparison."""

from __future__ import annotations

from pathlib import Path

import torch

from dslurm import checkpoint as ck
from dslurm.checkpoint import fingerprint as fp
from dslurm.checkpoint import replica, tiers

A, B, C = (ck.generation_name(s, token="abcdef") for s in (4, 8, 12))
NODES = ["node1", "node1", "node2", "node2"]


def test_ring_sends_to_the_next_node_never_its_own():
    assert replica.ring([[0, 1], [2, 3], [4, 5]]) == {0: 2, 1: 3, 2: 4, 3: 5, 4: 0, 5: 1}
    assert replica.ring([[0, 1]]) == {}  # one node: no partner
    assert replica.ring([[0, 1, 2], [3]]) == {0: 3, 1: 3, 2: 3, 3: 0}  # uneven nodes


P2, P0 = {2: "partner", 3: "partner"}, {0: "partner", 1: "partner"}


def test_restore_takes_own_local_copies_first():
    held = [[A, B], [A, B], [A, B], [A, B]]
    copies = [{B: P2}, {B: P2}, {B: P0}, {B: P0}]
    cands, why = replica.restore_candidates(held, copies, NODES, None)
    assert [c.name for c in cands] == [B, A] and cands[0].pulls == {}
    assert why == f"{B} is locally committed on all 4 ranks"


def test_a_lost_node_pulls_the_newest_from_its_partner_even_past_the_durable_pointer():
    held = [[A, B, C], [A, B, C], [], []]  # node2's scratch is gone
    copies = [{B: P2, C: P2}, {B: P2, C: P2}, {}, {}]
    ptr = ck.Pointer(C, 12)  # the pointer names C: its durable copy may be gone
    cands, why = replica.restore_candidates(held, copies, NODES, ptr)
    assert [c.name for c in cands] == [C]  # B is older than the pointer
    assert cands[0].pulls == {2: (0, "partner"), 3: (1, "partner")}  # spread over the holder's ranks
    assert why == f"{C}: ranks 2-3 from the partner copy on node1; 2 ranks from their own local copy"


def test_a_copy_cut_short_is_not_a_candidate_and_the_pointer_is_a_floor():
    held = [[A, B, C], [A, B, C], [], []]
    copies = [{A: P2, B: {2: "partner"}}, {A: P2, B: {2: "partner"}}, {}, {}]  # B's copy of rank 3 never committed
    cands, _ = replica.restore_candidates(held, copies, NODES, None)
    assert [c.name for c in cands] == [A]
    cands, why = replica.restore_candidates(held, copies, NODES, ck.Pointer(B, 8))
    assert cands == [] and "no local generation on 2 of 4 ranks" in why and "no copy on another node" in why


def test_ranks_placed_on_other_nodes_pull_that_nodes_own_copy_never_a_file_onto_itself():
    # ranks 0-1 now run on the emptied node, 2-3 on the node that holds 0-1's local copies
    nodes = ["node2", "node2", "node1", "node1"]
    held = [[], [], [], []]
    copies = [{}, {}, {B: {0: "local", 1: "local", 2: "partner", 3: "partner"}},
              {B: {0: "local", 1: "local", 2: "partner", 3: "partner"}}]
    (c,), why = replica.restore_candidates(held, copies, nodes, None)
    assert c.pulls == {0: (2, "local"), 1: (3, "local"), 2: (3, "partner"), 3: (2, "partner")}
    assert "from the local copy on node1" in why and "from the partner copy on node1" in why
    # a node's own local tier is never a pull source for a rank on that node (same directory)
    held = [[], [B], [B], [B]]
    copies = [{B: {0: "local"}}, {B: {0: "local"}}, {}, {}]
    assert replica.restore_candidates(held, copies, NODES, None)[0] == []


def _commit(root: Path, name: str, ranks: list[int], groups: list[list[int]] | None = None) -> None:
    gen = ck.generations_dir(root) / name
    gen.mkdir(parents=True)
    for r in ranks:
        tiers.write_record(gen, tiers.LocalRecord(name, ck.parse_step(name) or 0, r, 4, {}, {}, 0.0,
                                                  groups or [[0, 1], [2, 3]]))


def test_held_copies_and_retention(tmp_path):
    root = replica.partner_root(tmp_path)
    _commit(root, A, [2, 3])
    _commit(root, B, [2])
    _commit(root, C, [])  # a transfer cut short: no record
    _commit(tmp_path, C, [0, 1])
    _commit(tmp_path, B, [0], groups=[[0, 2], [1, 3]])  # another grouping: its files do not fit
    groups = [[0, 1], [2, 3]]
    assert replica.held_copies(tmp_path, 4, {}, groups) == {A: P2, B: {2: "partner"}, C: {0: "local", 1: "local"}}
    assert replica.held_copies(tmp_path, 8, {}, groups) == {}  # another world size
    replica.drop_copy(tmp_path, "partner", B, 2)
    assert B not in replica.held_copies(tmp_path, 4, {}, groups)
    doomed = replica.collect_partner_garbage(tmp_path, keep=1, in_flight=[C])
    assert doomed == [B] and [g.name for g in ck.list_generations(root)] == [A, C]


def test_fingerprint_mismatches_name_the_tensor():
    saved = fp.of_tensors([("model.w", torch.arange(4.0)), ("optim.m", torch.ones(2))])
    same = fp.of_tensors([("model.w", torch.arange(4.0)), ("optim.m", torch.ones(2))])
    assert fp.mismatches(saved, same) == []
    wrong = fp.of_tensors([("model.w", torch.arange(4.0) + 1e-3 * torch.tensor([0, 0, 1.0, 0]))])
    got = fp.mismatches(saved, wrong)
    assert [k for k, _ in got] == ["model.w"] and "crc32" in got[0][1]  # optim.m: not asked for, no mismatch
    reshaped = fp.of_tensors([("model.w", torch.arange(4.0).reshape(2, 2))])
    assert fp.mismatches(saved, reshaped) == [("model.w", "float32[2, 2] != saved float32[4]")]
    assert fp.mismatches(None, same) == []  # a generation saved before fingerprints
    cast = fp.of_tensors([("model.w", torch.arange(4.0).to(torch.bfloat16))])
    assert fp.mismatches(saved, cast) == []  # restored into another dtype (DCP casts): not comparable
    assert fp.tensor_of("tensor model.w: crc32 1 != saved 2 (fingerprint)") == "model.w"
    assert fp.tensor_of("/x/__0_0.distcp: crc32 1 != 2") == ""
