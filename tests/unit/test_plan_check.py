"""`dslurm plan check`'s pure half (dslurm/plan/check.py, dslurm/plan/rank.py): which ranks, what the
planner expects of one rank, and the 10% verdict. The measured half runs in
tests/integration/test_plan_check_gloo.py against a real gloo run."""

from __future__ import annotations

import pytest

from dslurm.config.layout import Layout
from dslurm.config.models import PRESETS
from dslurm.errors import UserError
from dslurm.plan.check import Row, compare, parse_ranks
from dslurm.plan.layout import Cluster, Workload
from dslurm.plan.memory import trainer_bytes
from dslurm.plan.rank import default_ranks, held_params, rank_figures, rank_stages

L405 = Layout(tp=8, pp=16, dp_shard=128, microbatches=32)


def test_default_ranks_are_the_first_and_last_stage_and_a_tp_edge():
    assert default_ranks(L405) == [0, 15 * 1024, 16383]
    assert default_ranks(Layout(dp_shard=16, tp=2)) == [0, 31]
    assert parse_ranks("7, 0,7", 8) == [0, 7] and parse_ranks(None, 8) is None
    with pytest.raises(UserError, match=r"--ranks '0,8': '8' is not a rank of the job's world of 8. Fix: "):
        parse_ranks("0,8", 8)


def test_a_rank_holds_its_own_stages_layers_and_ends():
    model = PRESETS["405b"]  # 126 layers over 32 stages: 30 of 4, then 2 of 3
    assert rank_stages(L405, "Interleaved1F1B", 0) == ([0, 16], 32)
    assert rank_stages(L405, "Interleaved1F1B", 16383) == ([15, 31], 32)
    first, layers = held_params(model, L405, [0, 16], 32)
    assert layers == 8
    norms = 2 * model.dim
    assert first == 8 * (model.layer_params(norms=False) / 8 + norms) + model.vocab_size * model.dim / 8
    last, layers = held_params(model, L405, [15, 31], 32)
    assert layers == 7 and last == 7 * (model.layer_params(norms=False) / 8 + norms) + (
        model.vocab_size * model.dim / 8 + model.dim)


def test_the_trainers_bytes_per_parameter_over_dp_shard():
    work = Workload(schedule="Interleaved1F1B", recompute="full", bytes=trainer_bytes("bf16"))
    f = rank_figures(PRESETS["405b"], L405, work, Cluster(nodes=2048), "full", 0)
    shard = f.params / 128
    assert f.bytes["params"] == shard * 4 and f.bytes["grads"] == shard * 4 and f.bytes["optimizer"] == shard * 8
    assert ("pp", "send_recv") not in f.collectives  # no schedule runs in the check
    assert f.collectives[("dp_shard", "all_gather")] == f.params * 2  # once per schedule step under PP, bf16


def test_more_than_ten_percent_apart_fails_and_a_term_on_one_side_only_fails():
    assert not Row(0, "params", 109.0, 100.0, True).bad and Row(0, "params", 111.0, 100.0, True).bad
    assert not Row(0, "activations", 300.0, 100.0, False).bad  # shown, not gated
    assert Row(0, "tp all_reduce", 5.0, 0.0, True).apart == float("inf")

    class Pred:
        bytes = {"params": 1.0, "grads": 1.0, "optimizer": 2.0, "activations": 5.0}
        collectives = {("tp", "all_gather"): 10.0}

    got = {"params": 1, "grads": 1, "optimizer": 2, "activations": 9,
           "collectives": [{"dim": "tp", "op": "all_gather", "bytes": 10},
                           {"dim": "cp", "op": "all_gather", "bytes": 3}]}
    rows = {r.term: r for r in compare(3, got, Pred())}
    assert [t for t, r in rows.items() if r.bad] == ["cp all_gather"]  # the planner forgot a kind
