"""The Llama-style decoder: shape arithmetic, causality, RoPE, GQA, pipeline splitting."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dslurm.config.models import PRESETS, shape_from
from train.model import Attention, apply_rope, attention_mask, build_model, cross_entropy, rope_cache
from train.parallel.pp import layer_split, split_stage, stage_ids

TINY = PRESETS["tiny"]


def test_parameter_count_matches_model_shape():
    for shape in (TINY, PRESETS["small"], shape_from("tiny", n_kv_heads=4)):
        model = build_model(shape, seed=0)
        assert sum(p.numel() for p in model.parameters()) == shape.num_params()


def test_same_seed_same_weights_and_initial_loss_near_uniform():
    a, b = build_model(TINY, seed=3), build_model(TINY, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    tokens = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len + 1), generator=torch.Generator().manual_seed(0))
    loss = cross_entropy(a(tokens[:, :-1]), tokens[:, 1:])
    assert abs(loss.item() - torch.log(torch.tensor(256.0)).item()) < 1.0


def test_causal_future_tokens_do_not_change_past_logits():
    model = build_model(TINY, seed=0)
    x = torch.randint(0, TINY.vocab_size, (1, 16))
    y = x.clone()
    y[0, 10:] = (y[0, 10:] + 1) % TINY.vocab_size
    with torch.no_grad():
        a, b = model(x), model(y)
    assert torch.allclose(a[:, :10], b[:, :10], atol=1e-6)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_rope_scores_depend_only_on_relative_position():
    rope = rope_cache(8, 32, 10000.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(i: int, j: int) -> float:
        qi = apply_rope(q.expand(1, 32, 1, 8).contiguous(), rope)[0, i, 0]
        kj = apply_rope(k.expand(1, 32, 1, 8).contiguous(), rope)[0, j, 0]
        return float(qi @ kj)

    assert score(5, 3) == pytest.approx(score(20, 18), abs=1e-5)
    assert score(5, 3) != pytest.approx(score(5, 0), abs=1e-3)


def test_gqa_equals_multi_head_attention_with_repeated_kv_weights():
    """n_kv_heads=2 for 4 query heads == MHA whose kv weights repeat each kv head twice."""
    torch.manual_seed(0)
    gqa = Attention(TINY)
    mha = Attention(shape_from("tiny", n_kv_heads=4))
    hd = TINY.head_dim
    with torch.no_grad():
        mha.wq.weight.copy_(gqa.wq.weight)
        mha.wo.weight.copy_(gqa.wo.weight)
        for name in ("wk", "wv"):
            w = getattr(gqa, name).weight.view(TINY.n_kv_heads, hd, TINY.dim)
            getattr(mha, name).weight.copy_(w.repeat_interleave(2, dim=0).reshape(-1, TINY.dim))
    x, rope = torch.randn(2, 16, TINY.dim), rope_cache(hd, 16, TINY.rope_theta)
    assert torch.allclose(gqa(x, rope), mha(x, rope), atol=1e-5)


def test_layer_split_and_loop_style_stage_ids():
    assert layer_split(4, 2) == [range(0, 2), range(2, 4)]
    assert layer_split(5, 3) == [range(0, 2), range(2, 4), range(4, 5)]
    with pytest.raises(ValueError, match=r"n_layers\(2\) < pipeline stages\(4\)"):
        layer_split(2, 4)
    assert stage_ids(1, 2, "1F1B") == [1]
    assert stage_ids(1, 2, "Interleaved1F1B") == [1, 3]


def test_pipeline_stages_keep_unsplit_names_and_compose_to_the_full_model():
    full = build_model(TINY, seed=0)
    stages = [split_stage(full, i, 4) for i in range(4)]
    names = [set(s.state_dict()) for s in stages]
    assert set().union(*names) == set(full.state_dict())
    assert sum(len(n) for n in names) == len(full.state_dict())  # each parameter lives once
    assert "layers.3.attention.wq.weight" in names[3] and "output.weight" in names[3]
    assert stages[1].tok_embeddings is None and stages[1].output is None
    x = torch.randint(0, TINY.vocab_size, (2, 8))
    with torch.no_grad():
        h = x
        for s in stages:
            h = s(h)
        assert torch.allclose(h, full(x), atol=1e-6)


def test_a_sliding_window_changes_only_the_queries_it_cuts_off():
    """Mistral's window (q - k < window, as transformers): positions before it see what causal sees."""
    plain = build_model(TINY, seed=0)
    windowed = build_model(dataclasses.replace(TINY, sliding_window=4), seed=0)
    x = torch.randint(0, TINY.vocab_size, (1, 16), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b = plain(x), windowed(x)
    assert torch.allclose(a[:, :4], b[:, :4], atol=1e-6) and not torch.allclose(a[:, 4:], b[:, 4:], atol=1e-3)
    mask = attention_mask(5, 2)
    assert mask is not None and mask.int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 1, 0, 0],
                                                        [0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]
    docs = torch.tensor([[0, 0, 1, 1, 1]])
    assert attention_mask(5, None, docs)[0, 0].int().tolist() == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0],
                                                                  [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]
