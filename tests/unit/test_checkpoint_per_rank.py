"""dslurm/checkpoint/per_rank.py without a process group: what each rank saves, what it gets
back at the same world size, the loader resharding arithmetic, and the refusals by name."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.data import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

from dslurm.checkpoint import RANKS
from dslurm.checkpoint.per_rank import capture, entry_for, reshard_distributed_loader, restore
from dslurm.errors import UserError

DS = list(range(96))


def loader(rank: int, world: int) -> StatefulDataLoader:
    return StatefulDataLoader(DS, batch_size=4, sampler=DistributedSampler(DS, world, rank, shuffle=True, seed=3))


def save_generation(tmp_path, per_rank: list[dict]):
    """A generation's rank files as prepare_generation writes them."""
    gen = tmp_path / "step-x"
    (gen / RANKS).mkdir(parents=True)
    for r, st in enumerate(per_rank):
        (gen / RANKS / f"rank-{r:05d}.json").write_text(json.dumps({"rank": r, "state": st}))
    return gen


def test_each_rank_gets_its_own_state_back_at_the_same_world_size(tmp_path):
    gens = [torch.Generator().manual_seed(10 + r) for r in range(3)]
    dicts = [{"batch": r} for r in range(3)]
    for g in gens:
        torch.rand(5, generator=g)
    saved = [capture([entry_for("g", gens[r]), entry_for("pos", dicts[r])]) for r in range(3)]
    want = [torch.rand(4, generator=g) for g in gens]  # what each stream yields next
    gen = save_generation(tmp_path, saved)
    for r in range(3):
        g, d = torch.Generator().manual_seed(999), {"batch": -1, "stale": 1}
        restore([entry_for("g", g), entry_for("pos", d)], gen, 3, r, 3)
        assert torch.equal(torch.rand(4, generator=g), want[r])
        assert d == {"batch": r}  # restored in place


def test_a_loader_over_a_distributed_sampler_reshards_to_the_epochs_unread_samples(tmp_path):
    old = [loader(r, 3) for r in range(3)]
    read = []
    for dl in old:
        it = iter(dl)
        read += [int(i) for _ in range(4) for i in next(it)]  # 4 batches of 4 on each of 3 ranks
    gen = save_generation(tmp_path, [capture([entry_for("data", dl)]) for dl in old])
    rest = []
    for r in range(2):
        dl = loader(r, 2)
        assert "data: resharded 3 -> 2 ranks" in restore([entry_for("data", dl)], gen, 3, r, 2)
        rest += [int(i) for b in dl for i in b]
    assert sorted(read + rest) == DS  # every sample of the epoch once: nothing read twice or skipped


def test_a_position_that_does_not_split_into_whole_batches_is_refused_by_name(tmp_path):
    old = [loader(r, 3) for r in range(3)]
    for dl in old:
        next(iter(dl))  # 1 batch each: 12 samples do not split into batches of 4 over 2 ranks
    gen = save_generation(tmp_path, [capture([entry_for("data", dl)]) for dl in old])
    with pytest.raises(UserError, match=r"entry 'data': cannot reshard from 3 to 2 ranks.*12 consumed samples"):
        restore([entry_for("data", loader(0, 2))], gen, 3, 0, 2)


def test_per_rank_state_without_a_resharder_is_refused_on_another_world_size(tmp_path):
    # The same value on every rank is refused too: a position means "of my own slice".
    gen = save_generation(tmp_path, [capture([entry_for("pos", {"batch": 7})]) for _ in range(2)])
    with pytest.raises(UserError, match=r"entry 'pos' is per-rank state saved by 2 ranks.*dslurm.runtime.shared"):
        restore([entry_for("pos", {})], gen, 2, 0, 4)


def test_a_custom_resharder_gets_every_old_state():
    seen = {}

    def reshard(obj, states, rank, world):
        seen["args"] = (states, rank, world)
        return {"n": sum(s["n"] for s in states) // world}

    d: dict = {}
    e = entry_for("count", d, reshard)
    assert reshard_distributed_loader is not e.reshard
    e.stateful.load_state_dict(e.reshard(d, [{"n": 4}, {"n": 8}], 1, 3))
    assert d == {"n": 4} and seen["args"] == ([{"n": 4}, {"n": 8}], 1, 3)


def test_a_generation_without_an_entry_the_script_declares_is_refused(tmp_path):
    gen = save_generation(tmp_path, [capture([entry_for("a", {"x": 1})])])
    with pytest.raises(UserError, match=r"no per-rank state for 'b' \(it holds \['a'\]\)"):
        restore([entry_for("b", {})], gen, 1, 0, 1)


def test_what_cannot_be_saved_per_rank_is_named():
    with pytest.raises(ValueError, match=r"entry 'lr' is a float"):
        entry_for("lr", 3e-4)
